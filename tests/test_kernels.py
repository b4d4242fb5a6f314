"""Our generated kernels: each against numpy over shapes, strides, pads, groups, dilations and transposes;
verification rejecting bad builds; the `kernels` provider inside plans, matching ONNX Runtime."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from uhop_onnx.custom_ops import autotune, build, codegen, verify
from uhop_onnx.custom_ops.spec import (
    ALGORITHMS,
    TARGETS,
    Epilogue,
    KernelSpecError,
    LibrarySpec,
    MicroKernel,
    OpSpec,
    Schedule,
    check_library,
    host_target,
    host_targets,
)
from uhop_onnx.models import BUILDERS
from uhop_onnx.providers import create

import uhop_onnx

from .conftest import assert_matches, random_feeds, reference

HYPOTHESIS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    """A private cache dir (builds, schedules) for this module."""
    mp = pytest.MonkeyPatch()
    mp.setenv("UHOP_CACHE_DIR", str(tmp_path_factory.mktemp("uhop-cache")))
    mp.setattr(verify, "_VERIFIED", {})
    yield
    mp.undo()


@pytest.fixture(scope="module")
def lib(cache):
    return verify.host_library()


def _rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


@HYPOTHESIS
@given(m=st.integers(1, 40), n=st.integers(1, 70), k=st.integers(0, 90), trans_a=st.booleans(),
       trans_b=st.booleans(), bias=st.sampled_from(["none", "col", "row", "full", "scalar"]),
       act=st.sampled_from([Epilogue(), Epilogue(lo=0.0), Epilogue(lo=0.0, hi=6.0)]), alpha=st.sampled_from([1.0, -0.5]),
       variant=st.integers(0, 7), threads=st.integers(1, 2), packed=st.booleans(), seed=st.integers(0, 2**16))
def test_gemm_matches_numpy(lib, m, n, k, trans_a, trans_b, bias, act, alpha, variant, threads, packed, seed):
    rng = np.random.default_rng(seed)
    a = _rand(rng, k, m).T if trans_a else _rand(rng, m, k)
    b = _rand(rng, n, k).T if trans_b else _rand(rng, k, n)
    c = {"none": None, "col": _rand(rng, n), "row": _rand(rng, m, 1), "full": _rand(rng, m, n),
         "scalar": _rand(rng, 1)}[bias]
    mk = lib.spec.micro[variant % len(lib.spec.micro)]
    schedule = Schedule(variant % len(lib.spec.micro), mk.mr * 2, 16, mk.nr * 2, threads=threads)
    packs = {"packed": lib.pack(a, schedule), "packed_b": lib.pack(b.T, schedule, side=1)} if packed else {}
    got = lib.gemm(a, b, schedule, alpha=alpha, bias=c, epilogue=act, **packs)
    want = alpha * (a.astype(np.float64) @ b) + (0 if c is None else c)
    np.testing.assert_allclose(got, verify.clamp(want, act), rtol=1e-4, atol=1e-4)


def test_the_worker_pool_serves_concurrent_callers_and_forked_children(lib):
    """One caller at a time uses the pool (others, and calls from inside a job, start threads of their own);
    a forked child starts workers of its own. Every result is right."""
    rng = np.random.default_rng(5)
    a, b = _rand(rng, 96, 200), _rand(rng, 200, 150)
    want = a.astype(np.float64) @ b
    mk = lib.spec.micro[0]
    schedule = Schedule(0, mk.mr, 16, mk.nr, threads=3)
    with ThreadPoolExecutor(4) as callers:
        got = list(callers.map(lambda t: lib.gemm(a, b, replace(schedule, threads=t)), [2, 3, 4, 1] * 6))
    for result in got:
        np.testing.assert_allclose(result, want, rtol=1e-4, atol=1e-4)
    pid = os.fork()
    if pid == 0:  # the child has none of the parent's workers
        os._exit(0 if np.allclose(lib.gemm(a, b, schedule), want, rtol=1e-4, atol=1e-4) else 1)
    assert os.waitpid(pid, 0)[1] == 0


@HYPOTHESIS
@given(n=st.integers(1, 2), groups=st.sampled_from([1, 2, 3]), cg=st.integers(1, 3), ocg=st.integers(1, 3),
       h=st.integers(1, 12), w=st.integers(1, 12), kh=st.integers(1, 4), kw=st.integers(1, 3),
       stride=st.tuples(st.integers(1, 3), st.integers(1, 3)), pads=st.tuples(*[st.integers(0, 2)] * 4),
       dil=st.tuples(st.integers(1, 2), st.integers(1, 2)), algo=st.sampled_from(ALGORITHMS),
       threads=st.integers(1, 2), relu=st.booleans(), residual=st.sampled_from(["none", "copied", "in place"]),
       packed=st.booleans(), variant=st.integers(0, 7), seed=st.integers(0, 2**16))
def test_conv2d_matches_numpy(lib, n, groups, cg, ocg, h, w, kh, kw, stride, pads, dil, algo, threads, relu,
                              residual, packed, variant, seed):
    if h + pads[0] + pads[2] < dil[0] * (kh - 1) + 1 or w + pads[1] + pads[3] < dil[1] * (kw - 1) + 1:
        return  # no output position: ONNX rejects such a Conv
    rng = np.random.default_rng(seed)
    x, wt, bias = _rand(rng, n, cg * groups, h, w), _rand(rng, ocg * groups, cg, kh, kw), _rand(rng, ocg * groups)
    act = Epilogue(lo=0.0) if relu else Epilogue()
    variant %= len(lib.spec.micro)
    mk = lib.spec.micro[variant]
    schedule = Schedule(variant, mk.mr, 8, mk.nr, algo=algo, threads=threads)
    want = verify.conv_reference(x, wt, bias, stride, pads, dil, groups)
    res = None if residual == "none" else _rand(rng, *want.shape)
    kept = None if res is None else res.copy()
    weights = lib.pack(wt.reshape(wt.shape[0], -1), schedule, groups) if packed and schedule.packs_weights else None
    got = lib.conv2d(x, wt, schedule, bias=bias, strides=stride, pads=pads, dilations=dil, group=groups, epilogue=act,
                     packed=weights, residual=res, out=res if residual == "in place" else None)
    np.testing.assert_allclose(got, verify.clamp(want + (0 if res is None else kept), act), rtol=1e-4, atol=1e-4)
    if residual == "copied":
        np.testing.assert_array_equal(res, kept)


@pytest.mark.parametrize("target", [t for t in TARGETS if t != "aarch64-neon"])
def test_every_target_this_host_runs_passes_verification(cache, target):
    if target not in host_targets():
        pytest.skip(f"this CPU does not run {target}; it runs {', '.join(host_targets())}")
    assert verify.load(LibrarySpec(target)).spec.target == target


def test_conv_reference_is_onnx_runtime_conv():
    """The numpy reference every kernel is checked against agrees with ONNX Runtime's Conv."""
    rng = np.random.default_rng(1)
    x, w, b = _rand(rng, 2, 6, 9, 8), _rand(rng, 4, 3, 3, 2), _rand(rng, 4)
    attrs = {"strides": [2, 1], "pads": [1, 0, 2, 1], "dilations": [1, 2], "group": 2}
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], **attrs)
    graph = helper.make_graph([node], "c", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    want = reference(model, {"x": x})[0]
    got = verify.conv_reference(x, w, b, (2, 1), (1, 0, 2, 1), (1, 2), 2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bias_act_along_any_axis(lib):
    rng = np.random.default_rng(2)
    x, res = _rand(rng, 2, 3, 4, 37), _rand(rng, 2, 3, 4, 37)
    for axis in range(4):
        bias = _rand(rng, x.shape[axis])
        shape = [1] * 4
        shape[axis] = -1
        got = lib.bias_act(x, bias=bias, axis=axis, epilogue=Epilogue(lo=-0.5, hi=0.5))
        np.testing.assert_allclose(got, np.clip(x + bias.reshape(shape), -0.5, 0.5), rtol=1e-6)
        got = lib.bias_act(x, bias=bias, axis=axis, residual=res)
        np.testing.assert_allclose(got, x + bias.reshape(shape) + res, rtol=1e-6)
    with pytest.raises(KernelSpecError, match=r"residual of shape \(2, 3\) for x of shape"):
        lib.bias_act(x, residual=res[0, 0, :2, :3])


def test_spec_checks_refuse_what_the_target_cannot_do(lib):
    with pytest.raises(KernelSpecError, match="needs 22 vector registers; x86-64-avx2 has 16"):
        check_library(LibrarySpec("x86-64-avx2", (MicroKernel(6, 24),)))
    with pytest.raises(KernelSpecError, match="multiple of 8"):
        check_library(LibrarySpec("x86-64-avx2", (MicroKernel(4, 12),)))
    with pytest.raises(KernelSpecError, match="valid targets: x86-64-avx512, x86-64-avx2, aarch64-neon, scalar"):
        codegen.generate(LibrarySpec("riscv"))
    a = np.ones((4, 4), np.float32)
    mr = lib.spec.micro[0].mr
    with pytest.raises(KernelSpecError, match=f"mc={mr + 1} must be a positive multiple of mr={mr}"):
        lib.gemm(a, a, replace(Schedule(), mc=mr + 1))
    with pytest.raises(KernelSpecError, match="valid: 0 "):
        lib.gemm(a, a, replace(Schedule(), micro=99))


def _broken(spec: LibrarySpec, generate=codegen.generate) -> str:
    """Generated source with one wrong accumulation in the first micro-kernel (as a bad lowering would make)."""
    source = generate(spec)
    assert "c_0_0 = VFMA(a_, b_0, c_0_0);" in source
    return source.replace("c_0_0 = VFMA(a_, b_0, c_0_0);", "c_0_0 = VADD(b_0, c_0_0);", 1)


@pytest.mark.slow
def test_a_wrong_build_is_rejected_and_evicted(lib):
    spec = LibrarySpec(host_target())
    source = _broken(spec)
    path = build.build(source, spec.target)
    with pytest.raises(verify.VerificationError, match=rf"gemm {spec.micro[0].name} .* max error"):
        verify.load(spec, source)
    assert not path.exists() and path not in verify._VERIFIED


def test_a_corrupted_cached_library_is_rebuilt(lib):
    spec = LibrarySpec("scalar", unroll=2)  # a build no test has loaded into this process
    path = build.build(codegen.generate(spec), spec.target)
    good = path.read_bytes()
    path.unlink()  # a new file, not a write into one that may be mapped
    path.write_bytes(good[:4000] + b"garbage")
    loaded = verify.load(spec)
    assert loaded.path == path and path.read_bytes() == good
    np.testing.assert_allclose(loaded.gemm_naive(np.eye(3, dtype=np.float32), np.eye(3, dtype=np.float32)), np.eye(3))


@pytest.mark.slow
def test_the_provider_never_uses_a_library_that_failed(lib, monkeypatch):
    """With the native lowering broken, the provider runs on the verified portable C and stays correct."""
    native = host_target()
    real = codegen.generate
    monkeypatch.setattr(codegen, "generate", lambda spec: _broken(spec, real) if spec.target == native else real(spec))
    monkeypatch.setattr(verify, "_VERIFIED", {})
    model = BUILDERS["mlp"]()
    runner = create("kernels", threads=1).compile(_only(model, ["/fc0/Gemm", "/fc0/relu/Relu"]))
    assert runner.lib.spec.target == "scalar"
    x = random_feeds(model)["input"]
    w, b = (numpy_helper.to_array(t) for t in model.graph.initializer[:2])
    np.testing.assert_allclose(next(iter(runner.run({"input": x}).values())), np.maximum(x @ w.T + b, 0), rtol=1e-5,
                               atol=1e-5)


def _only(model: onnx.ModelProto, nodes: list[str]) -> onnx.ModelProto:
    from uhop_onnx.partitioner.extract import extract

    from uhop_onnx.foundation.graph import Graph

    graph = Graph.from_model(model)
    return extract(model, graph, [graph.index_of[n] for n in nodes])


@pytest.mark.parametrize("name", ["cnn", "resnet", "mobilenet", "mlp"])
def test_models_on_kernels_match_onnx_runtime(lib, name):
    model = BUILDERS[name]()
    session = uhop_onnx.InferenceSession(model, providers=["kernels", "ort-cpu"], profile=False, threads=2)
    placed = {node: stage.provider for stage in session.plan.stages for node in stage.nodes}
    products = [n.name for n in model.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")]
    assert products and all(placed[n] == "kernels" for n in products)
    feeds = random_feeds(model)
    assert_matches(session.run(None, feeds), reference(model, feeds))


def test_query_says_why_a_node_stays_off_kernels(lib):
    from uhop_onnx.partitioner.capabilities import capabilities

    from uhop_onnx.foundation.graph import Graph

    model = BUILDERS["resnet"]()
    session = uhop_onnx.InferenceSession(model, providers=["kernels", "ort-cpu"], profile=False)
    placed = {node: stage.provider for stage in session.plan.stages for node in stage.nodes}
    assert placed["/layer0/add/Add"] == placed["/layer0/relu/Relu"] == "kernels"  # a residual sum
    verdicts = capabilities(model, Graph.from_model(model), create("kernels"))
    assert "GlobalAveragePool is not in kernels's table" in verdicts["/head/pool/GlobalAveragePool"].reason
    node = helper.make_node("Add", ["a", "b"], ["y"], name="sum")
    broadcast = _single_node_model(node, {"a": (2, 3, 4), "b": (3, 1)}, {})
    verdict = capabilities(broadcast, Graph.from_model(broadcast), create("kernels"))["sum"]
    assert not verdict and "both shapes known and equal" in verdict.reason


def test_fusion_and_threads_in_the_runner(lib):
    model = BUILDERS["mobilenet"]()
    stage = _only(model, ["/stem/conv/Conv", "/stem/relu6/Clip", "/dw0/conv/Conv", "/dw0/relu6/Clip"])
    runner = create("kernels", threads=2).compile(stage)
    assert [(s.kind, s.epilogue.hi) for s in runner.steps] == [("Conv", 6.0), ("Conv", 6.0)]
    feeds = random_feeds(stage)
    got = runner.run(feeds)
    assert_matches(list(got.values()), reference(stage, feeds))
    assert {schedule.threads for schedule in runner.schedules.values()} == {2}


def test_autotune_caches_the_winner_per_device(lib):
    op = OpSpec("gemm", (37, 45, 29, 0, 1))
    assert autotune.cached(lib, op, 1) is None
    best = autotune.tune_op(lib, op, 1, budget=0.002)
    assert autotune.cached(lib, op, 1) == best == autotune.schedule_for(lib, op, 1)
    path = autotune.cache_file(lib)
    assert path.parent.parent == build.cache_dir() and path.stem == autotune.fingerprint(lib)
    a, b = autotune.operands(op)
    np.testing.assert_allclose(autotune.prepare(lib, op, best, (a, b))(), a @ b, rtol=1e-4, atol=1e-4)


def test_kernels_tune_cli_tunes_a_model(lib, tmp_path):
    from typer.testing import CliRunner
    from uhop_onnx.cli.kernels import app

    path = tmp_path / "mlp.onnx"
    onnx.save(BUILDERS["mlp"](batch=3, sizes=(24, 40, 12)), path)
    result = CliRunner().invoke(app, ["tune", str(path), "--threads", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert {entry["op"].split("|")[0] for entry in json.loads(result.output)} == {"gemm"}


def test_aarch64_build_runs_under_qemu():
    from uhop_onnx.custom_ops import cross

    missing = cross.missing_tools()
    if missing:
        pytest.skip(f"aarch64 cross tools absent ({', '.join(missing)}); install: {cross.INSTALL}")
    emulated = cross.Emulated()
    rng = np.random.default_rng(3)
    a, b, bias = _rand(rng, 19, 37), _rand(rng, 37, 29), _rand(rng, 29)
    for v, mk in enumerate(emulated.spec.micro):
        got = emulated.gemm(a, b, Schedule(v, mk.mr, 16, mk.nr, threads=2), alpha=0.5, bias=bias,
                            epilogue=Epilogue(lo=0.0))
        np.testing.assert_allclose(got, np.maximum(0.5 * (a.astype(np.float64) @ b) + bias, 0), rtol=1e-4, atol=1e-4)
    convs = [((1, 4, 9, 8), (6, 2, 3, 3), (2, 1), (1, 1, 1, 0), (1, 2), 2),  # x, w, strides, pads, dilations, group
             ((1, 5, 9, 11), (5, 1, 3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 5)]
    for xs, ws, strides, pads, dilations, group in convs:
        x, w = _rand(rng, *xs), _rand(rng, *ws)
        want = verify.conv_reference(x, w, bias[:ws[0]], strides, pads, dilations, group)
        res = _rand(rng, *want.shape)
        for algo in ALGORITHMS:
            got = emulated.conv2d(x, w, Schedule(0, 8, 8, 12, algo=algo), bias=bias[:ws[0]], strides=strides,
                                  pads=pads, dilations=dilations, group=group, residual=res, epilogue=Epilogue(lo=0.0))
            np.testing.assert_allclose(got, np.maximum(want + res, 0), rtol=1e-4, atol=1e-4)
    x, res = _rand(rng, 2, 3, 4, 5), _rand(rng, 2, 3, 4, 5)
    got = emulated.bias_act(x, bias=bias[:3], axis=1, residual=res, epilogue=Epilogue(lo=0.0))
    np.testing.assert_allclose(got, np.maximum(x + bias[:3].reshape(3, 1, 1) + res, 0), rtol=1e-6)
    library = build.build(codegen.generate(emulated.spec), emulated.spec.target)
    assert library.read_bytes()[18] == 183  # ELF e_machine EM_AARCH64


def _single_node_model(node: onnx.NodeProto, inputs: dict[str, tuple], constants: dict[str, np.ndarray],
                       opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(
        [node], "one", [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in inputs.items()],
        [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None)],
        [numpy_helper.from_array(value, name) for name, value in constants.items()])
    return onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8))


_R = np.random.default_rng(7)
NODE_CASES = {
    "gemm transA transB alpha beta full C": (
        helper.make_node("Gemm", ["a", "b", "c"], ["y"], transA=1, transB=1, alpha=0.7, beta=-1.5),
        {"a": (13, 9), "b": (17, 13)}, {"c": _R.standard_normal((9, 17)).astype(np.float32)}),
    "gemm computed operands, column C": (
        helper.make_node("Gemm", ["a", "b", "c"], ["y"]), {"a": (5, 7), "b": (7, 3)},
        {"c": _R.standard_normal((5, 1)).astype(np.float32)}),
    "batched matmul with broadcasting": (
        helper.make_node("MatMul", ["a", "b"], ["y"]), {"a": (2, 1, 5, 6), "b": (3, 6, 4)}, {}),
    "matmul of a rank-3 input by constant weights": (
        helper.make_node("MatMul", ["a", "w"], ["y"]), {"a": (2, 5, 6)},
        {"w": _R.standard_normal((6, 11)).astype(np.float32)}),
    "conv valid padding, no bias": (
        helper.make_node("Conv", ["x", "w"], ["y"], auto_pad="VALID", strides=[2, 2]), {"x": (1, 3, 9, 8)},
        {"w": _R.standard_normal((4, 3, 3, 3)).astype(np.float32)}),
    "clip with only a maximum": (
        helper.make_node("Clip", ["x", "", "hi"], ["y"]), {"x": (3, 4)}, {"hi": np.array(0.25, np.float32)}),
    "channel bias add": (
        helper.make_node("Add", ["bias", "x"], ["y"]), {"x": (2, 3, 4, 5)},
        {"bias": _R.standard_normal((3, 1, 1)).astype(np.float32)}),
    "scalar bias add": (
        helper.make_node("Add", ["x", "bias"], ["y"]), {"x": (2, 3)}, {"bias": np.array([0.5], np.float32)}),
}


@pytest.mark.parametrize("case", sorted(NODE_CASES))
def test_each_op_form_matches_onnx_runtime(lib, case):
    node, inputs, constants = NODE_CASES[case]
    model = _single_node_model(node, inputs, constants)
    runner = create("kernels", threads=2).compile(model)
    feeds = random_feeds(model)
    assert_matches([runner.run(feeds)["y"]], reference(model, feeds))


def test_fused_chains_match_onnx_runtime(lib):
    """MatMul -> bias Add -> Clip fuses into one call; a second reader of the product prevents fusion."""
    w, bias = _R.standard_normal((6, 4)).astype(np.float32), _R.standard_normal(4).astype(np.float32)
    lo, hi = np.array(-0.2, np.float32), np.array(0.3, np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "bias"], ["q"]),
             helper.make_node("Clip", ["q", "lo", "hi"], ["y"]), helper.make_node("Relu", ["p"], ["r"]),
             helper.make_node("MatMul", ["x", "w"], ["p2"]), helper.make_node("Add", ["p2", "bias"], ["y2"])]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, (5, 6))],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "r", "y2")],
                              [numpy_helper.from_array(v, n) for n, v in
                               {"w": w, "bias": bias, "lo": lo, "hi": hi}.items()])
    model = onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))
    runner = create("kernels", threads=1).compile(model)
    assert [s.kind for s in runner.steps] == ["MatMul", "Add", "Clip", "Relu", "MatMul"]
    feeds = random_feeds(model)
    got = runner.run(feeds)
    assert_matches([got["y"], got["r"], got["y2"]], reference(model, feeds))


