"""Builders of small, deterministic reference models, and the bundled example for the README."""

from pathlib import Path

from .builders import BUILDERS, cnn, encoder, hybrid, mlp, mobilenet, mobilenetv2, resnet, resnet50, speech, transformer, yolo_like

EXAMPLE = Path(__file__).with_name("example_mobilenet.onnx")
EXAMPLE_INPUTS = Path(__file__).with_name("example_mobilenet_inputs.npz")
EXAMPLE_ENCODER = Path(__file__).with_name("example_encoder.onnx")  # made by make_example_encoder.py

__all__ = ["BUILDERS", "EXAMPLE", "EXAMPLE_ENCODER", "EXAMPLE_INPUTS", "cnn", "encoder", "hybrid", "mlp", "mobilenet",
           "mobilenetv2", "resnet",
           "resnet50", "speech", "transformer", "yolo_like"]
