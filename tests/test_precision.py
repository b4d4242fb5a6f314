"""Reduced precision in the plan: variants chosen by measured speed (a fake clock makes it exact), the
accuracy gate against ONNX Runtime fp32, calibration samples, and int8 stages on the real runtimes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import pytest

import uhop_onnx
from uhop_onnx.foundation.errors import InputError
from uhop_onnx.runtime.measure import Profiler
from uhop_onnx.models import cnn, encoder, mlp
from uhop_onnx.runtime.plan import Plan
from uhop_onnx.precision import errors, gate, read_calibration
from uhop_onnx.providers import REGISTRY
from uhop_onnx.providers.openvino import OpenVino
from uhop_onnx.providers.ort import OrtCpu
from uhop_onnx.providers.quantize import Calibration, quantize_int8

from .conftest import reference
from .host import INT8_COSINE, cpu_features, int8_saturates, openvino_capabilities
from .support import FakeClock, fake_provider


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("UHOP_CACHE_DIR", str(tmp_path / "cache"))


def with_bf16(ident: str, clock: FakeClock, factor: float, wrong: Callable[[onnx.ModelProto], bool] = lambda m: False):
    """A fake provider (ONNX Runtime underneath, charging the clock per op) that offers bf16: its bf16 stages
    cost `factor` times its fp32 ones, and those `wrong` picks add 1 to every output."""
    base = fake_provider(ident, {"Gemm": 1.0, "Conv": 1.0}, 0.05, clock)

    class Variant(base):
        def precisions(self):
            return ["fp32", "bf16"]

        def compile(self, model, *, exclusive=True):
            runner = super().compile(model, exclusive=exclusive)
            if self.precision == "bf16":
                runner.cost *= factor
                if wrong(model):
                    inner = runner.run
                    runner.run = lambda feeds: {k: v + 1.0 for k, v in inner(feeds).items()}
            return runner

    return Variant


def place(monkeypatch, factor: float, wrong: Callable[[onnx.ModelProto], bool] = lambda m: False, model=None,
          **options):
    clock = FakeClock()
    monkeypatch.setitem(REGISTRY, "fake-bf16", with_bf16("fake-bf16", clock, factor, wrong))
    monkeypatch.setitem(REGISTRY, "ort-cpu", fake_provider("ort-cpu", {}, 100.0, clock))
    return uhop_onnx.optimize(model or mlp(), providers=["fake-bf16"], profiler=Profiler(clock=clock, warmup=1),
                              **options)


def test_a_faster_bf16_variant_wins_and_its_accuracy_is_recorded(monkeypatch, tmp_path):
    with pytest.warns(UserWarning, match="generated samples"):
        plan = place(monkeypatch, 0.5, precision="bf16")
    assert {s.precision for s in plan.stages} == {"bf16"}
    assert plan.stages[0].label == "fake-bf16[bf16]"
    assert plan.tolerance == 1e-2 and set(plan.accuracy) == {o.name for o in plan.outputs}
    assert all(a["cosine"] > 0.9999 and a["max_abs_error"] < 1e-5 for a in plan.accuracy.values())
    loaded = Plan.load(plan.save(tmp_path / "plan"))
    assert [s.precision for s in loaded.stages] == ["bf16"] and loaded.accuracy == plan.accuracy


def test_a_slower_bf16_variant_loses(monkeypatch):
    with pytest.warns(UserWarning, match="generated samples"):
        plan = place(monkeypatch, 2.0, precision="bf16")
    assert {s.precision for s in plan.stages} == {"fp32"}
    candidates = plan.profile["candidates"]
    assert candidates["fake-bf16[bf16] first"]["ms"] > candidates[plan.profile["chosen"]]["ms"]


def test_a_variant_with_wrong_values_is_rejected_even_when_fastest(monkeypatch):
    with pytest.warns(UserWarning, match="generated samples"):
        plan = place(monkeypatch, 0.1, wrong=lambda m: True, precision="auto")
    candidates = plan.profile["candidates"]
    fast = min((c for c in candidates.values() if c["ms"] is not None), key=lambda c: c["ms"])
    mixed = [c for name, c in candidates.items() if name.startswith("mixed ")]
    assert mixed and all(c["rejected"] and c["ms"] is None and "not timed" in c["error"] for c in mixed)
    assert fast["stages"].startswith("fake-bf16[bf16]") and fast["rejected"]
    assert fast["ms"] < candidates[plan.profile["chosen"]]["ms"]
    assert all(a["max_abs_error"] >= 1.0 for a in fast["accuracy"].values())
    assert {s.precision for s in plan.stages} == {"fp32"}


def _wrong_at_the_head(model: onnx.ModelProto) -> bool:
    return any(n.op_type == "Gemm" for n in model.graph.node)


def test_a_variant_wrong_on_the_last_blocks_keeps_the_early_ones(monkeypatch):
    with pytest.warns(UserWarning, match="generated samples"):
        plan = place(monkeypatch, 0.5, wrong=_wrong_at_the_head, model=cnn(), precision="bf16")
    candidates, chosen = plan.profile["candidates"], plan.profile["chosen"]
    assert chosen.startswith("mixed ") and not candidates[chosen]["rejected"]
    precision = {node: s.precision for s in plan.stages for node in s.nodes}
    ops = {n.name: n.op_type for n in cnn().graph.node}
    assert {precision[n] for n, op in ops.items() if op == "Conv"} == {"bf16"}
    assert {precision[n] for n, op in ops.items() if op == "Gemm"} == {"fp32"}
    assert all(a["max_abs_error"] < 1e-3 for a in plan.accuracy.values())
    whole = [c for name, c in candidates.items() if not name.startswith("mixed ")]
    assert candidates[chosen]["ms"] < min(c["ms"] for c in whole if not c.get("rejected"))
    assert any(c.get("rejected") for c in whole)  # the all-bf16 plan, faster still
    assert any(c["rejected"] for name, c in candidates.items() if name.startswith("mixed "))  # Gemm at bf16


def test_without_a_gate_or_a_rejection_nothing_is_mixed(monkeypatch):
    fp32 = place(monkeypatch, 0.5, wrong=_wrong_at_the_head, model=cnn())
    with pytest.warns(UserWarning, match="generated samples"):
        bf16 = place(monkeypatch, 0.5, model=cnn(), precision="bf16")
    assert fp32.profile["chosen"] == place(monkeypatch, 0.5, model=cnn()).profile["chosen"]
    for plan in (fp32, bf16):
        assert not any(name.startswith("mixed") for name in plan.profile["candidates"])
    assert {s.precision for s in fp32.stages} == {"fp32"} and {s.precision for s in bf16.stages} == {"bf16"}


def test_fp32_is_the_plan_of_before(monkeypatch):
    default, fp32 = place(monkeypatch, 0.1), place(monkeypatch, 0.1, precision="fp32")
    for plan in (default, fp32):
        assert [(s.label, s.nodes) for s in plan.stages] == [(s.label, s.nodes) for s in default.stages]
        assert {n: c["ms"] for n, c in plan.profile["candidates"].items()} == {
            n: c["ms"] for n, c in default.profile["candidates"].items()}
        assert "tolerance" not in plan.to_json() and plan.accuracy is None
        assert all(s.precision == "fp32" for s in plan.stages)


def test_bad_precision_options_are_refused():
    with pytest.raises(InputError, match="precision: 'int4' is not one of fp32, auto"):
        uhop_onnx.optimize(mlp(), precision="int4")
    with pytest.raises(InputError, match="tolerance"):
        uhop_onnx.optimize(mlp(), precision="bf16", tolerance=-1)
    with pytest.raises(InputError, match="needs profile=True"):
        uhop_onnx.optimize(mlp(), precision="auto", profile=False)


def test_the_gate_is_relative_to_the_output_scale():
    ref = {"y": np.array([[10.0, -2.0]])}
    inside, outside = {"y": np.array([[10.1, -2.0]])}, {"y": np.array([[10.2, -2.0]])}
    assert gate([errors(inside, ref)], 1e-2)[0]  # 0.1 <= 0.01 * 11
    ok, worst = gate([errors(inside, ref), errors(outside, ref)], 1e-2)
    assert not ok and worst["y"]["max_abs_error"] == pytest.approx(0.2) and worst["y"]["top1_agrees"]
    assert not gate([errors({"y": np.array([[np.nan, 0.0]])}, ref)], 1.0)[0]


def test_calibration_from_an_npz_a_folder_or_a_dict(tmp_path):
    x = np.arange(3 * 4, dtype=np.float32).reshape(3, 1, 4)
    np.savez(tmp_path / "all.npz", x=x[:, 0])
    (tmp_path / "each").mkdir()
    for k in range(3):
        np.savez(tmp_path / "each" / f"{k}.npz", x=x[k])
    for source in (tmp_path / "all.npz", tmp_path / "each", {"x": x[:, 0]}):
        samples = read_calibration(source)
        assert len(samples) == 3 and all(np.array_equal(s["x"], x[k]) for k, s in enumerate(samples))
    with pytest.raises(InputError, match="same leading sample axis"):
        read_calibration({"x": x[:, 0], "n": np.zeros(2)})
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="holds no .npz"):
        read_calibration(tmp_path / "empty")
    with pytest.raises(InputError, match="calibration sample 0: the model has no input 'x'; its inputs: input"):
        uhop_onnx.optimize(cnn(), precision="int8", calibration={"x": x})
    model = cnn()
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    one_more_axis = {"input": np.zeros((2, *shape), np.float32)}  # (samples, 1, C, H, W): a sample axis
    assert [s["input"].shape for s in read_calibration(one_more_axis, {"input": shape})] == [tuple(shape)] * 2
    two_more_axes = {"input": np.zeros((2, 1, *shape), np.float32)}
    with pytest.raises(InputError, match=r"has rank 6.*one more axis, of samples.*stacks its samples on the batch"):
        uhop_onnx.optimize(model, precision="int8", calibration=two_more_axes)


def calibration_of(model, count: int, seed: int) -> Calibration:
    rng = np.random.default_rng(seed)
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    return Calibration(model, [{"input": rng.standard_normal(shape).astype(np.float32)} for _ in range(count)])


@pytest.mark.parametrize("provider", [OrtCpu, OpenVino])
def test_int8_on_a_cnn_keeps_cosine_and_top1(provider):
    """At least INT8_COSINE (0.999; 0.99 where the int8 kernels saturate), and the same top-1."""
    model = cnn()
    variant = provider().at_precision("int8", calibration_of(model, 16, seed=1))
    assert "int8" in provider().precisions()
    stage = variant.lower(model)
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in stage.graph.node}
    method = "nncf" if provider is OpenVino else "static"  # OpenVINO's int8 is NNCF's (the quantize extra is here)
    assert stage.SerializeToString() == quantize_int8(model, variant.calibration, method).SerializeToString()
    runner = variant.compile(stage)
    for sample in calibration_of(model, 8, seed=99).samples:  # inputs not in the calibration set
        got, want = runner.run(sample)["output"], reference(model, sample)[0]
        e = errors({"y": got}, {"y": want})["y"]
        assert e["cosine"] >= INT8_COSINE and e["top1_agrees"], e


def held_out_errors(model, runner, count: int = 3) -> list[dict]:
    """`errors` of a runner's first output against ONNX Runtime fp32 on inputs not in any calibration set."""
    from uhop_onnx.foundation.graph import Graph
    from uhop_onnx.foundation.samples import sample_feeds

    graph = Graph.from_model(model)
    out = []
    for seed in range(count):
        x = sample_feeds([graph.signature(n) for n in graph.inputs], seed=seed)
        name = model.graph.output[0].name
        out.append(errors({name: runner.run(x)[name]}, {name: reference(model, x)[0]})[name])
    return out


