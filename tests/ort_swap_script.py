"""A program that puts uhop-onnx under onnxruntime's name first (the plain swap), then uses every provider
present, each precision, a bundle and `bench`: uhop-onnx's own use of ONNX Runtime must still reach ONNX
Runtime's real session. Prints one JSON line of what it ran; run by tests/test_ort_swap.py."""

import onnxruntime

import uhop_onnx

onnxruntime.InferenceSession = uhop_onnx.InferenceSession  # the swap, before anything else is used

import json  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import onnx  # noqa: E402

from uhop_onnx.foundation import ortlib  # noqa: E402
from uhop_onnx.models import cnn  # noqa: E402
from uhop_onnx.precision import errors  # noqa: E402
from uhop_onnx.providers import create  # noqa: E402
from uhop_onnx.providers.quantize import Calibration  # noqa: E402

CPU = ("ort-cpu", "openvino", "litert", "kernels")


def main(work: Path) -> dict:
    warnings.simplefilter("error", UserWarning)  # a build check that failed would only warn: make it fail
    warnings.filterwarnings("ignore", message=".*(not available here|free dimension|fewer than).*")
    real = ortlib.load().InferenceSession
    assert real.__module__ == "onnxruntime.capi.onnxruntime_inference_collection", real
    model = cnn()
    rng = np.random.default_rng(0)
    samples = [{"input": rng.standard_normal((1, 3, 32, 32)).astype(np.float32)} for _ in range(4)]
    reference = real(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = reference.run(None, samples[0])[0]
    done: dict = {"providers": {}, "variants": {}}

    for ident in (i for i in CPU if create(i).present):  # each provider alone, its build checks included
        session = uhop_onnx.InferenceSession(model, providers=[ident], profile=False)
        np.testing.assert_allclose(session.run(None, samples[0])[0], want, rtol=1e-4, atol=1e-5)
        done["providers"][ident] = session.get_providers()

    calibration = Calibration(model, samples)
    for ident in (i for i in CPU if create(i).present):  # each reduced precision each offers: the quantizers
        provider = create(ident)
        for precision in (p for p in ("bf16", "fp16", "int8") if p in provider.precisions()):
            for variant in provider.variants(precision, calibration):
                lowered = variant.lower(model)
                runner = variant.compile(lowered)
                got = runner.run(samples[1])[model.graph.output[0].name]
                ops = {n.op_type for n in lowered.graph.node}
                done["variants"][variant.label] = {"cosine": errors({"y": got}, {"y": reference.run(None, samples[1])[0]})
                                                   ["y"]["cosine"], "qdq": "QuantizeLinear" in ops}
                runner.close()

    stacked = {"input": np.concatenate([s["input"] for s in samples])}
    plan = uhop_onnx.optimize(model, providers=["ort-cpu"], precision="int8", tolerance=1.0, calibration=stacked,
                              budget=2)
    done["int8_plan"] = [s.label for s in plan.stages]

    path = work / "cnn.onnx"
    onnx.save(model, path)
    bundle = uhop_onnx.export_bundle(path, "x86-64", work / "bundle", inputs=samples[0])
    np.testing.assert_allclose(uhop_onnx.load_bundle(bundle).run(None, samples[0])[0], want, rtol=1e-4, atol=1e-5)
    verified = uhop_onnx.verify_bundle(bundle)
    done["verify"] = verified.get("ok", verified)

    from uhop_onnx.products.bench import bench

    figures = bench(path, providers=["ort-cpu"], rounds=1, calls=1, budget=1)
    done["bench"] = sorted(figures.get("candidates", figures))
    done["swapped"] = onnxruntime.InferenceSession is uhop_onnx.InferenceSession
    return done


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1])), default=str))
