"""`Backend`: uhop-onnx as an `onnx.backend.base.Backend`, so the ONNX backend test suite can run through it.

Every model is placed without profiling (`profile=False`) on the providers present, or on the ones given
as `providers=`; `assign=` pins nodes, as in `InferenceSession`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx.backend.base import Backend as OnnxBackend
from onnx.backend.base import BackendRep as OnnxBackendRep

from .foundation.errors import InputError
from .products.session import InferenceSession


class BackendRep(OnnxBackendRep):
    """A prepared model: an `InferenceSession` fed positionally (in `get_inputs()` order) or by name."""

    def __init__(self, session: InferenceSession):
        self.session = session

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        names = [i.name for i in self.session.get_inputs()]
        if isinstance(inputs, Mapping):
            feeds = dict(inputs)
        else:
            values = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
            if len(values) > len(names):
                raise InputError(f"{len(values)} inputs given; the model takes {len(names)}: {', '.join(names)}")
            feeds = dict(zip(names, values))
        return tuple(self.session.run(None, feeds))


class Backend(OnnxBackend):
    """uhop-onnx behind the ONNX backend interface, on the CPU."""

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", providers: Sequence[Any] | None = None,
                assign: Mapping[str, str] | None = None, threads: int | None = None, fallback: bool = False,
                **kwargs: Any) -> BackendRep:
        """Plan and compile `model`. Other keyword arguments (the test runner's tolerances) are ignored."""
        if not cls.supports_device(device):
            raise InputError(f"device {device!r} is not supported; valid devices: CPU")
        session = InferenceSession(model, providers=providers, assign=assign, profile=False, threads=threads,
                                   fallback=fallback)
        return BackendRep(session)

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple[Any, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper() == "CPU"