def encoder_calibration(model, count: int = 8) -> Calibration:
    from uhop_onnx.foundation.graph import Graph
    from uhop_onnx.foundation.samples import sample_feeds

    graph = Graph.from_model(model)
    return Calibration(model, [sample_feeds([graph.signature(n) for n in graph.inputs], seed=100 + k)
                               for k in range(count)])


def test_ort_cpu_int8_is_static_and_dynamic_and_dynamic_keeps_an_encoder_closer():
    model = encoder(layers=1, seq=16, hidden=64)
    static, dynamic = OrtCpu().variants("int8", encoder_calibration(model))
    assert (static.label, dynamic.label) == ("ort-cpu[int8]", "ort-cpu[int8-dynamic]")
    assert static.precision == dynamic.precision == "int8" and dynamic.options == {"quantization": "dynamic"}
    lowered = {v.label: v.lower(model) for v in (static, dynamic)}
    assert {"MatMulInteger", "DynamicQuantizeLinear"} <= {n.op_type for n in lowered["ort-cpu[int8-dynamic]"].graph.node}
    assert "QuantizeLinear" in {n.op_type for n in lowered["ort-cpu[int8]"].graph.node}
    worst = {label: max(e["max_rel_error"] for e in held_out_errors(model, OrtCpu().compile(m)))
             for label, m in lowered.items()}
    if int8_saturates():  # measured in an emulated Haswell: dynamic 0.096, static 0.073
        pytest.skip("dynamic int8 keeps an encoder closer only where the int8 kernels do not saturate: no AVX-512 "
                    "VNNI here (or ONEDNN_MAX_CPU_ISA holds oneDNN below it)")
    assert worst["ort-cpu[int8-dynamic]"] < worst["ort-cpu[int8]"] / 2, worst  # 0.012 vs 0.081 with VNNI
    assert [v.label for v in OrtCpu({"quantization": "dynamic"}).variants("int8")] == ["ort-cpu[int8-dynamic]"]


