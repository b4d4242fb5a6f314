"""The `kernels` runner: a stage's steps (from `lowering.lower`) as fused calls into a verified library; it needs
only numpy and the library, so a board runs it from a bundle."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..runner import Runner
from .lowering import PRODUCTS, bias_axis

if TYPE_CHECKING:
    from uhop_onnx.custom_ops.library import Library
    from uhop_onnx.custom_ops.spec import Epilogue


@dataclass
class Step:
    """One kernel call: computes `output` from `values`, with a fused epilogue, bias and residual."""

    kind: str  # the op type that produces the value: Conv, Gemm, MatMul, or Relu/Clip/Add on their own
    output: str
    fn: Callable[[dict[str, Any], Epilogue, np.ndarray | None, Residual | None], np.ndarray]
    epilogue: Epilogue
    bias: np.ndarray | None = None  # a fused bias Add's constant
    residual: str | None = None  # the value a residual Add sums with the product
    donate: bool = False  # whether the residual's array may be overwritten (a value of this stage read last here)

    def __call__(self, values: dict[str, Any]) -> np.ndarray:
        residual = None if self.residual is None else Residual(values[self.residual], self.donate)
        return self.fn(values, self.epilogue, self.bias, residual)


@dataclass(frozen=True)
class Residual:
    """A value to add before the clamp, and whether the kernel may write its result over it."""

    value: np.ndarray
    donated: bool


class KernelsRunner(Runner):
    """Runs a stage's steps (from `lower`) as fused kernel calls; needs only numpy and the library."""

    def __init__(self, program: Mapping[str, Any], constants: Mapping[str, np.ndarray], lib: Library, threads: int,
                 tune: bool, exclusive: bool = True):
        from uhop_onnx.custom_ops.spec import Epilogue

        self.lib, self.threads, self.tune, self.exclusive = lib, threads, tune, exclusive
        self.constants = dict(constants)
        self.outputs = list(program["outputs"])
        self.schedules: dict[tuple[str, int], Any] = {}  # (op key, threads) -> Schedule
        self._choosing = threading.Lock()
        self.steps: list[Step] = []
        last_read = {name: k for k, s in enumerate(program["steps"]) for name in (*s["inputs"], s.get("residual"))}
        produced = {s["output"] for s in program["steps"]}
        for k, s in enumerate(program["steps"]):
            lo, hi = (float(d if v is None else v) for v, d in ((s["lo"], "-inf"), (s["hi"], "inf")))
            epilogue = Epilogue(lo, hi)
            bias = None if s["bias"] is None else self.constants[s["bias"]].astype(np.float32)
            if s["op"] in PRODUCTS:
                fn = getattr(self, f"_{s['op'].lower()}")(s["inputs"], s["attrs"])
            else:
                fn = self._elementwise(s["inputs"][0])
            residual = s.get("residual")
            donate = (residual in produced and last_read[residual] == k and residual not in s["inputs"]
                      and residual not in self.outputs)
            self.steps.append(Step(s["op"], s["output"], fn, epilogue, bias, residual, donate))

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        values = {**self.constants, **{k: np.asarray(v) for k, v in feeds.items()}}
        for step in self.steps:
            values[step.output] = step(values)
        if not self.exclusive:
            self.lib.rest()
        return {name: values[name] for name in self.outputs}

    # -- kernels -------------------------------------------------------------------------------------------

    def _schedule(self, op):
        key = (op.key, self.threads)
        if key not in self.schedules:
            from uhop_onnx.custom_ops.autotune import schedule_for

            with self._choosing:  # one search at a time: concurrent ones would time each other
                if key not in self.schedules:
                    self.schedules[key] = schedule_for(self.lib, op, self.threads, self.tune)
        return self.schedules[key]

    def _conv(self, inputs, attrs):
        from uhop_onnx.custom_ops.spec import OpSpec

        x_name, w_name, *rest = inputs
        b_name = rest[0] if rest else ""
        strides, pads, dilations = (tuple(attrs[key]) for key in ("strides", "pads", "dilations"))
        group = attrs["group"]

        plans = {}  # (input shape, weight shape) -> schedule, and the constant weights packed for it

        def conv(values, epilogue, fused, residual):
            x, w = values[x_name], values[w_name]
            key = (x.shape, w.shape)
            if key not in plans:
                schedule = self._schedule(OpSpec("conv2d", (*x.shape, w.shape[0], *w.shape[2:], *strides, *pads,
                                                            *dilations, group), epilogue))
                constant = schedule.packs_weights and w_name in self.constants
                plans[key] = schedule, self.lib.pack(w.reshape(w.shape[0], -1), schedule, group) if constant else None
            schedule, packed = plans[key]
            bias = _sum_bias(values[b_name] if b_name else None, fused, w.shape[0])
            return self.lib.conv2d(x, w, schedule, bias=bias, strides=strides, pads=pads, dilations=dilations,
                                   group=group, epilogue=epilogue, packed=packed,
                                   residual=None if residual is None else residual.value,
                                   out=residual.value if residual and residual.donated else None)
        return conv

    def _gemm(self, inputs, attrs):
        from uhop_onnx.custom_ops.spec import OpSpec

        a_name, b_name, *rest = inputs
        c_name = rest[0] if rest else ""
        trans_a, trans_b, alpha, beta = (attrs[key] for key in ("transA", "transB", "alpha", "beta"))
        packs = self._right_packs(b_name, bool(trans_b))

        def gemm(values, epilogue, fused, _residual):
            a = values[a_name].T if trans_a else values[a_name]
            b = values[b_name].T if trans_b else values[b_name]
            if not a.shape[0] * b.shape[1]:  # an empty batch: the library takes no zero-sized operand
                return np.zeros((a.shape[0], b.shape[1]), np.float32)
            bias = None if not c_name or beta == 0.0 else np.float32(beta) * values[c_name]
            bias = fused if bias is None else (bias if fused is None else bias + fused)
            schedule = self._schedule(OpSpec("gemm", (a.shape[0], b.shape[1], a.shape[1], trans_a, trans_b),
                                             epilogue))
            return self.lib.gemm(a, b, schedule, alpha=alpha, bias=bias, epilogue=epilogue,
                                 packed_b=packs(schedule))
        return gemm

    def _right_packs(self, b_name: str, transposed: bool) -> Callable[[Any], Any]:
        """Per schedule, a constant right operand packed once (None for a computed one)."""
        if b_name not in self.constants or self.constants[b_name].ndim != 2:
            return lambda _schedule: None
        b = self.constants[b_name]
        packs: dict[int, Any] = {}  # micro-kernel -> packed

        def packed(schedule):
            if schedule.micro not in packs:
                packs[schedule.micro] = self.lib.pack(b if transposed else b.T, schedule, side=1)
            return packs[schedule.micro]
        return packed

    def _matmul(self, inputs, _attrs):
        from uhop_onnx.custom_ops.spec import OpSpec

        a_name, b_name = inputs
        packs = self._right_packs(b_name, False)

        def matmul(values, epilogue, fused, _residual):
            a, b = values[a_name], values[b_name]
            m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
            bias = None if fused is None else np.broadcast_to(fused.reshape(-1), (n,))
            shape = (*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), m, n)
            if not math.prod(shape):  # an empty batch: the library takes no zero-sized operand
                return np.zeros(shape, np.float32)
            if b.ndim == 2:  # fold a's batch into its rows
                schedule = self._schedule(OpSpec("gemm", (int(np.prod(a.shape[:-1])), n, k, 0, 0), epilogue))
                out = self.lib.gemm(a.reshape(-1, k), b, schedule, bias=bias, epilogue=epilogue,
                                    packed_b=packs(schedule))
                return out.reshape(*a.shape[:-1], n)
            batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
            a, b = np.broadcast_to(a, (*batch, m, k)), np.broadcast_to(b, (*batch, k, n))
            out = np.empty((*batch, m, n), np.float32)
            schedule = self._schedule(OpSpec("gemm", (m, n, k, 0, 0), epilogue))
            for index in np.ndindex(*batch):
                self.lib.gemm(a[index], b[index], schedule, bias=bias, epilogue=epilogue, out=out[index])
            return out
        return matmul

    def _elementwise(self, x_name: str):
        """A Relu, Clip, bias Add or residual sum on its own, as one bias+residual+clamp pass."""

        def elementwise(values, epilogue, bias, residual):
            x = values[x_name]
            other = None if residual is None else residual.value
            out = other if residual and residual.donated else None
            if bias is None:
                return self.lib.bias_act(x, epilogue=epilogue, residual=other, out=out)
            axis = bias_axis(bias.shape, x.ndim)
            vector = np.full(x.shape[-1], bias.item(), np.float32) if bias.size == 1 else bias.reshape(-1)
            return self.lib.bias_act(x, bias=vector, axis=axis, epilogue=epilogue, residual=other, out=out)
        return elementwise


def _sum_bias(own: np.ndarray | None, fused: np.ndarray | None, channels: int) -> np.ndarray | None:
    """A Conv's bias plus a fused channel-bias Add, as one vector of `channels` values."""
    parts = [np.broadcast_to(np.asarray(p, np.float32).reshape(-1), (channels,)) for p in (own, fused) if p is not None]
    return None if not parts else parts[0] if len(parts) == 1 else parts[0] + parts[1]
