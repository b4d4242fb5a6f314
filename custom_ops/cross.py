"""Cross builds for aarch64, and running them under qemu through a small static driver program.

An x86 Python cannot load an aarch64 library, so the NEON kernels are linked into a static program that reads
one call's parameters and operands from a file and writes the result to another; `qemu-aarch64-static` runs it.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from . import build, codegen
from .spec import NONE, TARGETS, Epilogue, LibrarySpec, Schedule

QEMU = "qemu-aarch64-static"
INSTALL = "apt-get install -y gcc-aarch64-linux-gnu qemu-user-static"

DRIVER = r"""
#include <stdint.h>
#include <stdio.h>
/* driver IN OUT: IN = op, params, scalars, three arrays (count then floats; count 0 is NULL); OUT = result. */
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
    float *a = read_array(f), *b = read_array(f), *c = read_array(f);
    fclose(f);
    int64_t ny;
    float *y;
    int rc;
    if (op == 0) {
        ny = p[5] * p[6];
        y = calloc(ny > 0 ? ny : 1, sizeof(float));
        rc = uk_gemm(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], a, p[8], p[9], b, p[10], p[11], y, p[6],
                     s[0], c, p[12], p[13], p[14], s[1], s[2], NULL);
    } else {
        int64_t OH = (p[8] + p[15] + p[17] - p[19] * (p[11] - 1) - 1) / p[13] + 1;
        int64_t OW = (p[9] + p[16] + p[18] - p[20] * (p[12] - 1) - 1) / p[14] + 1;
        ny = p[6] * p[10] * OH * OW;
        y = calloc(ny > 0 ? ny : 1, sizeof(float));
        rc = uk_conv2d(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9], p[10], p[11], p[12], p[13],
                       p[14], p[15], p[16], p[17], p[18], p[19], p[20], p[21], a, b, c, y, p[22], s[0], s[1], NULL);
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


def build_library(spec: LibrarySpec | None = None) -> Path:
    """The aarch64 shared library, for bundles that ship it to a board."""
    spec = spec or LibrarySpec("aarch64-neon")
    return build.build(codegen.generate(spec), spec.target)


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
        for array in arrays:
            flat = np.zeros(0, np.float32) if array is None else np.ascontiguousarray(array, np.float32).ravel()
            parts += [np.array([flat.size], np.int64).tobytes(), flat.tobytes()]
        src.write_bytes(b"".join(parts))
        done = subprocess.run([QEMU, str(program), str(src), str(dst)], capture_output=True, timeout=120, check=False)
        if done.returncode:
            raise build.BuildError(f"{program.name} under {QEMU} exited with {done.returncode}: {done.stderr[-500:]!r}")
        return np.fromfile(dst, np.float32, count=size)


def gemm(program: Path, a: np.ndarray, b: np.ndarray, schedule: Schedule, *, alpha: float = 1.0,
         bias: np.ndarray | None = None, epilogue: Epilogue = NONE) -> np.ndarray:
    """`clamp(alpha * a @ b + bias)` computed by the aarch64 program; `bias` is None, (N,) or (M, N)."""
    (m, k), n = a.shape, b.shape[1]
    s = schedule
    bias_strides = [0, 0] if bias is None else ([0, 1] if bias.ndim == 1 else [n, 1])
    params = [s.micro, s.threads, s.mc, s.kc, s.nc, m, n, k, k, 1, n, 1, *bias_strides, int(epilogue.clamps)]
    return _run(program, 0, params, [alpha, epilogue.lo, epilogue.hi], [a, b, bias], m * n).reshape(m, n)


def conv2d(program: Path, x: np.ndarray, w: np.ndarray, schedule: Schedule, *, bias: np.ndarray | None = None,
           strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), group: int = 1,
           epilogue: Epilogue = NONE) -> np.ndarray:
    """An NCHW convolution computed by the aarch64 program."""
    s = schedule
    (n, c, h, wd), (oc, _, kh, kw) = x.shape, w.shape
    oh = (h + pads[0] + pads[2] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    ow = (wd + pads[1] + pads[3] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
    params = [s.micro, s.threads, s.mc, s.kc, s.nc, int(s.algo == "direct"), n, c, h, wd, oc, kh, kw, *strides, *pads,
              *dilations, group, int(epilogue.clamps)]
    return _run(program, 1, params, [epilogue.lo, epilogue.hi], [x, w, bias], n * oc * oh * ow).reshape(n, oc, oh, ow)