@pytest.mark.slow
def test_an_int8_search_times_both_ort_quantizations_and_the_plan_says_which(tmp_path):
    model = encoder(layers=1, seq=16, hidden=64)
    cal = encoder_calibration(model, 4)
    plan = uhop_onnx.optimize(model, providers=["ort-cpu"], precision="int8", tolerance=1.0, budget=300,
                              calibration={n: np.concatenate([s[n] for s in cal.samples]) for n in cal.samples[0]})
    timed = {label for block in plan.profile["blocks"] for label in block["ms"]}
    assert {"ort-cpu", "ort-cpu[int8]", "ort-cpu[int8-dynamic]"} <= timed
    loaded = Plan.load(plan.save(tmp_path / "plan"))
    assert [s.label for s in loaded.stages] == [s.label for s in plan.stages]
    for stage in loaded.stages:
        ops = {n.op_type for n in loaded.stage_model(stage).graph.node}
        assert ("MatMulInteger" in ops) == (stage.label == "ort-cpu[int8-dynamic]"), (stage.label, stage.options)
    x = cal.samples[0]
    got = uhop_onnx.InferenceSession(tmp_path / "plan").run(None, x)[0]
    assert errors({"y": got}, {"y": reference(model, x)[0]})["y"]["cosine"] > INT8_COSINE


