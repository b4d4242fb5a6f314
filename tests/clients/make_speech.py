"""Writes speech.wav: three sentences spoken by espeak-ng, with pauses between them, as 16 kHz mono 16-bit PCM.

    python tests/clients/make_speech.py        (needs `apt-get install espeak-ng`, and scipy)

The file is kept in the repository, so the voice-activity client runs where espeak-ng is missing.
"""

import io
import subprocess
import wave
from pathlib import Path

import numpy as np
from scipy.signal import resample_poly

SENTENCES = ["Voice activity detection finds speech.",
             "After a pause, it starts again.",
             "Then the recording ends."]
PAUSES_S = [1.5, 0.8, 0.5]


def say(text: str) -> np.ndarray:
    """espeak-ng's 22050 Hz samples for `text`, resampled to 16 kHz, as float32 in [-1, 1]."""
    wav = subprocess.run(["espeak-ng", "-s", "150", "--stdout", text], capture_output=True, check=True).stdout
    with wave.open(io.BytesIO(wav)) as w:
        assert w.getframerate() == 22050 and w.getnchannels() == 1, "espeak-ng's output format changed"
        x = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768
    return resample_poly(x, 320, 441).astype(np.float32)


def main() -> None:
    parts = [np.zeros(8000, np.float32)]
    for text, pause in zip(SENTENCES, PAUSES_S):
        parts += [say(text), np.zeros(int(pause * 16000), np.float32)]
    pcm = (np.clip(np.concatenate(parts), -1, 1) * 32767).astype(np.int16)
    with wave.open(str(Path(__file__).with_name("speech.wav")), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000), w.writeframes(pcm.tobytes())


if __name__ == "__main__":
    main()
