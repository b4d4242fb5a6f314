"""What a compiled stage is (`Runner`), and the runners' shared machinery: a pool of runtime objects that serve one
call at a time, and a runner that builds its stage once per input shape for a fixed-shape runtime. Runners import
only numpy and their own runtime, so a bundle can run them on a board that has nothing else."""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

from uhop_onnx.foundation.errors import CheckError, InputError
from uhop_onnx.foundation.inputs import free_inputs, shape_values

if TYPE_CHECKING:
    import onnx

class Runner(ABC):
    """A compiled stage. Feeds and results are keyed by the stage's ONNX tensor names, in ONNX layout.

    Values are numpy arrays, or tensors resident on `device` when the next stage shares that device;
    `to_host` brings one back to a numpy array. `run` may be called from many threads at once, as
    ONNX Runtime's `run` may: a runtime object that serves one call at a time is pooled or locked.
    """

    device: str = "cpu"

    @abstractmethod
    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]: ...

    def to_host(self, value: Any) -> np.ndarray:
        return np.asarray(value)

    def close(self) -> None:
        """Release the runtime's resources."""

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


T = TypeVar("T")


class Pool(Generic[T]):
    """Runtime objects that serve one call at a time (an infer request, an interpreter), made on demand:
    one per concurrent caller, each reused by later calls. `take` one, and `give` it back when done (a
    list's `pop` and `append` are atomic, and cost far less than a lock or a queue)."""

    def __init__(self, make: Callable[[], T], first: T | None = None):
        self._make = make
        self._idle: list[T] = [] if first is None else [first]

    def take(self) -> T:
        """An idle object, or a new one when all are in use."""
        try:
            return self._idle.pop()
        except IndexError:
            return self._make()

    def give(self, item: T) -> None:
        self._idle.append(item)

    @contextmanager
    def borrow(self) -> Iterator[T]:
        """An object for one call, given back when the call succeeds. One whose call raised is dropped, never
        handed to the next caller: a runtime may be left broken by a failed call."""
        item = self.take()
        yield item
        self.give(item)


SHAPE_LIMIT = 32  # input shapes a fixed-shape runtime builds a stage for, unless $UHOP_MAX_SHAPES says otherwise


def shape_limit() -> int:
    """`$UHOP_MAX_SHAPES`, else `SHAPE_LIMIT`."""
    text = os.environ.get("UHOP_MAX_SHAPES", "")
    if not text:
        return SHAPE_LIMIT
    if not text.isdigit() or int(text) < 1:
        raise InputError(f"UHOP_MAX_SHAPES must be a positive integer, got {text!r}")
    return int(text)


def _listing(shapes: Mapping[str, tuple]) -> str:
    return ", ".join(f"{name} {list(shape)}" for name, shape in shapes.items()) or "these input values"


class PerShapeRunner(Runner):
    """A stage on a runtime that builds for fixed shapes, run at whatever its inputs are: one runner built per
    set of input shapes seen and values of its small integer inputs (`shape_values`: shapes, repeats, slice
    bounds another stage computed), by `build(shapes, values)` (the provider's `build_at`: the stage fixed at
    them, with those values as constants, simplified there, as capability was asked of), the last `keep`
    kept. Each new key costs a conversion, so at most `limit` keys are built (default `$UHOP_MAX_SHAPES`, else
    `SHAPE_LIMIT`); a call at one more is refused with `InputError`. A key whose build its check refuses
    (`CheckError`) raises that again on every call at it, without converting again. Safe to call from many threads: a
    key is built once, and a runner dropped from the cache is left to the calls still using it."""

    def __init__(self, model: onnx.ModelProto, build: Callable[[dict[str, tuple], dict[str, np.ndarray]], Runner],
                 keep: int = 8,
                 limit: int | None = None):
        from onnx import helper

        self.model, self.build, self.keep = model, build, keep
        self.limit = shape_limit() if limit is None else limit
        self.built: set[tuple] = set()  # every key a runner was built for
        self.inputs = free_inputs(model)
        declared = {v.name: v.type.tensor_type.elem_type for v in model.graph.input}
        self.values = {name: helper.tensor_dtype_to_np_dtype(declared[name]) for name in shape_values(model)}
        self.runners: dict[tuple, Runner] = {}
        self.refused: dict[tuple, CheckError] = {}  # keys whose build its check refused
        self._lock = threading.Lock()

    @staticmethod
    def needed(model: onnx.ModelProto) -> bool:
        """Whether a stage has free dimensions or small integer inputs, so is built per key it is run at."""
        return bool(free_inputs(model) or shape_values(model))

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        shapes = [tuple(np.shape(feeds[name])) for name in self.inputs]
        values = {name: np.asarray(feeds[name], dtype) for name, dtype in self.values.items()}
        key = (*shapes, *((v.shape, v.tobytes()) for v in values.values()))
        runner = self.runners.get(key)  # a key built and kept: found without the lock
        return (self._built(key, dict(zip(self.inputs, shapes)), values) if runner is None else runner).run(feeds)

    def _built(self, key: tuple, shapes: dict[str, tuple], values: dict[str, np.ndarray]) -> Runner:
        """The runner for `key`, built here unless another call built it meanwhile."""
        with self._lock:
            runner = self.runners.get(key)
            if key in self.refused:  # built once and refused by its check: not converted again
                raise self.refused[key]
            if runner is None:
                if key not in self.built and len(self.built) >= self.limit:
                    raise InputError(f"a stage on a fixed-shape runtime is built for at most {self.limit} input "
                                     f"shapes, and has them all; {_listing(shapes)} would be one more: send a "
                                     "shape it was run at, or raise the limit ($UHOP_MAX_SHAPES; serve "
                                     "--max-shapes)")
                self.built.add(key)
                try:
                    runner = self.build(shapes, values)
                except CheckError as error:
                    self.refused[key] = error
                    raise
                while len(self.runners) >= self.keep:
                    self.runners.pop(next(iter(self.runners)))
                self.runners[key] = runner
        return runner
