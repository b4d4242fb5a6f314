"""Every registered provider through the one contract: what it declares (device kind, precisions, bundle format)
agrees with what it answers; present here, it answers capability with reasons, compiles, runs as ONNX Runtime
CPU computes in fp32, is safe to call from many threads, closes, and writes and loads its bundle stage where
it has a format this host can write. A provider absent here is skipped with its own reason. The precisions a
provider offers follow what this host computes."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from uhop_onnx.foundation.graph import Graph
from uhop_onnx.foundation.host import cpu_features, host_arch
from uhop_onnx.precision.accuracy import FP32_TOLERANCE, compare
from uhop_onnx.foundation.errors import ProviderError
from uhop_onnx.providers import DEVICE_KINDS, REGISTRY, create, device_kind
from uhop_onnx.providers.capability import check

from .conftest import random_feeds, reference

ROOT = Path(__file__).resolve().parents[1]
IDS = list(REGISTRY)
# every provider on every device it knows (rknn's simulator, OpenVINO's GPU and NPU...)
KNOWN = [pytest.param((ident, options), marks=[pytest.mark.slow] if options.get("simulate") else [])  # a simulator
         for ident, cls in REGISTRY.items() for options in cls.known_options()]
# What follows from a provider's `lowerings`, `format` and `static_shapes`, defined once in the base.
DERIVED = ("precisions", "at_precision", "variants", "lower", "export_blocker", "export", "_load_artifact", "simulator",
           "compile")


def dense(batch: int | str = 4) -> onnx.ModelProto:
    """x [batch, 16] -> Gemm -> Relu -> MatMul -> Add (a bias) -> y [batch, 8]: ops every provider runs, weights
    scaled as a trained layer's are (by 1/sqrt(fan-in)), so that outputs keep the size of the inputs."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), name)
               for name, shape in (("w1", (16, 32)), ("b1", (32,)), ("w2", (32, 8)), ("b2", (8,)))]
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="gemm"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["m"], name="matmul"),
             helper.make_node("Add", ["m", "b2"], ["y"], name="bias")]
    graph = helper.make_graph(nodes, "dense", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 8])], weights)
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)])


def _present(ident: str, options: dict | None = None):
    provider = REGISTRY[ident](options, threads=1)
    if not provider.present:
        pytest.skip(f"{provider.label} is absent here: {provider.availability.reason}")
    return provider


def _known_id(known) -> str:
    ident, options = known
    return ":".join([ident, *(f"{k}={v}" for k, v in options.items())])


def _assert_close(provider, model, got: dict, feeds: dict) -> None:
    """Within the accuracy the provider promises against ONNX Runtime CPU in fp32: rtol 1e-4, atol 1e-5, or the
    looser `tolerance` it declares (RKNN's NPU computes in fp16)."""
    tolerance = getattr(provider, "tolerance", None) or FP32_TOLERANCE
    for name, want in zip((o.name for o in model.graph.output), reference(model, feeds), strict=True):
        verdict = compare(got[name], want, tolerance)
        assert verdict["ok"], (provider.label, name, tolerance, verdict)


@pytest.mark.parametrize("ident", IDS)
def test_declarations_agree(ident):
    cls = REGISTRY[ident]
    assert cls.kind in DEVICE_KINDS
    for options in cls.known_options():
        assert device_kind(ident, options) in DEVICE_KINDS
    assert cls.bundle_precisions[0] == "fp32"
    assert set(cls().precisions()) <= set(cls.bundle_precisions)
    overridden = [hook for hook in DERIVED if vars(cls).get(hook) is not None]
    assert not overridden, f"{ident} overrides {overridden}, which follow from what it declares"
    assert list(cls.lowerings)[0] == "fp32" and cls.bundle_precisions == tuple(cls.lowerings)
    assert (cls.artifact_format, cls.simulator_name) == ((cls.format.name, cls.format.simulator_name)
                                                         if cls.format else (None, ""))
    absent = cls().availability
    if not absent.present:
        assert absent.reason and absent.install, absent


@pytest.mark.parametrize("spec, refused", [
    (("litert", {"fp16": True}), True), (("ort-qnn", {"fp16": True}), True), (("ort-tensorrt", {"fp16": True}), True),
    (("QNNExecutionProvider", {"enable_htp_fp16_precision": "1"}), False),
    (("TensorrtExecutionProvider", {"trt_fp16_enable": True}), False)])
