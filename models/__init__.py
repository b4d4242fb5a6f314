"""Builders of small, deterministic reference models, and the bundled example for the README."""

from pathlib import Path

from .builders import BUILDERS, cnn, mlp, mobilenet, resnet, transformer

EXAMPLE = Path(__file__).with_name("example_cnn.onnx")

__all__ = ["BUILDERS", "EXAMPLE", "cnn", "mlp", "mobilenet", "resnet", "transformer"]