def _conv_node(x: str, name: str, **attrs) -> onnx.NodeProto:
    return helper.make_node("Conv", [x, f"{name}.w", f"{name}.b"], [name], **attrs)


def test_residual_sums_fuse_into_convolutions(lib):
    """Conv -> Add(residual) -> Relu is one call: into the later of two convolutions (writing over the other's
    result), or adding a stage input (which stays untouched); a sum with no convolution to join runs alone,
    its Relu fused, over a value of the stage it reads last."""
    rng = np.random.default_rng(5)
    nodes = [_conv_node("x", "a", pads=[1, 1, 1, 1]), _conv_node("x", "b", strides=[1, 1]),
             helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Relu", ["s"], ["y"]),
             _conv_node("y", "c", pads=[1, 1, 1, 1]), helper.make_node("Add", ["x", "c"], ["t"]),
             helper.make_node("Add", ["t", "y"], ["u"]), helper.make_node("Relu", ["u"], ["z"])]
    shapes = {"a": (4, 4, 3, 3), "b": (4, 4, 1, 1), "c": (4, 4, 3, 3)}
    constants = {f"{n}.{p}": _rand(rng, *(shape if p == "w" else shape[:1])) for n, shape in shapes.items()
                 for p in ("w", "b")}
    graph = helper.make_graph(nodes, "res", [helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, 4, 6, 7))],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, n) for n, v in constants.items()])
    model = onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))
    runner = create("kernels", threads=1).compile(model)
    assert [(s.kind, s.output, s.residual, s.donate, s.epilogue.lo) for s in runner.steps] == [
        ("Conv", "a", None, False, float("-inf")), ("Conv", "y", "a", True, 0.0),
        ("Conv", "t", "x", False, float("-inf")), ("Add", "z", "y", True, 0.0)]
    feeds = random_feeds(model)
    x = feeds["x"].copy()
    assert_matches([runner.run(feeds)["z"]], reference(model, feeds))
    np.testing.assert_array_equal(feeds["x"], x)
