"""A built kernel library loaded through ctypes, called with numpy arrays.

Strides are taken from the numpy views themselves (a transpose is a view, a broadcast bias has stride 0), so
every pointer and extent the C code sees lies inside an array numpy owns. The C functions release no Python
objects and ctypes drops the GIL around each call.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .spec import (
    ALGORITHMS,
    NONE,
    Epilogue,
    KernelSpecError,
    LibrarySpec,
    Schedule,
    check_schedule,
)

_F32P = ctypes.c_void_p  # float arrays, passed as their data address (the arrays outlive each call)
_I = ctypes.c_ssize_t
_INT = ctypes.c_int
_F = ctypes.c_float
_ERRORS = {1: "unknown micro-kernel variant", 2: "cache blocks do not hold whole micro-tiles", 3: "out of memory",
           4: "inconsistent shapes", 5: "unknown convolution algorithm"}


def _ptr(array: np.ndarray | None) -> int | None:
    return None if array is None else array.ctypes.data


def _elements(strides: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(s // 4 for s in strides)


def _f32(array) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype != np.float32:
        raise KernelSpecError(f"kernels take float32 arrays, got {array.dtype}")
    if any(s % 4 for s in array.strides):
        return np.ascontiguousarray(array)
    return array


def _output(out: np.ndarray | None, shape: tuple[int, ...], residual: np.ndarray | None,
            what: str) -> np.ndarray:
    """The array a kernel writes: `out` (checked) or a new one, holding `residual` when one is given."""
    if out is None:
        out = np.empty(shape, np.float32)
    elif out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise KernelSpecError(f"{what}: out must be a C-contiguous float32 array of shape {shape}")
    if residual is not None and residual is not out:
        if np.shape(residual) != shape:
            raise KernelSpecError(f"{what}: residual of shape {np.shape(residual)} for an output of shape {shape}")
        np.copyto(out, residual)
    return out


def _pack_form(schedule: Schedule, side: int | None = None) -> tuple[int, int, int]:
    """(side, micro-kernel, kc) of constant weights a call with `schedule` reads: side 0 packs them as A in kc
    blocks, side 1 (the transpose, for a gemm's right operand or the implicit-oc convolution's weights) as B
    panels over the whole depth. A convolution's schedule says which side."""
    if side is None:
        side = int(schedule.algo == "implicit-oc")
    return side, schedule.micro, 0 if side else schedule.kc


@dataclass(frozen=True)
class Packed:
    """Constant weights, `groups` blocks of `rows` x `depth`, packed once in one form (`_pack_form`); usable
    only by calls whose schedule reads that form, on that shape."""

    data: np.ndarray
    form: tuple[int, int, int]
    groups: int
    rows: int
    depth: int

    def pointer(self, schedule: Schedule, groups: int, rows: int, depth: int, side: int | None = None):
        wanted = (_pack_form(schedule, side), groups, rows, depth)
        if (self.form, self.groups, self.rows, self.depth) != wanted:
            raise KernelSpecError(f"packed operand (side, micro, kc = {self.form}, {self.groups}x{self.rows}x"
                                  f"{self.depth}) does not fit {wanted[0]}, {groups}x{rows}x{depth}")
        return _ptr(self.data)


def bias_view(shape: tuple[int, ...], axis: int, has_bias: bool) -> tuple[int, int, int]:
    """`bias_act`'s (outer, channels, inner) view of a tensor: around the bias axis, or, without a bias, one
    row of every value (so the kernel runs full vectors, not one per element)."""
    size = int(np.prod(shape))
    if not has_bias:
        return 1, 1, size
    shape = shape or (1,)
    axis = axis % len(shape)
    return int(np.prod(shape[:axis])), shape[axis], int(np.prod(shape[axis + 1:]))


