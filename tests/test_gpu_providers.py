"""ONNX Runtime's GPU providers: configuration, detection and absent reasons, the device hand-over and the
capability cache (run for real through the CPU EP), and real GPU runs wherever a device is present."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import onnxruntime as ort
import pytest

from uhop_onnx import InferenceSession
from uhop_onnx.foundation.errors import ProviderError
from uhop_onnx.foundation.graph import Graph
from uhop_onnx.models import BUILDERS
from uhop_onnx.partitioner.extract import extract
from uhop_onnx.providers import REGISTRY, create, devices
from uhop_onnx.providers.capability import Support
from uhop_onnx.providers.ort import DeviceTensor, OrtCpu, OrtCuda, OrtGpuProvider, OrtQnn, OrtRocm, OrtTensorRT
from uhop_onnx.runtime.executor import hand_over

from .conftest import assert_matches, random_feeds, reference

GPU = (OrtTensorRT, OrtCuda, OrtRocm, OrtQnn)
AVAILABLE = ort.get_available_providers()


class GpuPathOnCpu(OrtGpuProvider):
    """The GPU provider's own code (probe, IO binding, hand-over, cache) on the CPU EP, which runs here."""

    id = "gpu-path-on-cpu"
    eps = ("CPUExecutionProvider",)
    package = "onnxruntime"
    install = "pip install onnxruntime"
    device_type = "cpu"


class AzureAsGpu(OrtGpuProvider):
    """An EP this build lists that cannot run a Relu: the 'present but no device' branch, for real."""

    id = "azure-as-gpu"
    eps = ("AzureExecutionProvider",)
    package = "onnxruntime"
    install = "pip install onnxruntime"


def test_registry_puts_accelerators_first_and_ort_cpu_last():
    assert list(REGISTRY)[:5] == ["ort-tensorrt", "ort-cuda", "ort-rocm", "ort-qnn", "rknn"]
    assert list(REGISTRY)[-1] == "ort-cpu"


@pytest.mark.parametrize("cls", GPU, ids=lambda c: c.id)
def test_absent_gpu_provider_names_the_wheel_and_the_install_command(cls):
    if any(ep in AVAILABLE for ep in cls.eps):
        pytest.skip(f"{' or '.join(cls.eps)} is in this onnxruntime build")
    availability = cls().availability
    assert not availability.present
    assert availability.reason.startswith(f"{cls.package} not installed")
    assert ", ".join(AVAILABLE) in availability.reason
    assert availability.install == cls.install
    assert availability in devices()
    with pytest.raises(ProviderError, match=re.escape(f"to install: {cls.install}")):
        cls().compile(BUILDERS["mlp"]())


def test_ep_in_the_build_without_a_device_says_so():
    if "AzureExecutionProvider" not in AVAILABLE:
        pytest.skip("this onnxruntime build has no Azure EP to stand for a GPU EP without a device")
    availability = AzureAsGpu().availability
    assert not availability.present
    assert availability.reason.startswith("Azure EP present but no device: ")


def test_options_are_checked():
    with pytest.raises(ProviderError, match="valid options: device_id"):
        OrtCuda({"device": "GPU"})
    for bad in ("x", -1, True, 1.5):
        with pytest.raises(ProviderError, match="device_id must be a non-negative integer"):
            OrtCuda({"device_id": bad})
    assert OrtCuda({"device_id": "1"}).ep_entry() == ("CUDAExecutionProvider", {"device_id": 1, "use_tf32": 0})


def test_tensorrt_options_set_the_engine_cache_and_its_precision_sets_fp16(tmp_path):
    """trt_fp16_enable follows the precision: on at fp16 (`ort-tensorrt[fp16]`), off otherwise; an `fp16` option,
    which would build fp16 engines labelled fp32, is refused naming precision fp16."""
    tensorrt = OrtTensorRT({"engine_cache": str(tmp_path), "device_id": 2})
    ep, options = tensorrt.ep_entry()
    assert ep == "TensorrtExecutionProvider"
    assert options["device_id"] == 2 and options["trt_fp16_enable"] is False
    assert options["trt_engine_cache_enable"] is True
    assert options["trt_engine_cache_path"] == options["trt_timing_cache_path"] == str(tmp_path)
    fp16 = tensorrt.at_precision("fp16")
    assert fp16.ep_entry()[1]["trt_fp16_enable"] is True and fp16.label == "ort-tensorrt[fp16]"
    assert tensorrt.at_precision("int8").ep_options()["trt_fp16_enable"] is False
    assert "fp16" not in OrtTensorRT.option_names
    for value in (True, "yes"):
        with pytest.raises(ProviderError, match="ask for precision fp16 instead"):
            OrtTensorRT({"fp16": value})


