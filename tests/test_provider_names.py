"""ONNX Runtime's provider names name devices (policy "device"), or are plain aliases (policy "literal");
their options are taken as ONNX Runtime takes them: ignored with a warning, honoured, or refused."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import uhop_onnx
from uhop_onnx import InputError, ProviderError
from uhop_onnx.models import cnn
from uhop_onnx.providers import HOST_CPU, LAST_RESORT, create, parse_spec, resolve

CPU_HERE = [ident for ident, options in HOST_CPU if create((ident, options)).present]


def labels(specs, **kw) -> list[str]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="provider .* is not available here")
        return [p.label for p in resolve(specs, **kw)]


def caught(call) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in seen]


def test_cpu_execution_provider_is_every_provider_on_this_cpu_and_literal_is_ort_cpu():
    assert CPU_HERE[-1] == LAST_RESORT and len(CPU_HERE) >= 2, CPU_HERE  # openvino, litert or kernels here
    assert labels(["CPUExecutionProvider"]) == CPU_HERE
    assert labels(["CPUExecutionProvider"], policy="literal") == ["ort-cpu"]
    assert labels(["ort-cpu"]) == ["ort-cpu"]  # uhop's own ids keep their exact meaning
    assert labels(["kernels", "CPUExecutionProvider"])[0] == "kernels"


def test_a_gpu_name_is_its_provider_then_the_cpu_ones_without_duplicates_and_ort_cpu_last():
    listed = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    gpu = [p for p in ("ort-tensorrt", "ort-cuda") if create(p).present]
    assert labels(listed) == gpu + CPU_HERE
    assert labels(listed[:2]) == gpu + CPU_HERE  # the CPU ones run what the GPU cannot, as ONNX Runtime's CPU EP
    assert labels(["CPUExecutionProvider", "CUDAExecutionProvider"]) == [*CPU_HERE[:-1], *gpu, "ort-cpu"]
    assert labels(listed, policy="literal") == [*gpu, "ort-cpu"]
    both = labels([("OpenVINOExecutionProvider", {"device_type": "CPU"}), "CPUExecutionProvider"])
    assert len(both) == len(set(both)) == len(CPU_HERE) and both[-1] == "ort-cpu"  # openvino:CPU is openvino


def test_absent_gpu_is_skipped_with_one_warning_or_refused_when_strict():
    if create("ort-cuda").present:
        pytest.skip("CUDA is present here")
    chosen, said = caught(lambda: resolve(["CUDAExecutionProvider", "CPUExecutionProvider"]))
    assert [p.label for p in chosen] == CPU_HERE
    assert [m for m in said if "'ort-cuda' is not available here" in m] == said and len(said) == 1
    with pytest.raises(ProviderError, match="'ort-cuda' is not available"):
        resolve(["CUDAExecutionProvider", "CPUExecutionProvider"], strict=True)


def test_an_ort_name_without_a_provider_here_is_skipped_as_onnx_runtime_skips_it():
    import onnxruntime as ort

    chosen, said = caught(lambda: resolve(ort.get_available_providers()))  # a library's habit: Azure and CPU
    assert [p.label for p in chosen] == CPU_HERE
    assert said == ["ONNX Runtime's AzureExecutionProvider has no provider in uhop-onnx; skipped"]
    with pytest.raises(ProviderError, match="AzureExecutionProvider has no provider"):
        resolve(["AzureExecutionProvider", "CPUExecutionProvider"], strict=True)
    with pytest.raises(ProviderError, match="unknown provider 'ort-gpu'"):
        resolve(["ort-gpu"])


def test_a_bad_policy_lists_the_valid_ones():
    with pytest.raises(InputError, match="policy: 'cpu' is not one of device, literal"):
        resolve(["ort-cpu"], policy="cpu")


def test_options_without_meaning_are_ignored_with_one_warning_each():
    options = {"arena_extend_strategy": "kSameAsRequested", "enable_cpu_mem_arena": "0"}
    chosen, said = caught(lambda: resolve([("CPUExecutionProvider", options)], policy="literal"))
    assert [p.label for p in chosen] == ["ort-cpu"] and chosen[0].options == {}
    assert sorted(said) == [f"CPUExecutionProvider: option '{k}' has no meaning in uhop-onnx; ignored"
                            for k in sorted(options)]
    parsed, said = caught(lambda: parse_spec(("CUDAExecutionProvider", {
        "device_id": "1", "gpu_mem_limit": 2 << 30, "cudnn_conv_algo_search": "HEURISTIC"})))
    assert parsed == ("ort-cuda", {"device_id": 1}) and len(said) == 2


def test_onnx_runtime_takes_any_option_on_its_cpu_provider():
    """Why every option given to CPUExecutionProvider is ignored, never refused: ONNX Runtime refuses none."""
    import onnxruntime as ort

    session = ort.InferenceSession(cnn().SerializeToString(), providers=[("CPUExecutionProvider", {"anything": "1"})])
    assert session.get_providers() == ["CPUExecutionProvider"]


def test_mapped_options_are_honoured_and_malformed_ones_refused():
    assert parse_spec(("OpenVINOExecutionProvider", {"device_type": "GPU_FP16"})) == ("openvino", {"device": "GPU"})
    assert parse_spec(("TensorrtExecutionProvider", {"device_id": "1", "trt_engine_cache_path": "/tmp/e"})) == (
        "ort-tensorrt", {"device_id": 1, "engine_cache": "/tmp/e"})
    for spec, message in [
        (("CUDAExecutionProvider", {"device_id": "first"}), "device_id='first' is malformed"),
        (("TensorrtExecutionProvider", {"device_id": "-1"}), "device_id='-1' is malformed"),
        (("OpenVINOExecutionProvider", {"device_type": 3}), "device_type=3 is malformed"),
        (("CUDAExecutionProvider", {"gpu_memory": "1"}), "unknown option\\(s\\) gpu_memory, which ONNX Runtime refuses"),
    ]:
        with pytest.raises(InputError, match=message):
            parse_spec(spec)


def test_a_session_places_on_the_cpu_providers_unless_literal():
    model = cnn()
    x = np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)
    device = uhop_onnx.optimize(model, ["CPUExecutionProvider"], profile=False)
    literal = uhop_onnx.optimize(model, ["CPUExecutionProvider"], profile=False, policy="literal")
    assert device.get_providers() == [CPU_HERE[0]] and literal.get_providers() == ["ort-cpu"]
    got = [uhop_onnx.InferenceSession(plan).run(None, {"input": x})[0] for plan in (device, literal)]
    np.testing.assert_allclose(got[0], got[1], rtol=1e-4, atol=1e-5)