def test_an_option_that_would_set_a_precision_is_refused_naming_the_precision(spec, refused):
    """fp16 stages are asked for as precision fp16 (labelled `[fp16]`, checked at fp16's tolerance), never by an
    option that would build them under an fp32 label and check them at fp32's. ONNX Runtime's own such options
    (a drop-in script's) are accepted and ignored, with a warning naming precision fp16: the stage stays fp32."""
    if refused:
        with pytest.raises(ProviderError, match="ask for precision fp16 instead"):
            create(spec)
        return
    with pytest.warns(UserWarning, match=r"is ignored: the stage runs at fp32; for fp16, pass precision='fp16'"):
        provider = create(spec)
    assert provider.label == provider.id and provider.precision == "fp32"
    assert not any(value in (True, "1") for key, value in provider.ep_options().items() if "fp16" in key)


@pytest.mark.parametrize("ident", IDS)
def test_capability_answers_carry_reasons(ident):
    provider = REGISTRY[ident]()
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    node = helper.make_node("Mystery", ["x"], ["y"], name="mystery", domain="com.example")
    model = helper.make_model(helper.make_graph([node], "g", [x], [helper.make_tensor_value_info(
        "y", TensorProto.FLOAT, [2])]), opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(
        "com.example", 1)])
    refused = check(provider.table, Graph.from_model(model).nodes[0], Graph.from_model(model))
    assert not refused.ok and "com.example" in refused.reason
    present = _present(ident)
    for name, verdict in present.query(dense()).items():
        assert verdict.ok or verdict.reason, name


@pytest.mark.slow
@pytest.mark.parametrize("known", KNOWN, ids=_known_id)
def test_compiles_runs_as_onnx_runtime_from_many_threads_and_closes(known):
    provider = _present(*known)
    model = dense()
    samples = [random_feeds(model, seed=k) for k in range(8)]
    with provider.compile(model, exclusive=False) as runner:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(runner.run, samples))
        for feeds, got in zip(samples, results, strict=True):
            _assert_close(provider, model, {k: runner.to_host(v) for k, v in got.items()}, feeds)


@pytest.mark.slow
@pytest.mark.parametrize("known", KNOWN, ids=_known_id)
def test_free_batch_runs_at_each_shape(known):
    """A stage with a free batch dimension runs at two batch sizes, on a fixed-shape runtime too."""
    provider = _present(*known)
    model = dense("batch")
    with provider.compile(model, exclusive=False) as runner:
        for batch in (1, 3):
            feeds = {"x": np.random.default_rng(batch).standard_normal((batch, 16)).astype(np.float32)}
            _assert_close(provider, model, {k: runner.to_host(v) for k, v in runner.run(feeds).items()}, feeds)


def _offset(batch: int = 4) -> onnx.ModelProto:
    """`dense`, its output plus Cast(k) for an int64 input k [batch, 8]."""
    model = dense(batch)
    model.graph.node[-1].output[0] = "d"
    model.graph.node.extend([helper.make_node("Cast", ["k"], ["kf"], to=TensorProto.FLOAT, name="cast"),
                             helper.make_node("Add", ["d", "kf"], ["y"], name="offset")])
    model.graph.input.append(helper.make_tensor_value_info("k", TensorProto.INT64, [batch, 8]))
    return model


@pytest.mark.slow
@pytest.mark.parametrize("known", KNOWN, ids=_known_id)
def test_arrays_as_numpy_hands_them_run_as_plain_ones(known):
    """Arrays a runtime cannot read in place (read-only, strided, int64 typed `longlong` as ONNX Runtime's
    outputs are) give what plain arrays give."""
    provider = _present(*known)
    model = _offset() if all(v.ok for v in provider.query(_offset()).values()) else dense()
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 32)).astype(np.float32)
    k = rng.integers(-3, 3, (4, 8))
    read_only = x[:, :16].copy()
    read_only.setflags(write=False)
    fed = [{"x": np.ascontiguousarray(x[:, ::2]), "k": k}, {"x": x[:, ::2], "k": k.astype(np.longlong)},
           {"x": read_only, "k": k[::-1].copy()[::-1]}]
    with provider.compile(model, exclusive=False) as runner:
        for feeds in fed:
            feeds = {name: value for name, value in feeds.items() if name in {i.name for i in model.graph.input}}
            plain = {name: np.array(value) for name, value in feeds.items()}
            _assert_close(provider, model, {k: runner.to_host(v) for k, v in runner.run(feeds).items()}, plain)


