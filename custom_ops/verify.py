"""Check a built library against numpy before it is used, and hand out only libraries that passed.

Every micro-kernel is run on odd sizes that leave edge tiles and cross cache blocks, with transposed and
broadcast operands, every bias form and a clamp, on one and two threads; every convolution algorithm on
grouped, strided, padded and dilated shapes. A library that fails to load or to match is evicted from the
disk cache, reported, and never returned. A library is first loaded and checked in a child process, and
only one that passed there is loaded into the caller.
"""

from __future__ import annotations

import hashlib
import pickle
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from uhop_onnx.foundation.cache import JsonTable, cache_dir
from uhop_onnx.foundation.errors import UhopError, logger

from . import build, codegen
from .library import Library
from .spec import ALGORITHMS, Epilogue, LibrarySpec, Schedule, host_target

log = logger(__name__)

RTOL, ATOL = 1e-4, 1e-4
RELU6 = Epilogue(lo=0.0, hi=6.0)


class VerificationError(UhopError):
    """A built kernel library computed something other than the numpy reference."""


def conv_reference(x, w, bias=None, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), group=1) -> np.ndarray:
    """NCHW convolution in float64 numpy: dilated windows of the padded input contracted with the weights."""
    n = x.shape[0]
    oc, cg, kh, kw = w.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    span = (dilations[0] * (kh - 1) + 1, dilations[1] * (kw - 1) + 1)
    win = sliding_window_view(xp, span, axis=(2, 3))[:, :, ::strides[0], ::strides[1], ::dilations[0], ::dilations[1]]
    oh, ow = win.shape[2:4]
    win = win.reshape(n, group, cg, oh, ow, kh, kw)
    y = np.einsum("ngchwij,gocij->ngohw", win, w.astype(np.float64).reshape(group, oc // group, cg, kh, kw))
    y = y.reshape(n, oc, oh, ow)
    return y if bias is None else y + np.asarray(bias, np.float64).reshape(1, oc, 1, 1)


def clamp(y: np.ndarray, epilogue: Epilogue) -> np.ndarray:
    return np.clip(y, epilogue.lo, epilogue.hi) if epilogue.clamps else y


def _cases(lib: Library, rng: np.random.Generator) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """(description, result, reference) for every kernel and micro-kernel of `lib`."""
    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    for v, mk in enumerate(lib.spec.micro):
        small = Schedule(v, mk.mr * 2, 24, mk.nr * 2)
        m, n, k = 2 * small.mc + 1, 2 * small.nc + 3, 2 * small.kc + 5
        a, b = rand(m, k), rand(k, n)
        biases = {"none": None, "col": rand(n), "row": rand(m, 1), "full": rand(m, n), "scalar": rand(1)}
        for threads in (1, 2):
            for form, bias in biases.items():
                epi = RELU6 if form == "row" else Epilogue()
                got = lib.gemm(a, b, replace(small, threads=threads), alpha=0.5, bias=bias,
                               epilogue=epi)
                want = 0.5 * (a.astype(np.float64) @ b) + (0 if bias is None else bias)
                yield f"gemm {mk.name} {m}x{n}x{k} bias={form} threads={threads}", got, clamp(want, epi)
        got = lib.gemm(a, b, small, bias=biases["col"], packed=lib.pack(a, small), packed_b=lib.pack(b.T, small, side=1))
        yield f"gemm {mk.name} packed", got, a.astype(np.float64) @ b + biases["col"]
        at, bt = rand(k, m), rand(n, k)
        got = lib.gemm(at.T, bt.T, small, epilogue=Epilogue(lo=0.0))
        yield f"gemm {mk.name} transposed", got, np.maximum(at.T.astype(np.float64) @ bt.T, 0)
        row = rand(5)
        yield f"gemm {mk.name} k=0", lib.gemm(rand(3, 0), rand(0, 5), small, bias=row), np.broadcast_to(row, (3, 5))
    convs = [  # x shape, w shape, strides, pads, dilations, group
        ((2, 6, 9, 11), (4, 3, 3, 2), (2, 1), (1, 0, 2, 1), (1, 2), 2),
        ((1, 5, 7, 7), (5, 1, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 5),
        ((1, 8, 6, 5), (7, 8, 1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 1),
        ((1, 3, 13, 11), (9, 3, 5, 3), (3, 2), (2, 1, 0, 1), (2, 1), 1),
    ]
    for i, (xs, ws, strides, pads, dilations, group) in enumerate(convs):
        x, w, bias = rand(*xs), rand(*ws), rand(ws[0])
        want = conv_reference(x, w, bias, strides, pads, dilations, group)
        for algo in ALGORITHMS:
            for v, mk in enumerate(lib.spec.micro):  # each micro-kernel's twins, on one shape
                if v and (i or algo in ("im2col", "direct")):
                    continue
                for threads in (1, 2):
                    schedule = Schedule(v, mk.mr * 2, 24, mk.nr * 2, algo, threads)
                    packs = threads == 2 and schedule.packs_weights
                    weights = lib.pack(w.reshape(ws[0], -1), schedule, group) if packs else None
                    res = rand(*want.shape) if threads == 2 else None  # with a residual and packed weights
                    got = lib.conv2d(x, w, schedule, bias=bias, strides=strides, pads=pads, dilations=dilations,
                                     group=group, epilogue=Epilogue(lo=0.0), packed=weights, residual=res)
                    yield (f"conv2d {algo} {mk.name} x{xs} w{ws} group={group} threads={threads}", got,
                           clamp(want + (0 if res is None else res), Epilogue(lo=0.0)))
    x, bias = rand(2, 3, 4, 5), rand(3)
    yield "bias_act relu6", lib.bias_act(x, bias=bias, axis=1, epilogue=RELU6), clamp(x + bias.reshape(3, 1, 1), RELU6)
    x = rand(5, 7)
    yield "gemm_naive", lib.gemm_naive(x, x.T), x.astype(np.float64) @ x.T


def verify(lib: Library, seed: int = 0) -> None:
    """Raise `VerificationError` naming every case where `lib` differs from the reference."""
    failures = []
    for what, got, want in _cases(lib, np.random.default_rng(seed)):
        if got.shape != want.shape or not np.allclose(got, want, rtol=RTOL, atol=ATOL):
            error = np.abs(got - want).max() if got.shape == want.shape else f"shape {got.shape} != {want.shape}"
            failures.append(f"{what}: max error {error}")
    if failures:
        raise VerificationError(f"{lib.path.name} ({lib.spec.target}) failed verification: " + "; ".join(failures))


_VERIFIED: dict[Path, Library] = {}
PASSED = "passed.json"  # sha256 of a library -> the spec it passed `verify` with, in a child process
CHILD_SECONDS = 300


def load(spec: LibrarySpec, source: str | None = None) -> Library:
    """Build (or take from the disk cache), self-test and load the library of `spec` (or of the given source).

    A library that fails its self-test in the child process (a crash included) is evicted and rebuilt once;
    one that fails again raises `VerificationError`.
    """
    source = source if source is not None else codegen.generate(spec)
    path = build.build(source, spec.target)
    if path in _VERIFIED:
        return _VERIFIED[path]
    try:
        lib = tested(path, spec)
    except VerificationError as error:
        log.warning("kernels %s failed their self-test (%s); rebuilding", path.name, error)
        build.evict(path)
        path = build.build(source, spec.target)
        try:
            lib = tested(path, spec)
        except VerificationError:
            build.evict(path)
            raise
    _VERIFIED[path] = lib
    return lib


def tested(path: Path, spec: LibrarySpec) -> Library:
    """`path` loaded into this process, once a child process has loaded it and it passed `verify` there, so
    a broken, truncated or swapped file (a crash, a wrong result) can never take this process down. A pass
    is recorded in the cache by the file's sha256; a file with a recorded pass skips the child."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    table = JsonTable(cache_dir() / "kernels" / PASSED)
    if table.get(digest) != repr(spec):
        _self_test(path, spec)
        try:
            table.update({digest: repr(spec)})
        except OSError as error:
            log.info("cannot record the kernels' self-test in %s (%s); it runs again next time", table.path, error)
    return Library(path, spec)


def _self_test(path: Path, spec: LibrarySpec) -> None:
    """Load and verify `path` in a child process; `VerificationError` when it fails, crashes or hangs."""
    try:
        done = subprocess.run([sys.executable, "-P", "-m", __name__, str(path)], input=pickle.dumps(spec),
                              capture_output=True, timeout=CHILD_SECONDS, check=False)
    except subprocess.TimeoutExpired:
        raise VerificationError(f"{path.name}: the self-test did not finish in {CHILD_SECONDS} s") from None
    if done.returncode < 0:
        raise VerificationError(f"{path.name}: loading it killed the self-test process "
                                f"({signal.Signals(-done.returncode).name})")
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines() or [f"exit {done.returncode}"]
        raise VerificationError(lines[-1].removeprefix("error: "))


def _child(path: str) -> int:
    """The self-test's process: load the library at `path` (its spec pickled on stdin) and verify it."""
    spec = pickle.loads(sys.stdin.buffer.read())
    try:
        verify(Library(Path(path), spec))
    except (OSError, UhopError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def host_library() -> Library:
    """The verified library for this host's best target, or the portable scalar one if that fails."""
    target = host_target()
    try:
        return load(LibrarySpec(target))
    except (VerificationError, build.BuildError) as error:
        if target == "scalar":
            raise
        log.warning("the %s kernels are rejected (%s); using portable scalar C", target, error)
        return load(LibrarySpec("scalar"))


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
