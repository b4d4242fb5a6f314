"""Voice activity detection with silero-vad's ONNX model (shipped in its wheel, run by ONNX Runtime when asked
`onnx=True`), 512 samples a call with the LSTM state carried from call to call, on speech synthesised with
espeak-ng (speech.wav; make_speech.py writes it). silero-vad passes no providers."""

import wave
from pathlib import Path

import numpy as np
import torch
from silero_vad import get_speech_timestamps, load_silero_vad


def build():
    return load_silero_vad(onnx=True)


def inputs() -> list:
    with wave.open(str(Path(__file__).with_name("speech.wav"))) as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), np.int16)
    return [torch.from_numpy(pcm.astype(np.float32) / 32768)]


def call(model, audio) -> dict:
    speech = get_speech_timestamps(audio, model, sampling_rate=16000)
    return {"timestamps": [[s["start"], s["end"]] for s in speech]}


def sessions(model) -> dict:
    return {"silero_vad": model.session}