def test_the_same_calibration_gives_the_same_quantized_stage(tmp_path, monkeypatch):
    model = cnn()
    first = quantize_int8(model, calibration_of(model, 4, seed=1)).SerializeToString()
    monkeypatch.setenv("UHOP_CACHE_DIR", str(tmp_path / "fresh"))
    assert quantize_int8(model, calibration_of(model, 4, seed=1)).SerializeToString() == first  # made again
    assert quantize_int8(model, calibration_of(model, 4, seed=1)).SerializeToString() == first  # from the cache
    other = calibration_of(model, 4, seed=2)
    assert other.digest != calibration_of(model, 4, seed=1).digest
    assert quantize_int8(model, other).SerializeToString() != first


def test_openvino_offers_bf16_where_the_cpu_has_it():
    reported = openvino_capabilities()
    assert ("bf16" in OpenVino().precisions()) == ("avx512bf16" in cpu_features()) == ("BF16" in reported)
    assert ("fp16" in OpenVino().precisions()) == ("FP16" in reported)  # GPU and NPU offer it always


def test_openvino_int8_is_nncf_and_onnx_runtime_qdq_as_two_candidates():
    model = cnn()
    calibration = calibration_of(model, 4, seed=1)
    nncf, static = OpenVino().variants("int8", calibration)
    assert (nncf.label, static.label) == ("openvino[int8]", "openvino[int8-static]")
    assert static.options == {"quantization": "static"} and nncf.options == {}
    assert static.lower(model).SerializeToString() == quantize_int8(model, calibration, "static").SerializeToString()
    assert nncf.lower(model).SerializeToString() != static.lower(model).SerializeToString()
    assert [v.label for v in OpenVino({"quantization": "static"}).variants("int8")] == ["openvino[int8-static]"]


def test_without_nncf_openvino_int8_is_the_onnx_runtime_qdq_model(monkeypatch, caplog):
    import sys

    from uhop_onnx.providers.quantize import offers

    model = cnn()
    calibration = calibration_of(model, 4, seed=1)
    monkeypatch.setitem(sys.modules, "nncf", None)  # as where the quantize extra is not installed
    offers.cache_clear()
    try:
        (variant,) = OpenVino().variants("int8", calibration)
        stage = variant.lower(model)
    finally:
        offers.cache_clear()
    assert variant.label == "openvino[int8]"
    assert stage.SerializeToString() == quantize_int8(model, calibration, "static").SerializeToString()
    assert "openvino int8 by NNCF is not offered" in caplog.text and "pip install 'uhop-onnx[quantize]'" in caplog.text


