"""Cross builds for aarch64, and running them under qemu through a small static driver program.

An x86 Python cannot load an aarch64 library, so the NEON kernels are linked into a static program that reads
one call's parameters and operands from a file and writes the result to another; `qemu-aarch64-static` runs it.
`Emulated` offers the calls of `Library` (gemm, conv2d with a residual, bias_act) through that program, so a
`kernels` runner can run a whole lowered stage under qemu.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from . import build, codegen
from .library import bias_view
from .spec import (
    ALGORITHMS,
    NONE,
    TARGETS,
    Epilogue,
    LibrarySpec,
    Schedule,
    check_schedule,
)

QEMU = "qemu-aarch64-static"
INSTALL = "apt-get install -y gcc-aarch64-linux-gnu qemu-user-static"

DRIVER = r"""
#include <stdint.h>
#include <stdio.h>
/* driver IN OUT: IN = op, params, scalars, four arrays (count then floats; count 0 is NULL); OUT = result.
   op 0: uk_gemm; 1: uk_conv2d, the fourth array a residual; 2: uk_bias_act. */
static float *read_array(FILE *f) {
    int64_t n = 0;
    if (fread(&n, 8, 1, f) != 1 || n <= 0) return NULL;
    float *p = malloc(sizeof(float) * n);
    if (p && fread(p, sizeof(float), n, f) != (size_t)n) { free(p); return NULL; }
    return p;
}
int main(int argc, char **argv) {
    int64_t op = -1, np = 0, p[32] = {0}, ns = 0;
    float s[4] = {0};
    FILE *f = argc == 3 ? fopen(argv[1], "rb") : NULL;
    if (!f || fread(&op, 8, 1, f) != 1 || fread(&np, 8, 1, f) != 1 || np > 32 || fread(p, 8, np, f) != (size_t)np ||
        fread(&ns, 8, 1, f) != 1 || ns > 4 || fread(s, 4, ns, f) != (size_t)ns) return 2;
    float *a = read_array(f), *b = read_array(f), *c = read_array(f), *d = read_array(f);
    fclose(f);
    int64_t ny;
    float *y;
    int rc;
    if (op == 0) {
        ny = p[5] * p[6];
        y = calloc(ny > 0 ? ny : 1, sizeof(float));
        rc = uk_gemm(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], a, p[8], p[9], b, p[10], p[11], y, p[6],
                     s[0], c, p[12], p[13], p[14], s[1], s[2], NULL, NULL);
    } else if (op == 1) {
        int64_t OH = (p[8] + p[15] + p[17] - p[19] * (p[11] - 1) - 1) / p[13] + 1;
        int64_t OW = (p[9] + p[16] + p[18] - p[20] * (p[12] - 1) - 1) / p[14] + 1;
        ny = p[6] * p[10] * OH * OW;
        y = d ? d : calloc(ny > 0 ? ny : 1, sizeof(float));
        rc = uk_conv2d(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9], p[10], p[11], p[12], p[13],
                       p[14], p[15], p[16], p[17], p[18], p[19], p[20], p[21], a, b, c, y, d != NULL, p[22], s[0],
                       s[1], NULL);
    } else {
        ny = p[0] * p[1] * p[2];
        y = calloc(ny > 0 ? ny : 1, sizeof(float));
        rc = uk_bias_act(p[0], p[1], p[2], a, y, b, c, p[3], s[0], s[1]);
    }
    if (rc) return 10 + rc;
    FILE *o = fopen(argv[2], "wb");
    if (!o || fwrite(y, sizeof(float), ny, o) != (size_t)ny) return 3;
    fclose(o);
    return 0;
}
"""


def missing_tools() -> list[str]:
    """The cross tools absent from PATH (empty when aarch64 builds can be made and run here)."""
    return [tool for tool in (TARGETS["aarch64-neon"].compiler, QEMU) if shutil.which(tool) is None]


def build_driver(spec: LibrarySpec | None = None) -> Path:
    """A static aarch64 program with the kernels of `spec` linked in."""
    spec = spec or LibrarySpec("aarch64-neon")
    return build.build(codegen.generate(spec) + DRIVER, spec.target, shared=False)


def _run(program: Path, op: int, params: list[int], scalars: list[float], arrays: list[np.ndarray | None],
         size: int) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.bin", Path(tmp) / "out.bin"
        parts = [np.array([op, len(params), *params, len(scalars)], np.int64).tobytes(),
                 np.array(scalars, np.float32).tobytes()]
        for array in [*arrays, None, None, None, None][:4]:
            flat = np.zeros(0, np.float32) if array is None else np.ascontiguousarray(array, np.float32).ravel()
            parts += [np.array([flat.size], np.int64).tobytes(), flat.tobytes()]
        src.write_bytes(b"".join(parts))
        done = subprocess.run([QEMU, str(program), str(src), str(dst)], capture_output=True, timeout=120, check=False)
        if done.returncode:
            raise build.BuildError(f"{program.name} under {QEMU} exited with {done.returncode}: {done.stderr[-500:]!r}")
        return np.fromfile(dst, np.float32, count=size)


def _into(out: np.ndarray | None, y: np.ndarray) -> np.ndarray:
    """`y`, or `out` holding it."""
    if out is None:
        return y
    out[...] = y
    return out


class Emulated:
    """The kernels of an aarch64 build, each call run under qemu by the driver program: `gemm`, `conv2d` and
    `bias_act` as `Library` takes them. Weights are packed inside each call, so `pack` returns None."""

    def __init__(self, spec: LibrarySpec | None = None):
        self.spec = spec or LibrarySpec("aarch64-neon")
        self.path = build_driver(self.spec)

    def rest(self) -> None:
        """Nothing to do: each call is a process of its own."""

    def pack(self, _a: np.ndarray, schedule: Schedule, _groups: int = 1, side: int | None = None) -> None:
        check_schedule(self.spec, schedule)

    def gemm(self, a: np.ndarray, b: np.ndarray, schedule: Schedule, *, alpha: float = 1.0,
             bias: np.ndarray | None = None, epilogue: Epilogue = NONE, out: np.ndarray | None = None,
             packed: None = None, packed_b: None = None) -> np.ndarray:
        """`clamp(alpha * a @ b + bias)`; `bias` broadcasts to (M, N)."""
        check_schedule(self.spec, schedule)
        (m, k), n = a.shape, b.shape[1]
        s = schedule
        bias = None if bias is None else np.broadcast_to(np.asarray(bias, np.float32), (m, n))
        params = [s.micro, s.threads, s.mc, s.kc, s.nc, m, n, k, k, 1, n, 1, n, 1, int(epilogue.clamps)]
        y = _run(self.path, 0, params, [alpha, epilogue.lo, epilogue.hi], [a, b, bias], m * n).reshape(m, n)
        return _into(out, y)

    def conv2d(self, x: np.ndarray, w: np.ndarray, schedule: Schedule, *, bias: np.ndarray | None = None,
               strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), group: int = 1, epilogue: Epilogue = NONE,
               packed: None = None, residual: np.ndarray | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
        """An NCHW convolution; `residual` (shaped as the output) is added before the clamp."""
        check_schedule(self.spec, schedule)
        s = schedule
        (n, c, h, wd), (oc, _, kh, kw) = x.shape, w.shape
        oh = (h + pads[0] + pads[2] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
        ow = (wd + pads[1] + pads[3] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
        params = [s.micro, s.threads, s.mc, s.kc, s.nc, ALGORITHMS.index(s.algo), n, c, h, wd, oc, kh, kw, *strides,
                  *pads, *dilations, group, int(epilogue.clamps)]
        y = _run(self.path, 1, params, [epilogue.lo, epilogue.hi], [x, w, bias, residual],
                 n * oc * oh * ow).reshape(n, oc, oh, ow)
        return _into(out, y)

    def bias_act(self, x: np.ndarray, *, bias: np.ndarray | None = None, axis: int = -1,
                 epilogue: Epilogue = NONE, residual: np.ndarray | None = None,
                 out: np.ndarray | None = None) -> np.ndarray:
        """`clamp(x + bias + residual)` where `bias` is a vector along `axis` (or None)."""
        params = [*bias_view(x.shape, axis, bias is not None), int(epilogue.clamps)]
        y = _run(self.path, 2, params, [epilogue.lo, epilogue.hi], [x, bias, residual], x.size).reshape(x.shape)
        return _into(out, y)
