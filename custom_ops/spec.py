"""The kernel spec language: what a kernel library is built for, what one call computes, and how it is scheduled.

A `LibrarySpec` is fixed at build time (target ISA, dtype, register-blocked micro-kernel shapes, k-loop unroll).
An `OpSpec` is one operation on fixed shapes with its fused epilogue (bias, Relu, Clip). A `Schedule` is chosen
per `OpSpec` at run time (micro-kernel, cache blocks, algorithm, threads): the autotuner searches it.
`check_*` refuse anything outside the target's limits before any code is generated.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field

from uhop_onnx.foundation.errors import UhopError


class KernelSpecError(UhopError):
    """A kernel spec or schedule asks for something the target cannot do."""


@dataclass(frozen=True)
class Target:
    """An instruction set: vector width in fp32 lanes, vector registers, and how to compile for it."""

    name: str
    lanes: int
    registers: int
    compiler: str
    flags: tuple[str, ...]
    header: str  # the C include that brings the intrinsics


TARGETS = {
    "x86-64-avx512": Target("x86-64-avx512", 16, 32, "cc", ("-mavx512f", "-mavx2", "-mfma"), "#include <immintrin.h>"),
    "x86-64-avx2": Target("x86-64-avx2", 8, 16, "cc", ("-mavx2", "-mfma"), "#include <immintrin.h>"),
    "aarch64-neon": Target("aarch64-neon", 4, 32, "aarch64-linux-gnu-gcc", (), "#include <arm_neon.h>"),
    "scalar": Target("scalar", 1, 32, "cc", (), ""),
}


@dataclass(frozen=True)
class MicroKernel:
    """An `mr` x `nr` register tile of C, kept in named vector variables across the k loop."""

    mr: int
    nr: int

    @property
    def name(self) -> str:
        return f"{self.mr}x{self.nr}"


# Micro-kernels per target, best first: 6x16 keeps 12 AVX2 accumulators plus 2 B vectors and 1 A broadcast.
# 7x48 tiles the 7x7 images of late ResNet layers whole when output pixels are the rows (implicit-oc).
MICRO_KERNELS = {
    "x86-64-avx512": (MicroKernel(14, 32), MicroKernel(8, 32), MicroKernel(6, 64), MicroKernel(1, 32),
                      MicroKernel(7, 48)),
    "x86-64-avx2": (MicroKernel(6, 16), MicroKernel(4, 24), MicroKernel(8, 8), MicroKernel(1, 16)),
    "aarch64-neon": (MicroKernel(8, 12), MicroKernel(4, 16), MicroKernel(1, 16)),
    "scalar": (MicroKernel(4, 4), MicroKernel(1, 8)),
}


@dataclass(frozen=True)
class LibrarySpec:
    """One shared library: every kernel for one target and dtype, with these micro-kernels."""

    target: str
    micro: tuple[MicroKernel, ...] = ()
    unroll: int = 4
    dtype: str = "float32"

    def __post_init__(self):
        if not self.micro and self.target in MICRO_KERNELS:
            object.__setattr__(self, "micro", MICRO_KERNELS[self.target])


@dataclass(frozen=True)
class Epilogue:
    """The clamp applied to each output element after the product and its bias: Relu is `lo=0`, Relu6
    `lo=0, hi=6`, none leaves both infinite."""

    lo: float = float("-inf")
    hi: float = float("inf")

    @property
    def clamps(self) -> bool:
        return self.lo != float("-inf") or self.hi != float("inf")


NONE = Epilogue()
RELU = Epilogue(lo=0.0)


@dataclass(frozen=True)
class OpSpec:
    """One operation on fixed shapes. `dims` is `(M, N, K, transA, transB)` for gemm and
    `(N, C, H, W, OC, KH, KW, stride_h, stride_w, pad_t, pad_l, pad_b, pad_r, dil_h, dil_w, group)` for conv2d."""

    op: str  # gemm | conv2d
    dims: tuple[int, ...]
    epilogue: Epilogue = field(default_factory=Epilogue)
    dtype: str = "float32"
    layout: str = "row-major"  # gemm: row-major; conv2d: NCHW with OIHW weights

    @property
    def key(self) -> str:
        return f"{self.op}|{','.join(map(str, self.dims))}|{self.dtype}"

    @property
    def flops(self) -> float:
        if self.op == "gemm":
            m, n, k = self.dims[:3]
            return 2.0 * m * n * k
        n, c, _h, _w, oc, kh, kw, *_rest, group = self.dims
        oh, ow = conv_output_hw(self.dims)
        return 2.0 * n * oc * oh * ow * (c // group) * kh * kw


def conv_output_hw(dims: tuple[int, ...]) -> tuple[int, int]:
    _n, _c, h, w, _oc, kh, kw, sh, sw, pt, pl, pb, pr, dh, dw, _g = dims
    return (h + pt + pb - dh * (kh - 1) - 1) // sh + 1, (w + pl + pr - dw * (kw - 1) - 1) // sw + 1


@dataclass(frozen=True)
class Schedule:
    """How one call runs: micro-kernel index, cache blocks (mc x kc of A, kc x nc of B), conv algorithm, threads."""

    micro: int = 0
    mc: int = 72
    kc: int = 256
    nc: int = 2048
    algo: str = "im2col"  # conv2d: one of ALGORITHMS
    threads: int = 1

    def to_json(self) -> dict:
        return dict(self.__dict__)

    @property
    def packs_weights(self) -> bool:
        """Whether a convolution with this schedule reads its weights packed by `Library.pack`."""
        return self.algo != "direct"


# Convolution algorithms, in the order the C code numbers them: GEMM over packed im2col panels; direct (a
# vector of outputs per register, for depthwise-like shapes); implicit GEMM reading the padded image in place,
# output pixels in vectors; the same with output channels in vectors (no vector lane wasted on small images).
ALGORITHMS = ("im2col", "direct", "implicit", "implicit-oc")


def host_targets() -> list[str]:
    """Every target this host runs, best first: AVX-512, AVX2+FMA on x86-64, NEON on aarch64; scalar C always."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return ["aarch64-neon", "scalar"]
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line.split() for line in f if line.startswith("flags")), []))
    except OSError:
        flags = set()
    found = []
    if machine in ("x86_64", "amd64") and {"avx2", "fma"} <= flags:
        found = ["x86-64-avx512", "x86-64-avx2"] if "avx512f" in flags else ["x86-64-avx2"]
    return [*found, "scalar"]


