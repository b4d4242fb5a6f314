"""The board runner: an `.rknn` model on the NPU through rknn-toolkit-lite2 (`RKNNLite`), aarch64 only.

Imports numpy at module level and `rknnlite` only when a runner is made, so a bundle runs it on a
board that has nothing else.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..runner import Runner

# `core_mask` option -> RKNNLite's NPU_CORE_* constant: one core, a pair, all three cores of an RK3588,
# or the runtime's choice.
CORE_MASKS = ("auto", "0", "1", "2", "0_1", "0_1_2", "all")
RUNTIME_LIBRARY = Path("/usr/lib/librknnrt.so")


def data_formats(count: int) -> list[str]:
    """The layout to declare for each of `count` inputs: our stages are ONNX, so NCHW (the runtime ignores
    it below 4-D)."""
    return ["nchw"] * count


def named_outputs(outputs: Sequence[np.ndarray] | None, names: Sequence[str],
                  dtypes: Mapping[str, np.dtype]) -> dict[str, np.ndarray]:
    """The runtime's outputs (in model order) by ONNX name, cast to the stage's declared dtypes."""
    if outputs is None or len(outputs) != len(names):
        raise RuntimeError(f"the RKNN runtime returned {0 if outputs is None else len(outputs)} outputs "
                           f"for {len(names)} ({', '.join(names)})")
    return {name: np.asarray(value).astype(dtypes.get(name, value.dtype), copy=False)
            for name, value in zip(names, outputs, strict=True)}


class RknnLiteRunner(Runner):
    """A converted stage on the NPU. Float inputs are quantized and outputs dequantized by the runtime
    itself with the model's own scales, so int8 models take and give float tensors here too. One context
    serves one call at a time (the NPU cores it holds run one inference), so calls take turns."""

    def __init__(self, rknn: Path, inputs: Sequence[str], outputs: Sequence[str],
                 dtypes: Mapping[str, np.dtype], core_mask: str = "auto", formats: Sequence[str] | None = None):
        from rknnlite.api import RKNNLite

        if not RUNTIME_LIBRARY.exists():
            raise ImportError(f"{RUNTIME_LIBRARY} not found: install Rockchip's NPU runtime (librknnrt) on this board")
        self.inputs, self.outputs, self.dtypes = list(inputs), list(outputs), dict(dtypes)
        self.formats = list(formats or data_formats(len(self.inputs)))
        self.lite = RKNNLite(verbose=False)
        self.lock = threading.Lock()
        _check(self.lite.load_rknn(str(rknn)), f"load_rknn({rknn})")
        _check(self.lite.init_runtime(core_mask=getattr(RKNNLite, f"NPU_CORE_{core_mask.upper()}")),
               f"init_runtime(core_mask={core_mask})")

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        inputs = [np.ascontiguousarray(feeds[name]) for name in self.inputs]
        with self.lock:
            outputs = self.lite.inference(inputs=inputs, data_format=self.formats)
        return named_outputs(outputs, self.outputs, self.dtypes)

    def close(self) -> None:
        self.lite.release()


def _check(code: int, step: str) -> None:
    if code != 0:
        raise RuntimeError(f"RKNNLite.{step} returned {code}")