class Library:
    """The kernels of one built library: `gemm`, `conv2d`, `bias_act`, `gemm_naive`."""

    def __init__(self, path: Path, spec: LibrarySpec):
        self.path = Path(path)
        self.spec = spec
        self.cdll = ctypes.CDLL(str(self.path))
        c = self.cdll
        c.uk_gemm.argtypes = [_INT] * 5 + [_I] * 3 + [_F32P, _I, _I, _F32P, _I, _I, _F32P, _I, _F, _F32P, _I, _I,
                                                      _INT, _F, _F, _F32P, _F32P]
        c.uk_conv2d.argtypes = [_INT] * 6 + [_I] * 16 + [_F32P] * 4 + [_INT, _INT, _F, _F, _F32P]
        c.uk_packed_size.argtypes = [_INT, _INT, _I, _I, _I]
        c.uk_packed_size.restype = _I
        c.uk_pack.argtypes = [_INT, _INT, _INT, _I, _I, _I, _F32P, _I, _I, _F32P]
        c.uk_bias_act.argtypes = [_I] * 3 + [_F32P] * 4 + [_INT, _F, _F]
        c.uk_gemm_naive.argtypes = [_I] * 3 + [_F32P] * 3
        if c.uk_variants() != len(spec.micro):
            raise KernelSpecError(f"{self.path.name} has {c.uk_variants()} micro-kernels, the spec {len(spec.micro)}")

    def rest(self) -> None:
        """Send the worker threads to sleep now rather than after their spin: the process runs other work next."""
        self.cdll.uk_rest()

    def _check(self, code: int, what: str) -> None:
        if code:
            raise KernelSpecError(f"{what}: {_ERRORS.get(code, f'error {code}')} ({self.path.name})")

    def pack(self, a: np.ndarray, schedule: Schedule, groups: int = 1, side: int | None = None) -> Packed:
        """Pack `a` ((groups * M) x K, any strides) for calls with `schedule`: a convolution's weights, a gemm's
        left operand (side 0) or the transpose of its right operand (side 1)."""
        check_schedule(self.spec, schedule)
        a = _f32(a)
        rows, depth = a.shape[0] // groups, a.shape[1]
        if rows * groups != a.shape[0]:
            raise KernelSpecError(f"pack: {a.shape[0]} rows do not split into {groups} groups")
        form = _pack_form(schedule, side)
        side, micro, _kc = form
        data = np.empty(max(1, self.cdll.uk_packed_size(micro, side, groups, rows, depth)), np.float32)
        self._check(self.cdll.uk_pack(micro, side, schedule.kc, groups, rows, depth, _ptr(a), *_elements(a.strides),
                                      _ptr(data)), "pack")
        return Packed(data, form, groups, rows, depth)

    def gemm(self, a: np.ndarray, b: np.ndarray, schedule: Schedule, *, alpha: float = 1.0,
             bias: np.ndarray | None = None, epilogue: Epilogue = NONE, out: np.ndarray | None = None,
             packed: Packed | None = None, packed_b: Packed | None = None) -> np.ndarray:
        """`clamp(alpha * a @ b + bias)` for 2-D `a` (M, K) and `b` (K, N), any strides; `bias` broadcasts
        to (M, N). `out` (M, N) must have unit column stride. With `packed` (from `pack(a, schedule)`), `a`
        itself is not read; with `packed_b` (from `pack(b.T, schedule, side=1)`), `b` is not."""
        check_schedule(self.spec, schedule)
        a, b = _f32(a), _f32(b)
        (m, k), (k2, n) = a.shape, b.shape
        if k != k2:
            raise KernelSpecError(f"gemm: a is {a.shape} and b is {b.shape}; inner dimensions differ")
        out = np.empty((m, n), np.float32) if out is None else out
        if out.shape != (m, n) or out.dtype != np.float32 or (n > 1 and out.strides[1] != 4):
            raise KernelSpecError(f"gemm: out must be float32 ({m}, {n}) with unit column stride")
        brs = bcs = 0
        if bias is not None:
            bias = np.broadcast_to(_f32(bias), (m, n))
            brs, bcs = _elements(bias.strides)
        self._check(self.cdll.uk_gemm(
            schedule.micro, schedule.threads, schedule.mc, schedule.kc, schedule.nc, m, n, k,
            _ptr(a), *_elements(a.strides), _ptr(b), *_elements(b.strides), _ptr(out), max(out.strides[0] // 4, n),
            alpha, _ptr(bias), brs, bcs, int(epilogue.clamps), epilogue.lo, epilogue.hi,
            None if packed is None else packed.pointer(schedule, 1, m, k, 0),
            None if packed_b is None else packed_b.pointer(schedule, 1, n, k, 1)), f"gemm {m}x{n}x{k}")
        return out

    def conv2d(self, x: np.ndarray, w: np.ndarray, schedule: Schedule, *, bias: np.ndarray | None = None,
               strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), group: int = 1,
               epilogue: Epilogue = NONE, packed: Packed | None = None, residual: np.ndarray | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
        """NCHW `x` convolved with OIHW `w`; `pads` is (top, left, bottom, right) as ONNX orders them.
        `packed` is `pack(w.reshape(OC, -1), schedule, group)`, for the algorithms that pack weights.
        `residual` (shaped as the output) is added before the clamp; `out` receives the result and may be
        `residual` itself."""
        check_schedule(self.spec, schedule)
        x, w = np.ascontiguousarray(_f32(x)), np.ascontiguousarray(_f32(w))
        n, c, h, wd = x.shape
        oc, cg, kh, kw = w.shape
        if cg * group != c:
            raise KernelSpecError(f"conv2d: weight {w.shape} with group={group} does not match {c} input channels")
        oh = (h + pads[0] + pads[2] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
        ow = (wd + pads[1] + pads[3] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
        if bias is not None:
            bias = np.ascontiguousarray(_f32(bias)).reshape(oc)
        y = _output(out, (n, oc, max(oh, 0), max(ow, 0)), residual, "conv2d")
        self._check(self.cdll.uk_conv2d(
            schedule.micro, schedule.threads, schedule.mc, schedule.kc, schedule.nc,
            ALGORITHMS.index(schedule.algo), n, c, h, wd, oc, kh, kw, *strides, *pads, *dilations, group,
            _ptr(x), _ptr(w), _ptr(bias), _ptr(y), int(residual is not None), int(epilogue.clamps), epilogue.lo,
            epilogue.hi, None if packed is None else packed.pointer(schedule, group, oc // group, cg * kh * kw)),
            f"conv2d x{x.shape} w{w.shape}")
        return y

    def bias_act(self, x: np.ndarray, *, bias: np.ndarray | None = None, axis: int = -1,
                 epilogue: Epilogue = NONE, residual: np.ndarray | None = None,
                 out: np.ndarray | None = None) -> np.ndarray:
        """`clamp(x + bias + residual)` where `bias` is a vector along `axis` (or None) and `residual` (or
        None) has the shape of `x`; `out` receives the result and may be `x` or `residual` itself."""
        x = np.ascontiguousarray(_f32(x))
        outer, channels, inner = bias_view(x.shape, axis, bias is not None)
        if bias is not None:
            bias = np.ascontiguousarray(_f32(bias)).reshape(-1)
            if bias.size != channels:
                raise KernelSpecError(f"bias_act: bias of {bias.size} values for axis {axis} of size {channels}")
        if residual is not None:
            residual = np.ascontiguousarray(_f32(residual))
            if residual.shape != x.shape:
                raise KernelSpecError(f"bias_act: residual of shape {residual.shape} for x of shape {x.shape}")
        y = _output(out, x.shape, None, "bias_act")
        self._check(self.cdll.uk_bias_act(outer, channels, inner, _ptr(x), _ptr(y), _ptr(bias), _ptr(residual),
                                          int(epilogue.clamps), epilogue.lo, epilogue.hi), "bias_act")
        return y

    def gemm_naive(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a, b = np.ascontiguousarray(_f32(a)), np.ascontiguousarray(_f32(b))
        out = np.empty((a.shape[0], b.shape[1]), np.float32)
        self._check(self.cdll.uk_gemm_naive(a.shape[0], b.shape[1], a.shape[1], _ptr(a), _ptr(b), _ptr(out)),
                    "gemm_naive")
        return out
