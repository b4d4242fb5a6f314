"""Rockchip RKNN NPU: ONNX stages converted to `.rknn` by rknn-toolkit2 and run by rknn-toolkit-lite2.

Presence, decided honestly:
- On a Rockchip board (aarch64, `rknnlite` importable, `librknnrt.so` installed, a Rockchip SoC in the
  device tree): present, and stages run on the NPU with `core_mask` cores. Converting a stage there
  needs the toolkit environment too (rknn-toolkit2 has aarch64 wheels).
- On any other host: absent for running. With the option `simulate=True` it is present when the
  toolkit environment exists (`uhop-onnx setup rknn`): stages are converted for `target` and run in
  Rockchip's simulator, for accuracy checks and planning, never for timing. `providers=None` never
  picks the simulator; ask for it: `("rknn", {"simulate": True})`.

Options: `target` (rk3588 default, rk3576, rk3568, rk3566, rk3562), `calibration` (int8: an `.npz` of the
stage's inputs, samples stacked on a new first axis),
`core_mask` (board: auto, 0, 1, 2, 0_1, 0_1_2, all; not given, a bundle's stage gets the `cores` rule's, or
on the board, as `tune` writes it, the fastest measured there), `simulate` (bool).

Precisions: the NPU computes fp16 (at fp32, its default, too: it has no fp32) or int8 (`at_precision("int8")`),
the dtype the toolkit builds a stage at (`dtype`); the precision is the stage's one record of it.

Bundles: `export` writes the stage's `.rknn` (needs the toolkit environment, on any host) with what
`load_artifact` needs on the board. Its tolerance against ONNX Runtime is `FP16_TOLERANCE` for fp16 (the
precision gate's rule at 1e-2: fp16 rounds relative to the values, layer after layer); an int8 stage, at
precision int8, is held to the tolerance the precision gate passed it at (the manifest records that one).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable, Mapping
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from uhop_onnx.foundation.errors import ProviderError, logger

from ..base import FP32, Absent, Artifact, ArtifactFormat, Lowering, Provider, output_dtypes
from ..runner import Runner
from . import cores
from .runner import CORE_MASKS, RUNTIME_LIBRARY, data_formats
from .setup import TOOLKIT, is_ready, venv_path
from .table import FP16_TOLERANCE, RKNN_TABLE, TARGETS, remarks

if TYPE_CHECKING:
    import onnx

    from ..capability import Support

__all__ = ["Rknn"]

log = logger(__name__)

SETUP = "uhop-onnx setup rknn"  # makes the toolkit environment: conversion and the simulator, on any host

DEVICE_TREE = Path("/proc/device-tree/compatible")


class RknnFile(ArtifactFormat):
    """A stage's `.rknn` file for the board's NPU, converted by rknn-toolkit2, and Rockchip's simulator of it."""

    name = "rknn"
    simulator_name = "the RKNN simulator"

    def blocker(self, provider: Provider) -> str | None:
        if is_ready():
            return None
        return (f"rknn-toolkit2 environment not found at {venv_path()} (it converts stages to .rknn); "
                f"create it with `{SETUP}`")

    def export(self, provider: Provider, model: onnx.ModelProto, folder: Path, stem: str) -> Artifact:
        """The stage as an `.rknn` file for `target` at the provider's dtype, with the names, dtypes, layouts and
        cores the board's runner needs, and an fp16 one its tolerance (see the module's docstring). An int8 stage
        carries the calibration samples it was quantized on too (`stem.calibration.npz`, samples on the first
        axis), so that a simulator elsewhere rebuilds the same model."""
        from .converter import convert, model_inputs

        path, files = folder / f"{stem}.rknn", [f"{stem}.rknn"]
        if provider.dtype == "int8":
            samples = provider.samples(model)
            if not samples:
                raise ProviderError("rknn int8: the toolkit quantizes on calibration samples; give calibration=... "
                                    "(or the calibration option, an .npz)")
            convert(model, path, provider.target, provider.dtype, samples)
            tolerance = None  # the precision gate's (`export` records it)
            files.append(f"{stem}.calibration.npz")
            np.savez(folder / files[-1], **{name: np.stack([s[name] for s in samples]) for name in samples[0]})
        else:
            convert(model, path, provider.target, provider.dtype)
            tolerance = FP16_TOLERANCE
            if not provider.fp16_said:
                log.warning("rknn: stages are fp16; the NPU is fastest at int8: export with --precision int8 "
                            "--calibration DATA (precision='int8', calibration=...)")
                provider.fp16_said = True
        inputs = model_inputs(model)
        core_mask, timings = provider.chosen_cores(model, path)
        options = {"target": provider.target, "core_mask": core_mask, "inputs": inputs,
                   "outputs": [o.name for o in model.graph.output], "data_formats": data_formats(len(inputs)),
                   "dtypes": {name: dtype.name for name, dtype in output_dtypes(model).items()},
                   **({"core_mask_ms": timings} if timings else {})}
        return Artifact("rknn", files, options, tolerance and dict(tolerance))

    def load(self, folder: Path, artifact: Mapping[str, Any], threads: int | None, exclusive: bool, trusted: bool,
             allowed_delegates: Iterable[str | os.PathLike]) -> Runner:
        """A bundle's `.rknn` stage on this board's NPU, on the cores its `core_mask` names (the NPU has no
        thread count, so `threads` and `exclusive` do not apply)."""
        from .runner import RknnLiteRunner

        options = artifact["options"]
        return RknnLiteRunner(folder / artifact["files"][0], options["inputs"], options["outputs"],
                              {name: np.dtype(dtype) for name, dtype in options["dtypes"].items()},
                              options["core_mask"], options["data_formats"])

    def simulator(self, provider: Provider) -> Provider | None:
        """Rockchip's simulator of the NPU (`simulate`), at the provider's precision, where `uhop-onnx setup rknn`
        made the toolkit."""
        if provider.simulate:
            return None
        return Rknn({**provider.options, "simulate": True}, provider.threads).at_precision(provider.precision,
                                                                                            provider.calibration)


