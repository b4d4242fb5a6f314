"""GFLOP/s of our MatMul and convolutions beside numpy (OpenBLAS), ONNX Runtime (MLAS) and a naive loop.

Each library runs in its own process (`python -m uhop_onnx.products.kernels_bench LIBRARY THREADS`), so no two
thread pools share the cores; rounds alternate the order of the libraries, and each figure is the minimum over
rounds of the per-round median time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

from ..foundation import ortlib

LIBRARIES = ("kernels", "numpy", "onnxruntime", "naive")
MATMUL_SIZES = (256, 512, 1024, 2048)
NAIVE_LIMIT = 512  # the naive loop takes seconds per call beyond this

# name -> (C, H, W, OC, K, stride, group) at batch 1, padding K // 2.
CONVS = {
    "resnet18.conv1 7x7/2 3->64 @224": (3, 224, 224, 64, 7, 2, 1),
    "resnet18.layer1 3x3 64->64 @56": (64, 56, 56, 64, 3, 1, 1),
    "resnet18.layer2 3x3 128->128 @28": (128, 28, 28, 128, 3, 1, 1),
    "resnet18.layer3 3x3/2 128->256 @28": (128, 28, 28, 256, 3, 2, 1),
    "resnet18.layer4 3x3 512->512 @7": (512, 7, 7, 512, 3, 1, 1),
    "mobilenetv2.stem 3x3/2 3->32 @224": (3, 224, 224, 32, 3, 2, 1),
    "mobilenetv2.dw 3x3 32 @112": (32, 112, 112, 32, 3, 1, 32),
    "mobilenetv2.expand 1x1 24->144 @56": (24, 56, 56, 144, 1, 1, 1),
    "mobilenetv2.dw 3x3/2 144 @56": (144, 56, 56, 144, 3, 2, 144),
    "mobilenetv2.project 1x1 576->96 @14": (576, 14, 14, 96, 1, 1, 1),
}


def cases() -> dict[str, tuple[str, tuple[int, ...]]]:
    """Case name -> (op, dims as `OpSpec` takes them)."""
    found = {f"matmul {n}": ("gemm", (n, n, n, 0, 0)) for n in MATMUL_SIZES}
    for name, (c, h, w, oc, k, s, g) in CONVS.items():
        p = k // 2
        found[f"conv {name}"] = ("conv2d", (1, c, h, w, oc, k, k, s, s, p, p, p, p, 1, 1, g))
    return found


def _flops(op: str, dims: tuple[int, ...]) -> float:
    from ..custom_ops.spec import OpSpec

    return OpSpec(op, dims).flops


def _runner(library: str, op: str, dims: tuple[int, ...], threads: int) -> Callable[[], object] | None:
    """A no-argument call computing the case with `library`, or None when the library does not do it."""
    import numpy as np

    from ..custom_ops.autotune import operands
    from ..custom_ops.spec import OpSpec

    spec = OpSpec(op, dims)
    args = operands(spec)
    if library == "kernels":
        from ..custom_ops.autotune import prepare, schedule_for
        from ..custom_ops.verify import host_library

        lib = host_library()
        return prepare(lib, spec, schedule_for(lib, spec, threads, tune=True), args)  # tuned once, then cached
    if library == "naive":
        if op != "gemm" or threads != 1 or dims[0] > NAIVE_LIMIT:
            return None
        from ..custom_ops.verify import host_library

        lib = host_library()
        return lambda: lib.gemm_naive(*args)
    if library == "numpy":
        return (lambda: args[0] @ args[1]) if op == "gemm" else _numpy_conv(spec, args)
    return _ort(spec, args, threads, np)


def _numpy_conv(spec, args):
    """im2col with numpy views and one OpenBLAS matmul per group (elementwise sums for depthwise)."""
    import numpy as np
    from numpy.lib.stride_tricks import sliding_window_view

    x, w, b = args
    _n, c, _h, _w, oc, k, _k, s, _s, p, *_rest, g = spec.dims

    def conv():
        xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
        win = sliding_window_view(xp, (k, k), axis=(2, 3))[0, :, ::s, ::s]  # C, OH, OW, K, K
        oh, ow = win.shape[1:3]
        if g == c and oc == c:
            y = np.einsum("chwij,cij->chw", win, w[:, 0])
        else:
            cols = win.reshape(g, c // g, oh, ow, k, k).transpose(0, 1, 4, 5, 2, 3).reshape(g, -1, oh * ow)
            y = np.matmul(w.reshape(g, oc // g, -1), cols).reshape(oc, oh, ow)
        return y + b[:, None, None]
    return conv


def _ort(spec, args, threads: int, np):
    from onnx import TensorProto, helper, numpy_helper

    if spec.op == "gemm":
        m, k = spec.dims[0], spec.dims[2]
        node = helper.make_node("MatMul", ["a", "b"], ["y"])
        inputs, feeds, inits = [("a", [m, k])], {"a": args[0]}, [numpy_helper.from_array(np.ascontiguousarray(args[1]), "b")]
    else:
        _n, c, h, w, _oc, k, _k, s, _s, p, *_rest, g = spec.dims
        node = helper.make_node("Conv", ["x", "w", "bias"], ["y"], kernel_shape=[k, k], strides=[s, s], pads=[p] * 4,
                                group=g)
        inputs, feeds = [("x", [1, c, h, w])], {"x": args[0]}
        inits = [numpy_helper.from_array(args[1], "w"), numpy_helper.from_array(args[2], "bias")]
    graph = helper.make_graph([node], "bench", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
                                                for n, s in inputs],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    ort = ortlib.load()
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return lambda: session.run(None, feeds)


def worker(library: str, threads: int, budget: float = 0.3) -> dict[str, float]:
    """Median seconds per case for one library in this process (run as the child of `measure`)."""
    from ..custom_ops.autotune import median_seconds

    results = {}
    for name, (op, dims) in cases().items():
        call = _runner(library, op, dims, threads)
        if call is not None:
            results[name] = median_seconds(call, budget)
    return results


def _child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    return env


def measure(threads: tuple[int, ...] = (1, 2), rounds: int = 3, libraries: tuple[str, ...] = LIBRARIES,
            progress: Callable[[str], None] = lambda _: None) -> dict:
    """{"threads": {t: {library: {case: GFLOP/s}}}, ...}: the minimum over rounds of each round's median."""
    best: dict[int, dict[str, dict[str, float]]] = {t: {lib: {} for lib in libraries} for t in threads}
    for r in range(rounds):
        for t in threads:
            order = libraries if r % 2 == 0 else tuple(reversed(libraries))
            for lib in order:
                progress(f"round {r + 1}/{rounds}, {lib} on {t} thread(s)")
                done = subprocess.run([sys.executable, "-P", "-m", __name__, lib, str(t)], capture_output=True,
                                      text=True, env=_child_env(t), check=True)
                for case, seconds in json.loads(done.stdout.strip().splitlines()[-1]).items():
                    best[t][lib][case] = min(seconds, best[t][lib].get(case, float("inf")))
    flops = {name: _flops(op, dims) for name, (op, dims) in cases().items()}
    return {
        "threads": {t: {lib: {case: flops[case] / s / 1e9 for case, s in per.items()} for lib, per in libs.items()}
                    for t, libs in best.items()},
        "rounds": rounds,
        "cases": list(flops),
    }


if __name__ == "__main__":
    print(json.dumps(worker(sys.argv[1], int(sys.argv[2]))))
