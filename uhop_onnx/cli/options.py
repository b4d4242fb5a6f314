"""The options several commands share, and what they mean to the Python API."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer


ProvidersOption = Annotated[str | None, typer.Option("--providers", "-p", help="Comma-separated provider ids, in "
                            "preference order (openvino:GPU picks a device). Default: every provider present.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr.")]
WideOption = Annotated[bool, typer.Option("--wide", help="Every column and row, not only the summary.")]
ShapeOption = Annotated[list[str] | None, typer.Option("--shape", help="NAME:1x3x224x224, the shape of an input "
                        "to generate (repeatable). Default: a plan folder's recorded shapes, else the model's.")]
InputsOption = Annotated[Path | None, typer.Option("--inputs", "-i", help="An .npz (one array per input), an .npy "
                         "(a one-input model) or an ONNX test_data_set_* folder. Default: seeded random inputs.")]
SeedOption = Annotated[int, typer.Option("--seed", help="Seed of the generated inputs.")]
ThreadsOption = Annotated[int | None, typer.Option("--threads", min=1, help="Intra-op threads for every provider.")]
MeasuredShapeOption = Annotated[list[str] | None, typer.Option("--shape", help="NAME:1x3x640x640, the shape to "
                                "measure an input at (repeatable). Needed for each free dimension but a leading "
                                "one, which is taken as 1.")]
MeasuredInputsOption = Annotated[Path | None, typer.Option("--inputs", "-i", help="Sample inputs to measure on "
                                 "instead of random values: an .npz (one array per input), an .npy (a one-input "
                                 "model) or an ONNX test_data_set_* folder.")]


PrecisionOption = Annotated[str, typer.Option("--precision", help="fp32, auto, bf16, fp16 or int8. With auto, "
                            "every precision the providers offer competes; with bf16, fp16 or int8, that one or "
                            "fp32, per stage. The fastest within --tolerance of ONNX Runtime fp32 wins.")]
ToleranceOption = Annotated[float | None, typer.Option("--tolerance", help="The error allowed per output and "
                            "sample: max|y-ref| <= TOLERANCE*(1+max|ref|). Default: 1e-2.")]
CalibrationOption = Annotated[Path | None, typer.Option("--calibration", help="Calibration samples: an .npz whose "
                              "arrays carry a leading sample axis, or a folder of .npz files (one sample each). "
                              "int8 is tried only with them.")]


def measured_at(shape: list[str] | None, inputs: Path | None, precision: str = "fp32",
                 tolerance: float | None = None, calibration: Path | None = None) -> dict[str, Any]:
    """`shapes=` and `inputs=` from `--shape` and `--inputs`; `precision=`, `tolerance=`, `calibration=` from
    theirs (left out at the fp32 default)."""
    from ..foundation.inputs import parse_shapes

    chosen = {"shapes": parse_shapes(shape), "inputs": inputs}
    if precision != "fp32" or tolerance is not None or calibration is not None:
        chosen |= {"precision": precision, "tolerance": tolerance, "calibration": calibration}
    return chosen


def provider_specs(text: str | None) -> list | None:
    """Provider specs from `--providers` (None: every one present)."""
    return [p.strip() for p in text.split(",") if p.strip()] if text else None
