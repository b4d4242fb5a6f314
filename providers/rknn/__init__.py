"""Rockchip RKNN NPU: ONNX stages converted to `.rknn` by rknn-toolkit2 and run by rknn-toolkit-lite2.

Presence, decided honestly:
- On a Rockchip board (aarch64, `rknnlite` importable, `librknnrt.so` installed, a Rockchip SoC in the
  device tree): present, and stages run on the NPU with `core_mask` cores. Converting a stage there
  needs the toolkit environment too (rknn-toolkit2 has aarch64 wheels).
- On any other host: absent for running. With the option `simulate=True` it is present when the
  toolkit environment exists (`uhop-onnx setup rknn`): stages are converted for `target` and run in
  Rockchip's simulator, for accuracy checks and planning, never for timing. `providers=None` never
  picks the simulator; ask for it: `("rknn", {"simulate": True})`.

Options: `target` (rk3588 default, rk3576, rk3568, rk3566, rk3562), `dtype` (fp16 default, or int8),
`calibration` (int8: an `.npz` of the stage's inputs, samples stacked on a new first axis),
`core_mask` (board: auto, 0, 1, 2, 0_1, 0_1_2, all; not given, a bundle's stage gets the `cores` rule's, or
on the board, as `tune` writes it, the fastest measured there), `simulate` (bool).

Bundles: `export` writes the stage's `.rknn` (needs the toolkit environment, on any host) with what
`load_artifact` needs on the board. Its tolerance against ONNX Runtime is `FP16_TOLERANCE` for fp16, its atol
scaled by the stage's largest output (`converter.fp16_tolerance`). int8
has no bound that holds for every input, so the bundle carries a measured one: the stage is run in the
simulator on its calibration samples right after it is built, and the atol is `INT8_MARGIN` times the
largest error seen there (rtol as fp16). It holds for inputs like the calibration data, and `verify`
fails, rightly, on inputs unlike them.
"""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Iterable, Mapping
from functools import cached_property
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from uhop_onnx.errors import ProviderError

from ..base import Absent, Artifact, Provider, Runner, output_dtypes
from . import cores
from .runner import CORE_MASKS, RUNTIME_LIBRARY, data_formats
from .setup import TOOLKIT, is_ready, venv_path
from .table import DTYPES, FP16_TOLERANCE, RKNN_TABLE, TARGETS, remarks

if TYPE_CHECKING:
    import onnx

    from ..capability import Support

__all__ = ["Rknn"]

log = logging.getLogger(__name__)

SETUP = "uhop-onnx setup rknn"  # makes the toolkit environment: conversion and the simulator, on any host
INT8_MARGIN = 2.0  # int8 atol: this many times the largest error on the calibration samples

DEVICE_TREE = Path("/proc/device-tree/compatible")