def test_rocm_goes_through_migraphx_and_hands_over_on_the_host():
    assert OrtRocm.eps == ("MIGraphXExecutionProvider", "ROCMExecutionProvider")
    assert OrtRocm().ep in OrtRocm.eps and OrtRocm.device_type is None


def test_consecutive_gpu_stages_hand_tensors_over_on_the_device():
    provider = GpuPathOnCpu()
    assert provider.availability.present and provider.availability.device == "CPU:0"
    model = BUILDERS["mlp"]()
    graph = Graph.from_model(model)
    half = len(graph.nodes) // 2
    first, second = (provider.compile(extract(model, graph, part))
                     for part in (range(half), range(half, len(graph.nodes))))
    feeds = random_feeds(model)
    middle = first.run(feeds)
    assert all(isinstance(v, DeviceTensor) for v in middle.values())
    handed = {name: hand_over(value, first, second) for name, value in middle.items()}
    assert all(handed[name] is middle[name] for name in middle)  # same device: no copy to the host
    on_host = OrtCpu().compile(extract(model, graph, range(half, len(graph.nodes))))
    assert all(isinstance(hand_over(v, first, on_host), np.ndarray) for v in middle.values())
    before = second.build_seconds
    second.warm_up()  # what TensorRT does at compile time: the first run is part of the build
    assert second.build_seconds > before
    results = second.run(handed)
    assert_matches([hand_over(results[o.name], second, None) for o in model.graph.output], reference(model, feeds))


def test_assignment_record_is_cached_per_model_ep_version_and_options(tmp_path, monkeypatch):
    monkeypatch.setenv("UHOP_CACHE_DIR", str(tmp_path))
    provider, model = GpuPathOnCpu(), BUILDERS["cnn"]()
    assert provider.query(model) == {}
    path = tmp_path / "capability" / f"gpu-path-on-cpu-{ort.__version__}.json"
    assert json.loads(path.read_text()) == {provider.cache_key(model): {}}
    path.write_text(json.dumps({provider.cache_key(model): {"/block0/conv/Conv": "recorded earlier"}}))
    assert provider.query(model) == {"/block0/conv/Conv": Support(False, "recorded earlier", "runtime")}
    assert GpuPathOnCpu({"device_id": 1}).cache_key(model) != provider.cache_key(model)
    assert provider.cache_key(BUILDERS["mlp"]()) != provider.cache_key(model)


@pytest.mark.parametrize("spec", ["ort-cuda", "ort-tensorrt", "ort-rocm"])
def test_real_gpu_run_matches_onnxruntime_cpu(spec):
    provider = create(spec)
    if not provider.present:
        pytest.skip(f"{spec}: {provider.availability.reason}")
    model = BUILDERS["cnn"]()
    session = InferenceSession(model, providers=[spec], profile=False)
    assert session.get_providers()[0] == spec
    feeds = random_feeds(model)
    actual, expected = session.run(None, feeds), reference(model, feeds)
    if spec == "ort-tensorrt":  # TensorRT may pick TF32 kernels for fp32 layers
        np.testing.assert_allclose(actual[0], expected[0], rtol=1e-3, atol=1e-3)
    else:
        assert_matches(actual, expected)


def test_qnn_is_configured_by_its_ep_options_and_its_precisions():
    """ONNX Runtime's QNN EP as a provider by configuration: fp32 computed in fp32 on the HTP, fp16 by the EP's
    own option, int8 as the QDQ model; an NPU, so Ray asks for its resource and Triton has no backend for it."""
    qnn = OrtQnn()
    assert qnn.ep_entry() == ("QNNExecutionProvider", {"backend_type": "htp", "enable_htp_fp16_precision": "0"})
    fp16 = qnn.at_precision("fp16")
    assert fp16.ep_options()["enable_htp_fp16_precision"] == "1" and fp16.label == "ort-qnn[fp16]"
    assert OrtQnn({"backend_type": "cpu"}).ep_options()["backend_type"] == "cpu"
    assert qnn.precisions() == ["fp32", "fp16", "int8"] and OrtQnn.bundle_precisions == ("fp32", "fp16", "int8")
    assert [v.label for v in qnn.variants("int8")] == ["ort-qnn[int8]"]
    assert qnn.artifact_format == "onnx" and devices_kind("ort-qnn") == "npu"
    with pytest.raises(ProviderError, match="valid options: backend_type$"):
        OrtQnn({"device": "NPU"})


