"""A call's own cost: uhop-onnx's session against the runtime calls it makes, back to back in one process.

    python benchmarks/overhead.py [--blocks 40] [--calls 200] [--model hf-gpt2-past]

What a session adds to each call is microseconds, far below the noise between two processes on a shared VM, so
here the candidates share one process and alternate in blocks of `--calls` calls, in a reversing order; each
figure is the least of the block medians. Cases:
- a Relu at [4, 16] on each CPU runtime: the runtime's own Python call (ONNX Runtime's `InferenceSession.run`,
  OpenVINO's `InferRequest.infer`, LiteRT's `set_tensor`, `invoke` and `get_tensor`) against a one-stage
  session on it (`providers=[id], adapt=False`);
- a corpus model placed LiteRT first, ONNX Runtime for what LiteRT lacks (a plan of many stages): its stages'
  runners called one after another on the inputs each receives, against the session; the difference over the
  number of stages is the session's own work per stage.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import uhop_onnx  # noqa: E402
from benchmarks import corpus_models as corpus  # noqa: E402
from uhop_onnx.runtime.compile import compile_plan  # noqa: E402


def timed(candidates: dict[str, Callable[[], object]], blocks: int, calls: int) -> dict[str, float]:
    """Per candidate, the least over `blocks` of the median call time (us), blocks alternating."""
    for call in candidates.values():
        for _ in range(calls):
            call()
    medians: dict[str, list[float]] = {name: [] for name in candidates}
    order = list(candidates.items())
    for block in range(blocks):
        for name, call in order if block % 2 == 0 else order[::-1]:
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            medians[name].append(float(np.median(times)) * 1e6)
    return {name: min(m) for name, m in medians.items()}


def relu_model(folder: Path) -> Path:
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])])
    path = folder / "relu.onnx"
    onnx.save(helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def runtime_call(provider: str, path: Path, feeds: dict[str, np.ndarray]) -> Callable[[], object]:
    """The runtime's own call on the model, as its users make it."""
    if provider == "ort-cpu":
        import onnxruntime as ort

        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return lambda: session.run(None, feeds)
    if provider == "openvino":
        import openvino as ov

        request = ov.Core().compile_model(str(path), "CPU").create_infer_request()
        return lambda: request.infer(feeds, share_inputs=True)
    from uhop_onnx.providers.litert.converter import convert
    from uhop_onnx.providers.litert.runner import interpreter_module

    interpreter = interpreter_module().Interpreter(model_content=convert(onnx.load(path)))
    interpreter.allocate_tensors()
    [fed], [out] = interpreter.get_input_details(), interpreter.get_output_details()

    def call():
        interpreter.set_tensor(fed["index"], feeds["x"])
        interpreter.invoke()
        return interpreter.get_tensor(out["index"])
    return call


def one_stage(blocks: int, calls: int) -> None:
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)}
    with tempfile.TemporaryDirectory() as folder:
        path = relu_model(Path(folder))
        print("one stage, a Relu at [4, 16] (us a call):")
        for provider in ("ort-cpu", "openvino", "litert"):
            session = uhop_onnx.InferenceSession(str(path), providers=[provider], adapt=False)
            figures = timed({"runtime": runtime_call(provider, path, feeds),
                             "session": lambda s=session: s.run(None, feeds)}, blocks, calls)
            print(f"  {provider:9s} runtime {figures['runtime']:6.2f}  session {figures['session']:6.2f}  "
                  f"difference {figures['session'] - figures['runtime']:+6.2f}")


def many_stages(name: str, blocks: int, calls: int) -> None:
    path, feeds = corpus.case(name)
    if path is None:
        print(f"{name}: skipped (its package is not installed)")
        return
    session = uhop_onnx.InferenceSession(str(path), providers=["litert", "ort-cpu"], adapt=False)
    with compile_plan(session.plan) as executor:  # the same stages, compiled apart, run one by one
        stages, runners = executor.stages, executor.runners
        values = {**feeds, **executor.constants}
        received = []  # each stage's inputs, as the session hands them over
        for stage, runner in zip(stages, runners, strict=True):
            received.append({n: np.asarray(values[n]) for n in stage.inputs if n in values})
            values.update({n: runner.to_host(v) for n, v in runner.run(received[-1]).items()})

        def stages_only():
            for runner, fed in zip(runners, received, strict=True):
                runner.run(fed)

        figures = timed({"stages": stages_only, "session": lambda: session.run(None, feeds)}, blocks, calls)
    extra = figures["session"] - figures["stages"]
    print(f"{name} on {len(stages)} stages (litert first, ort-cpu for the rest; us a call): stages "
          f"{figures['stages']:.1f}, session {figures['session']:.1f}, difference {extra:+.1f} "
          f"({extra / len(stages):+.2f} a stage)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--model", default="hf-gpt2-past", help="the corpus model of many stages")
    args = parser.parse_args()
    one_stage(args.blocks, args.calls)
    many_stages(args.model, args.blocks, args.calls // 4)


if __name__ == "__main__":
    main()