@pytest.mark.slow
def test_cli_optimize_int8_on_ort_and_explain_shows_the_errors(tmp_path):
    import onnx
    from typer.testing import CliRunner

    from uhop_onnx.cli import app

    onnx.save(cnn(), tmp_path / "cnn.onnx")
    rng = np.random.default_rng(3)
    np.savez(tmp_path / "cal.npz", input=rng.standard_normal((8, 3, 32, 32)).astype(np.float32))
    runner = CliRunner()
    done = runner.invoke(app, ["optimize", str(tmp_path / "cnn.onnx"), "-o", str(tmp_path / "plan"), "-p", "ort-cpu",
                               "--precision", "int8", "--tolerance", "0.05", "--calibration", str(tmp_path / "cal.npz"),
                               "--budget", "300"])
    assert done.exit_code == 0, done.output
    plan = Plan.load(tmp_path / "plan")
    assert plan.tolerance == 0.05
    int8 = [c for c in plan.profile["candidates"].values() if "ort-cpu[int8]" in c["stages"]]
    assert int8 and all(c["accuracy"]["output"]["cosine"] > INT8_COSINE for c in int8)
    shown = runner.invoke(app, ["explain", str(tmp_path / "plan")], env={"COLUMNS": "200"})
    assert shown.exit_code == 0 and "gated at tolerance 0.05" in shown.output and "top-1 agrees" in shown.output
    bad = runner.invoke(app, ["optimize", str(tmp_path / "cnn.onnx"), "-o", str(tmp_path / "p2"), "--precision", "int4"])
    assert isinstance(bad.exception, InputError) and bad.exception.exit_code == 2 and "int4" in str(bad.exception)


def test_litert_fp16_is_its_float16_weights_variant():
    from uhop_onnx.providers.litert import LiteRt

    base = LiteRt()
    variant = base.at_precision("fp16")
    assert base.precisions() == ["fp32", "fp16", "int8"]
    assert variant.options == {} and variant.label == "litert[fp16]" and variant.tolerance["rtol"] > 1e-4
    assert base.options == {} and base.label == "litert" and base.precision == "fp32"


def test_a_named_precision_competes_with_fp32_only_and_auto_with_all():
    from uhop_onnx.precision import wanted

    offered = ["fp32", "bf16", "int8"]
    assert wanted("bf16", offered) == ["fp32", "bf16"] and wanted("int8", offered) == ["fp32", "int8"]
    assert wanted("auto", offered) == offered and wanted("fp16", offered) == ["fp32"]


def test_an_inference_session_takes_the_precision_options(monkeypatch):
    clock = FakeClock()
    monkeypatch.setitem(REGISTRY, "fake-bf16", with_bf16("fake-bf16", clock, 0.5))
    monkeypatch.setitem(REGISTRY, "ort-cpu", fake_provider("ort-cpu", {}, 100.0, clock))
    model = mlp()
    x = {"input": np.random.default_rng(7).standard_normal((4, 64)).astype(np.float32)}
    with pytest.warns(UserWarning, match="generated samples"):
        session = uhop_onnx.InferenceSession(model, providers=["fake-bf16"], precision="bf16", tolerance=1e-3,
                                             profiler=Profiler(clock=clock, warmup=1))
    assert session.plan.tolerance == 1e-3 and {s.precision for s in session.plan.stages} == {"bf16"}
    np.testing.assert_allclose(session.run(None, x)[0], reference(model, x)[0], rtol=1e-4, atol=1e-5)


def test_a_triton_repository_refuses_a_bf16_stage(tmp_path):
    from uhop_onnx.foundation.errors import PlanError
    from uhop_onnx.products.triton import export_triton

    plan = uhop_onnx.optimize(mlp(), providers=["openvino"], profile=False)
    plan.stages[0].precision = "bf16"
    with pytest.raises(PlanError, match="stage 0 runs at bf16"):
        export_triton(plan, tmp_path / "repo")
    assert not (tmp_path / "repo").exists()