def host_target() -> str:
    """The best target this host runs."""
    return host_targets()[0]


def check_library(spec: LibrarySpec) -> Target:
    """The spec's target, after checking every micro-kernel fits its registers and vector width."""
    if spec.target not in TARGETS:
        raise KernelSpecError(f"unknown target {spec.target!r}; valid targets: {', '.join(TARGETS)}")
    if spec.dtype != "float32":
        raise KernelSpecError(f"dtype {spec.dtype!r} is not supported; valid dtypes: float32")
    if not 1 <= spec.unroll <= 16:
        raise KernelSpecError(f"unroll={spec.unroll} is outside 1..16")
    target = TARGETS[spec.target]
    if not spec.micro:
        raise KernelSpecError(f"no micro-kernel given for target {spec.target!r}")
    for mk in spec.micro:
        if mk.mr < 1 or mk.nr < 1 or mk.nr % target.lanes:
            raise KernelSpecError(f"micro-kernel {mk.name}: nr must be a positive multiple of {target.lanes} "
                                  f"(the {target.name} vector width) and mr positive")
        vectors = mk.nr // target.lanes
        needed = mk.mr * vectors + vectors + 1  # accumulators, B row, A broadcast
        if target.lanes > 1 and needed > target.registers:
            raise KernelSpecError(f"micro-kernel {mk.name} needs {needed} vector registers; "
                                  f"{target.name} has {target.registers}")
    return target


def check_schedule(spec: LibrarySpec, schedule: Schedule) -> None:
    """Refuse a schedule whose blocks do not hold whole micro-tiles or whose index is out of range."""
    if not 0 <= schedule.micro < len(spec.micro):
        valid = ", ".join(f"{i} ({m.name})" for i, m in enumerate(spec.micro))
        raise KernelSpecError(f"schedule micro={schedule.micro}; valid: {valid}")
    mk = spec.micro[schedule.micro]
    if schedule.mc < mk.mr or schedule.mc % mk.mr:
        raise KernelSpecError(f"mc={schedule.mc} must be a positive multiple of mr={mk.mr}")
    if schedule.nc < mk.nr or schedule.nc % mk.nr:
        raise KernelSpecError(f"nc={schedule.nc} must be a positive multiple of nr={mk.nr}")
    if schedule.kc < 1:
        raise KernelSpecError(f"kc={schedule.kc} must be positive")
    if schedule.algo not in ALGORITHMS:
        raise KernelSpecError(f"algo {schedule.algo!r}; valid: {', '.join(ALGORITHMS)}")
    if not 1 <= schedule.threads <= 256:
        raise KernelSpecError(f"threads={schedule.threads} is outside 1..256")


def default_schedule(spec: LibrarySpec, op: OpSpec, threads: int = 1) -> Schedule:
    """A sound schedule without measuring: the first micro-kernel, L1/L2-sized blocks; for convolutions, direct
    for depthwise-like shapes whose reduction is too short for a GEMM to pay, a plain GEMM (im2col, which
    reads a 1x1 unit-stride convolution's image as it is) for pointwise ones, else an implicit GEMM with
    output channels in vectors where there are many of them."""
    mk = spec.micro[0]
    algo = "im2col"
    if op.op == "conv2d":
        _n, c, _h, _w, oc, kh, kw, sh, sw, *pads, _dh, _dw, group = op.dims
        pointwise = (kh, kw, sh, sw, *pads) == (1, 1, 1, 1, 0, 0, 0, 0)
        implicit = "implicit-oc" if oc // group >= 128 else "implicit"
        algo = "direct" if (c // group) * kh * kw < 32 else "im2col" if pointwise else implicit
    return Schedule(0, mk.mr * max(1, 72 // mk.mr), 256, mk.nr * max(1, 2048 // mk.nr), algo, threads)
