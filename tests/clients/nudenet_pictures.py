"""Object detection with nudenet's NudeDetector: a YOLOv8n (320n.onnx, shipped in its wheel) on pictures that
scikit-image ships, one at a time and as a batch of four. nudenet passes no providers."""

from pathlib import Path

import skimage.data
from nudenet import NudeDetector

PICTURES = ["astronaut.png", "camera.png", "coffee.png", "chelsea.png", "rocket.jpg"]


def build() -> NudeDetector:
    return NudeDetector()


def inputs() -> list:
    folder = Path(skimage.data.__file__).parent
    paths = [str(folder / name) for name in PICTURES]
    return paths + [paths[:4]]


def call(detector: NudeDetector, pictures) -> list:
    if isinstance(pictures, list):
        return detector.detect_batch(pictures, batch_size=4)
    return detector.detect(pictures)


def sessions(detector: NudeDetector) -> dict:
    return {"320n": detector.onnx_session}
