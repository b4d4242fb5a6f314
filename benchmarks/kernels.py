"""Our kernels beside numpy (OpenBLAS), ONNX Runtime (MLAS) and a naive loop, then a whole ResNet-18.

    python benchmarks/kernels.py [--threads 1,2] [--rounds 3]

Part one is `uhop-onnx kernels bench` (GFLOP/s per op; method in `uhop_onnx.products.kernels_bench`). Part two times
ResNet-18 (224x224, batch norm folded into the convolutions) placed with `kernels` + `ort-cpu` against ONNX
Runtime alone, each in its own process, alternating rounds, comparing the minimum of the round medians. The
model's schedules are tuned first, as `uhop-onnx kernels tune` does (cached per device; a no-op when cached).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import typer
from onnx import TensorProto, helper, numpy_helper
from uhop_onnx.products.kernels_tune import tune_model
from uhop_onnx.cli.kernels import bench

ENGINES = ("kernels", "onnxruntime")


def resnet18(seed: int = 0) -> onnx.ModelProto:
    """ResNet-18 for 224x224 images with batch norm folded into conv biases (as exporters emit for inference)."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []

    def conv(x, name, cin, cout, k, stride, relu=True):
        w = (rng.standard_normal((cout, cin, k, k)) * np.sqrt(2 / (cin * k * k))).astype(np.float32)
        inits.extend([numpy_helper.from_array(w, f"{name}.w"),
                      numpy_helper.from_array((rng.standard_normal(cout) * 0.1).astype(np.float32), f"{name}.b")])
        nodes.append(helper.make_node("Conv", [x, f"{name}.w", f"{name}.b"], [f"{name}.y"], name=f"{name}/Conv",
                                      kernel_shape=[k, k], strides=[stride] * 2, pads=[k // 2] * 4))
        if not relu:
            return f"{name}.y"
        nodes.append(helper.make_node("Relu", [f"{name}.y"], [f"{name}.r"], name=f"{name}/Relu"))
        return f"{name}.r"

    x = conv("input", "conv1", 3, 64, 7, 2)
    nodes.append(helper.make_node("MaxPool", [x], ["pool"], name="pool", kernel_shape=[3, 3], strides=[2, 2],
                                  pads=[1] * 4))
    x, cin = "pool", 64
    for stage, cout in enumerate((64, 128, 256, 512)):
        for block in range(2):
            stride = 2 if stage and not block else 1
            name = f"layer{stage + 1}.{block}"
            y = conv(conv(x, f"{name}.conv1", cin, cout, 3, stride), f"{name}.conv2", cout, cout, 3, 1, relu=False)
            skip = conv(x, f"{name}.down", cin, cout, 1, stride, relu=False) if stride != 1 or cin != cout else x
            nodes.append(helper.make_node("Add", [y, skip], [f"{name}.sum"], name=f"{name}/Add"))
            nodes.append(helper.make_node("Relu", [f"{name}.sum"], [f"{name}.out"], name=f"{name}/Relu"))
            x, cin = f"{name}.out", cout
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["gap"], name="gap"))
    nodes.append(helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"))
    inits += [numpy_helper.from_array((rng.standard_normal((1000, 512)) * 0.04).astype(np.float32), "fc.w"),
              numpy_helper.from_array(np.zeros(1000, np.float32), "fc.b")]
    nodes.append(helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["output"], name="fc", transB=1))
    graph = helper.make_graph(nodes, "resnet18", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 224, 224])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 1000])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def time_model(engine: str, path: str, threads: int, repeats: int = 15) -> float:
    """Median seconds per inference of the model at `path` on `engine`, in this process."""
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    if engine == "kernels":
        import uhop_onnx

        session = uhop_onnx.InferenceSession(path, providers=["kernels", "ort-cpu"], profile=False, threads=threads)
    else:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    session.run(None, {"input": x})
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, {"input": x})
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def compare_resnet18(threads: tuple[int, ...], rounds: int) -> dict[int, dict[str, float]]:
    """Milliseconds per ResNet-18 inference for each engine and thread count (min over rounds of medians)."""
    best = {t: dict.fromkeys(ENGINES, float("inf")) for t in threads}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "resnet18.onnx")
        onnx.save(resnet18(), path)
        for t in threads:
            tune_model(path, t)
        for r in range(rounds):
            for t in threads:
                for engine in ENGINES if r % 2 == 0 else ENGINES[::-1]:
                    done = subprocess.run([sys.executable, __file__, "--child", engine, path, str(t)],
                                          capture_output=True, text=True, check=True)
                    best[t][engine] = min(best[t][engine], 1000 * float(done.stdout.split()[-1]))
    return best


def main(threads: str = "1,2", rounds: int = 3) -> None:
    bench(threads=threads, rounds=rounds, as_json=False)
    counts = tuple(int(t) for t in threads.split(","))
    result = compare_resnet18(counts, rounds)
    for t, ms in result.items():
        ratio = ms["onnxruntime"] / ms["kernels"]
        print(f"ResNet-18 224x224, {t} thread(s): kernels+ort-cpu {ms['kernels']:.1f} ms, "
              f"onnxruntime {ms['onnxruntime']:.1f} ms, speed ratio kernels/onnxruntime {ratio:.2f}")
    print(json.dumps({"resnet18_ms": result}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(time_model(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    else:
        typer.run(main)