def devices_kind(ident: str) -> str:
    from uhop_onnx.providers import device_kind

    return device_kind(ident, {})


def test_qnn_ep_name_names_the_npu_then_the_cpu(recwarn):
    """ONNX Runtime's `enable_htp_fp16_precision` (which its QNN EP may turn on by default) is ignored with one
    warning saying how fp16 is asked for here, never refused: the stage runs at fp32, labelled and checked so."""
    from uhop_onnx.providers import from_ort, listed

    ident, options = from_ort("QNNExecutionProvider", {"backend_type": "HTP", "enable_htp_fp16_precision": "1",
                                                       "htp_performance_mode": "burst"})
    assert (ident, options) == ("ort-qnn", {"backend_type": "htp"})
    said = sorted(str(w.message) for w in recwarn.list if w.category is UserWarning)
    assert len(said) == 2 and "'enable_htp_fp16_precision' is ignored: the stage runs at fp32" in said[0]
    assert "precision='fp16' (or --precision fp16)" in said[0] and "'htp_performance_mode'" in said[1]
    assert create((ident, options)).ep_options()["enable_htp_fp16_precision"] == "0"
    ids = [p.id for p in listed(["QNNExecutionProvider"], None, "device")]
    assert ids[0] == "ort-qnn" and ids[-1] == "ort-cpu"


def test_tensorrt_ep_names_fp16_option_is_ignored_with_a_warning_naming_precision_fp16(recwarn):
    from uhop_onnx.providers import from_ort

    ident, options = from_ort("TensorrtExecutionProvider", {"trt_fp16_enable": True, "device_id": "1"})
    assert (ident, options) == ("ort-tensorrt", {"device_id": 1})
    [said] = [str(w.message) for w in recwarn.list if w.category is UserWarning]
    assert said.startswith("TensorrtExecutionProvider: option 'trt_fp16_enable' is ignored: the stage runs at fp32")
    assert "precision='fp16' (or --precision fp16)" in said
    assert create((ident, options)).ep_options()["trt_fp16_enable"] is False


def test_a_drop_in_session_given_onnx_runtimes_fp16_options_runs_at_fp32_here():
    """A script written for onnxruntime that turns on the NPU's and TensorRT's fp16 still makes its session (on
    this host's CPU providers, the absent ones skipped), computed and checked at fp32."""
    model = BUILDERS["cnn"]()
    listed = [("QNNExecutionProvider", {"enable_htp_fp16_precision": "1"}),
              ("TensorrtExecutionProvider", {"trt_fp16_enable": "True"}), "CPUExecutionProvider"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        session = InferenceSession(model, providers=listed, profile=False)
    said = [str(w.message) for w in seen if "precision='fp16'" in str(w.message)]
    assert [m.split(":")[0] for m in said] == ["QNNExecutionProvider", "TensorrtExecutionProvider"], said
    feeds = random_feeds(model)
    try:
        assert session.plan.stages and all(stage.precision == "fp32" for stage in session.plan.stages)
        assert_matches(session.run(None, feeds), reference(model, feeds))
    finally:
        session.close()


def test_qnn_int8_stage_is_onnx_runtimes_qnn_qdq_model():
    """The int8 stage is the uint8 QDQ model ONNX Runtime configures for the QNN EP; ONNX Runtime's CPU runs
    it close to fp32 (checked here, where no HTP is)."""
    from onnx import numpy_helper

    from uhop_onnx.providers.quantize import Calibration

    model = BUILDERS["mlp"]()
    samples = [random_feeds(model, seed=k) for k in range(8)]
    (variant,) = OrtQnn().variants("int8", Calibration(model, samples))
    stage = variant.lower(model)
    zero_points = [numpy_helper.to_array(t) for t in stage.graph.initializer if t.name.endswith("zero_point")]
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in stage.graph.node}
    assert zero_points and {z.dtype for z in zero_points} <= {np.dtype(np.uint8), np.dtype(np.int32)}
    feeds = random_feeds(model, seed=9)
    got, want = reference(stage, feeds)[0], reference(model, feeds)[0]
    assert np.abs(got - want).max() <= 0.05 * (1 + np.abs(want).max())