class Rknn(Provider):
    """The Rockchip NPU (or, with `simulate`, Rockchip's simulator of it on this host)."""

    id = "rknn"
    install = "pip install rknn-toolkit-lite2"  # on the board; a host's absences name `uhop-onnx setup rknn`
    table = RKNN_TABLE
    artifact_format = "rknn"
    bundle_precisions = ("fp32", "fp16", "int8")  # fp32: its default dtype (fp16, the NPU has no fp32)
    simulator_name = "the RKNN simulator"
    option_types = {"target": str, "dtype": str, "calibration": str, "core_mask": str, "simulate": bool}
    static_shapes = True
    fp16_said = False  # whether `export` has warned that its fp16 stages could be int8
    kind = "npu"
    npu_resource = "rknn"  # `ray start --resources '{"rknn": 3}'` on the boards

    def __init__(self, options: Mapping[str, Any] | None = None, threads: int | None = None):
        super().__init__(options, threads)
        self.target = _choice(self.options, "target", TARGETS)
        self.dtype = _choice(self.options, "dtype", DTYPES)
        self.core_mask = _choice(self.options, "core_mask", CORE_MASKS)
        self.simulate = self.options.get("simulate", False)
        if not isinstance(self.simulate, bool):
            raise ProviderError(f"rknn: simulate must be true or false, got {self.simulate!r}")

    @property
    def tolerance(self) -> dict[str, float] | None:
        """How far results may be from ONNX Runtime CPU: fp16 bounds; int8 has none (compare by similarity)."""
        return FP16_TOLERANCE if self.dtype == "fp16" else None

    @classmethod
    def known_options(cls) -> list[dict[str, Any]]:
        return [{}, {"simulate": True}]

    def probe(self) -> tuple[str, str]:
        if self.simulate:
            if not is_ready():
                raise Absent(f"rknn-toolkit2 environment not found at {venv_path()} (simulator)", install=SETUP)
            return TOOLKIT.split("==")[1], f"simulator ({self.target})"
        machine = platform.machine()
        if machine not in ("aarch64", "arm64"):
            raise Absent(f"no Rockchip NPU on this {machine} host: its runtime runs on aarch64 boards; "
                         "to convert and simulate here, use ('rknn', {'simulate': True}) after "
                         "`uhop-onnx setup rknn`", install=SETUP)
        try:
            lite = version("rknn-toolkit-lite2")
        except PackageNotFoundError:
            raise Absent("rknn-toolkit-lite2 not installed") from None
        if not RUNTIME_LIBRARY.exists():
            raise Absent(f"{RUNTIME_LIBRARY} not found: install Rockchip's NPU runtime (librknnrt) on this board")
        soc = board_soc()
        if soc != self.target:
            raise Absent(f"target {self.target} but this board is {soc or 'not a Rockchip SoC'}")
        return lite, f"NPU ({soc})"

    def export_blocker(self) -> str | None:
        if is_ready():
            return None
        return (f"rknn-toolkit2 environment not found at {venv_path()} (it converts stages to .rknn); "
                f"create it with `{SETUP}`")

    def export(self, model: onnx.ModelProto, folder: Path, stem: str) -> Artifact:
        """The stage as an `.rknn` file for `target` and `dtype`, with the names, dtypes, layouts and cores
        the board's runner needs, and its tolerance (see the module's docstring). An int8 stage carries the
        calibration samples it was quantized on too (`stem.calibration.npz`, samples on the first axis), so that
        a simulator elsewhere rebuilds the same model."""
        from .converter import convert, convert_measured, fp16_tolerance, model_inputs

        path, files = folder / f"{stem}.rknn", [f"{stem}.rknn"]
        if self.dtype == "int8":
            samples = self.samples(model)
            if not samples:
                raise ProviderError("rknn int8: the toolkit quantizes on calibration samples; give calibration=... "
                                    "(or the calibration option, an .npz)")
            error = convert_measured(model, path, self.target, self.dtype, samples)
            tolerance = {"rtol": FP16_TOLERANCE["rtol"], "atol": max(INT8_MARGIN * error, FP16_TOLERANCE["atol"])}
            files.append(f"{stem}.calibration.npz")
            np.savez(folder / files[-1], **{name: np.stack([s[name] for s in samples]) for name in samples[0]})
        else:
            convert(model, path, self.target, self.dtype)
            tolerance = fp16_tolerance(model)
            if not self.fp16_said:
                log.warning("rknn: stages are fp16; the NPU is fastest at int8: export with --precision int8 "
                            "--calibration DATA (precision='int8', calibration=...)")
                self.fp16_said = True
        inputs = model_inputs(model)
        core_mask, timings = self._core_mask(model, path)
        options = {"target": self.target, "dtype": self.dtype, "core_mask": core_mask, "inputs": inputs,
                   "outputs": [o.name for o in model.graph.output], "data_formats": data_formats(len(inputs)),
                   "dtypes": {name: dtype.name for name, dtype in output_dtypes(model).items()},
                   **({"core_mask_ms": timings} if timings else {})}
        return Artifact("rknn", files, options, dict(tolerance))

    def _core_mask(self, model: onnx.ModelProto, path: Path) -> tuple[str, dict[str, float] | None]:
        """The `core_mask` option where given; else, on the board, the fastest of the masks timed there on the
        stage just written (with the figures), and elsewhere the rule's (see `cores`)."""
        if "core_mask" in self.options:
            return self.core_mask, None
        if self.simulate or not self.present:
            return cores.chosen(model, self.target), None
        from .converter import model_inputs
        from .runner import RknnLiteRunner

        outputs, dtypes = [o.name for o in model.graph.output], output_dtypes(model)
        timings = cores.measured(model, self.target, lambda mask: RknnLiteRunner(
            path, model_inputs(model), outputs, dtypes, mask))
        return cores.fastest(timings), timings

    @classmethod
    def _load_artifact(cls, folder: Path, artifact: Mapping[str, Any], threads: int | None, exclusive: bool,
                       trusted: bool, allowed_delegates: Iterable[str | os.PathLike]) -> Runner:
        """A bundle's `.rknn` stage on this board's NPU, on the cores its `core_mask` names (the NPU has no
        thread count, so `threads` and `exclusive` do not apply)."""
        from .runner import RknnLiteRunner

        options = artifact["options"]
        return RknnLiteRunner(folder / artifact["files"][0], options["inputs"], options["outputs"],
                              {name: np.dtype(dtype) for name, dtype in options["dtypes"].items()},
                              options["core_mask"], options["data_formats"])

    def simulator(self) -> Provider | None:
        """Rockchip's simulator of the NPU (`simulate`), where `uhop-onnx setup rknn` made the toolkit."""
        return None if self.simulate else Rknn({**self.options, "simulate": True}, self.threads)

    def query(self, model: onnx.ModelProto) -> dict[str, Support]:
        """The list's shape remarks, then the converter's word: a model the toolkit cannot build raises,
        and the caller asks node by node."""
        from uhop_onnx.graph import Graph

        verdicts = remarks(Graph.from_model(model))
        if is_ready():
            self.toolkit.build(model, self.target, "fp16")
        return verdicts

    @cached_property
    def toolkit(self):
        from .converter import Toolkit

        return Toolkit()

    def precisions(self) -> list[str]:
        """fp16 and int8, the NPU's own (it has no fp32): the `dtype` option of each variant."""
        return ["fp16", "int8"]

    def at_precision(self, precision: str, calibration: Any = None) -> Provider:
        """The `dtype` option at `precision` (int8 quantized on the values `calibration` gives a stage's
        inputs, unless the `calibration` option names a file); fp32 leaves the options as they are."""
        variant = super().at_precision(precision, calibration)
        if precision in DTYPES:
            variant.options, variant.dtype = {**self.options, "dtype": precision}, precision
        return variant

    def lower(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """The model itself: rknn-toolkit2 quantizes an int8 stage when it builds it."""
        return model

    def samples(self, model: onnx.ModelProto | None = None) -> list[dict[str, np.ndarray]]:
        """Calibration feeds from the `calibration` option's `.npz` (samples on the first axis), else the
        values the variant's calibration gives `model`'s inputs."""
        path = self.options.get("calibration")
        if not path:
            return self.calibration.of(model) if self.calibration is not None and model is not None else []
        from uhop_onnx.files import read_npz

        arrays = read_npz(Path(path).expanduser())
        count = min(len(a) for a in arrays.values())
        return [{name: a[k] for name, a in arrays.items()} for k in range(count)]

    def build(self, model: onnx.ModelProto, *, exclusive: bool = True) -> Runner:
        """The stage, at fixed shapes, converted to `.rknn` (run in the simulator with `simulate`)."""
        from .converter import SimulatorRunner, convert, model_inputs

        if self.simulate:
            return SimulatorRunner(model, self.target, self.dtype, self.samples(model))
        import tempfile

        from .runner import RknnLiteRunner

        path = Path(tempfile.mkdtemp(prefix="uhop-rknn-")) / "stage.rknn"
        convert(model, path, self.target, self.dtype, self.samples(model))
        return RknnLiteRunner(path, model_inputs(model), [o.name for o in model.graph.output],
                              output_dtypes(model), self.core_mask)


def board_soc() -> str | None:
    """The Rockchip SoC named in the device tree (`rockchip,rk3588` -> `rk3588`), if any."""
    try:
        entries = DEVICE_TREE.read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in entries:
        vendor, _, chip = entry.decode(errors="replace").partition(",")
        if vendor == "rockchip" and chip in TARGETS:
            return chip
    return None


def _choice(options: Mapping[str, Any], name: str, valid: tuple[str, ...]) -> str:
    value = options.get(name, valid[0])
    if value not in valid:
        raise ProviderError(f"rknn: unknown {name} {value!r}; valid: {', '.join(valid)}")
    return value