@pytest.mark.parametrize("known", KNOWN, ids=_known_id)
def test_exports_and_loads_its_format(known, tmp_path):
    provider = _present(*known)
    if provider.format is None and provider.artifact_format is None:
        assert provider.export_blocker()
        pytest.skip(f"{provider.label} has no bundle format")
    blocker = provider.export_blocker()
    if blocker:
        pytest.skip(f"{provider.label} cannot write its stages here: {blocker}")
    model = dense()
    artifact = provider.export(model, tmp_path, "stage").to_json()
    assert artifact["format"] == provider.artifact_format
    assert all((tmp_path / name).is_file() for name in artifact["files"])
    feeds = random_feeds(model, seed=3)
    try:
        runner = type(provider).load_artifact(tmp_path, artifact, threads=1)
    except ImportError as missing:
        pytest.skip(f"{provider.label}'s stage was written; its board runtime is not here to load it ({missing})")
    with runner:
        _assert_close(provider, model, {k: runner.to_host(v) for k, v in runner.run(feeds).items()}, feeds)


@pytest.mark.slow
def test_openvino_offers_only_precisions_it_compiles_with_onednn_held_to_avx2():
    """Held below AVX-512 BF16, OpenVINO's CPU plugin still reports BF16 but fails to compile bf16: not offered
    there, and every precision it does offer compiles (in a process of its own, as oneDNN reads the variable
    once)."""
    _present("openvino")
    code = """if True:
        import numpy as np
        from tests.test_provider_contract import dense
        from uhop_onnx.providers.openvino import OpenVino
        offered = OpenVino().precisions()
        assert "bf16" not in offered, offered
        for precision in offered:
            if precision != "int8":
                OpenVino().at_precision(precision).compile(dense()).run({"x": np.ones((4, 16), np.float32)})
        print(offered)
    """
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_openvino_offers_bf16_where_the_cpu_computes_it():
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):
        pytest.skip("ONEDNN_MAX_CPU_ISA holds oneDNN's ISA: the test held at AVX2 covers that case")
    provider = _present("openvino")
    import openvino as ov

    reported = "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    computes = host_arch() != "x86_64" or "avx512bf16" in cpu_features()
    assert ("bf16" in provider.precisions()) == (reported and computes)


@pytest.mark.parametrize("cpu", [("x86_64", ["avx2", "fma"]), ("x86_64", ["avx2", "avx512_vnni"]),
                                 ("x86_64", ["avx2", "avx-vnni"]), ("aarch64", ["neon", "dotprod"])])
def test_onnx_runtime_int8_weights_keep_to_7_bits_for_a_cpu_without_vnni(cpu):
    """Quantized for an x86-64 CPU without VNNI (a target's, not this host's), weights keep within [-64, 64];
    else they take the full int8 range."""
    from uhop_onnx.providers import quantize

    reduced = cpu == ("x86_64", ["avx2", "fma"])
    model = dense()
    calibration = quantize.Calibration(model, [random_feeds(model, seed=k) for k in range(4)], cpu)
    stage = quantize.quantize_int8(model, calibration, "static")
    weights = [numpy_helper.to_array(t) for t in stage.graph.initializer
               if t.data_type == TensorProto.INT8 and t.name.removesuffix("_quantized") in ("w1", "w2")]
    assert len(weights) == 2
    widest = max(int(np.abs(w.astype(np.int32)).max()) for w in weights)
    assert (widest <= 64) == reduced, widest


def test_an_openvino_device_that_chooses_at_run_time_has_no_kind():
    from uhop_onnx.foundation.errors import InputError
    from uhop_onnx.providers import device_kind

    assert [device_kind("openvino", {"device": d}) for d in ("CPU", "GPU.1", "npu")] == ["cpu", "gpu", "npu"]
    for device in ("AUTO", "HETERO:GPU,CPU", "MULTI:GPU,CPU"):
        with pytest.raises(InputError, match="not one device"):
            device_kind("openvino", {"device": device})