class Rknn(Provider):
    """The Rockchip NPU (or, with `simulate`, Rockchip's simulator of it on this host)."""

    id = "rknn"
    install = "pip install rknn-toolkit-lite2"  # on the board; a host's absences name `uhop-onnx setup rknn`
    table = RKNN_TABLE
    kind = "npu"
    npu_resource = "rknn"  # `ray start --resources '{"rknn": 3}'` on the boards
    # The toolkit builds each stage itself, at the dtype of its precision (and quantizes an int8 one); fp32 is the
    # NPU's default, fp16, so not offered as a variant of its own.
    lowerings = {"fp32": Lowering(offered=lambda _: False), "fp16": FP32, "int8": FP32}
    format = RknnFile()
    option_types = {"target": str, "calibration": str, "core_mask": str, "simulate": bool}
    static_shapes = True
    fp16_said = False  # whether `export` has warned that its fp16 stages could be int8

    def __init__(self, options: Mapping[str, Any] | None = None, threads: int | None = None):
        if "dtype" in (options or {}):
            value = options["dtype"]
            raise ProviderError(f"rknn: a stage's dtype is its precision, not an option (got dtype {value!r}): ask "
                                f"for precision int8 or fp16 (precision='int8', --precision int8); at fp32, the "
                                "default, the NPU computes fp16")
        super().__init__(options, threads)
        self.target = _choice(self.options, "target", TARGETS)
        self.core_mask = _choice(self.options, "core_mask", CORE_MASKS)
        self.simulate = self.options.get("simulate", False)
        if not isinstance(self.simulate, bool):
            raise ProviderError(f"rknn: simulate must be true or false, got {self.simulate!r}")

    @property
    def dtype(self) -> str:
        """What the toolkit builds a stage at: int8 at precision int8, else fp16 (the NPU has no fp32)."""
        return "int8" if self.precision == "int8" else "fp16"

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
        from importlib.metadata import PackageNotFoundError, version

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

    def chosen_cores(self, model: onnx.ModelProto, path: Path) -> tuple[str, dict[str, float] | None]:
        """The `core_mask` option where given; else, on the board, the fastest of the masks timed there on the
        stage just written to `path` (with the figures), and elsewhere the rule's (see `cores`)."""
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

    def query(self, model: onnx.ModelProto) -> dict[str, Support]:
        """The list's shape remarks, then the converter's word: a model the toolkit cannot build raises,
        and the caller asks node by node."""
        from uhop_onnx.foundation.graph import Graph

        verdicts = remarks(Graph.from_model(model))
        if is_ready():
            self.toolkit.build(model, self.target, "fp16")
        return verdicts

    @cached_property
    def toolkit(self):
        from .converter import Toolkit

        return Toolkit()

    def samples(self, model: onnx.ModelProto | None = None) -> list[dict[str, np.ndarray]]:
        """Calibration feeds from the `calibration` option's `.npz` (samples on the first axis), else the
        values the variant's calibration gives `model`'s inputs."""
        path = self.options.get("calibration")
        if not path:
            return self.calibration.of(model) if self.calibration is not None and model is not None else []
        from uhop_onnx.foundation.files import read_npz

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
