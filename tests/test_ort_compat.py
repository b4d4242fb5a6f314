"""uhop_onnx as a drop-in for onnxruntime: one script run with either imported as `ort` prints the same."""

from __future__ import annotations

import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import uhop_onnx
from uhop_onnx import InputError, ProviderError
from uhop_onnx.models import EXAMPLE_ENCODER, cnn, mlp

from .conftest import assert_matches, random_feeds, reference

SCRIPT = Path(__file__).with_name("ort_script.py")


def _model(nodes, inputs, outputs, initializers=(), name="g") -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return model


def attention() -> onnx.ModelProto:
    """Self-attention-like scores over symbolic `batch` and `seq` dimensions, and a LayerNorm."""
    rng = np.random.default_rng(7)
    weight = numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w")
    scale, bias = (numpy_helper.from_array(np.full(8, v, np.float32), n) for n, v in (("ln.scale", 1.5), ("ln.bias", 0.1)))
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["q"], name="/attn/q"),
        helper.make_node("Transpose", ["x"], ["xt"], name="/attn/t", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "xt"], ["s"], name="/attn/scores"),
        helper.make_node("Softmax", ["s"], ["scores"], name="/attn/softmax", axis=-1),
        helper.make_node("MatMul", ["scores", "x"], ["c"], name="/attn/context"),
        helper.make_node("LayerNormalization", ["c", "ln.scale", "ln.bias"], ["y"], name="/ln", axis=-1),
    ]
    io = helper.make_tensor_value_info
    model = _model(nodes, [io("x", TensorProto.FLOAT, ["batch", "seq", 8])],
                   [io("y", TensorProto.FLOAT, ["batch", "seq", 8]), io("scores", TensorProto.FLOAT, ["batch", "seq", "seq"])],
                   [weight, scale, bias], name="attention")
    model.producer_name, model.doc_string, model.model_version = "a-trainer", "attention over tokens", 3
    helper.set_model_props(model, {"author": "someone", "labels": "a,b"})
    return model


def several_outputs() -> onnx.ModelProto:
    """Three outputs of two dtypes, and an initializer that a feed may override."""
    io = helper.make_tensor_value_info
    nodes = [
        helper.make_node("Mul", ["x", "gain"], ["scaled"], name="mul"),
        helper.make_node("Relu", ["scaled"], ["relu"], name="relu"),
        helper.make_node("ArgMax", ["scaled"], ["argmax"], name="argmax", axis=1, keepdims=0),
        helper.make_node("ReduceSum", ["relu", "axes"], ["total"], name="sum", keepdims=1),
    ]
    model = _model(nodes, [io("x", TensorProto.FLOAT, [None, 5]), io("gain", TensorProto.FLOAT, [5])],
                   [io("relu", TensorProto.FLOAT, [None, 5]), io("argmax", TensorProto.INT64, ["n"]),
                    io("total", TensorProto.FLOAT, [None, 1])],
                   [numpy_helper.from_array(np.linspace(-1, 2, 5).astype(np.float32), "gain"),
                    numpy_helper.from_array(np.array([1], np.int64), "axes")], name="heads")
    model.graph.input.pop()  # gain is an initializer listed among the inputs: overridable
    model.graph.input.append(io("gain", TensorProto.FLOAT, [5]))
    return model


def _printed(module: str, paths: list[Path]) -> list[str]:
    run = subprocess.run([sys.executable, "-W", "always::UserWarning", str(SCRIPT), module, *map(str, paths)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[E:onnxruntime" not in run.stderr
    skipped = "provider 'ort-cuda' is not available here" if module == "uhop_onnx" else \
        "Specified provider 'CUDAExecutionProvider' is not in available provider names"
    assert run.stderr.count(skipped) == len(paths), run.stderr  # CUDA skipped with one warning per session
    return [line for line in run.stdout.splitlines() if not line.startswith("provider ")]


def test_one_script_prints_the_same_with_onnxruntime_and_uhop_onnx(tmp_path):
    model = cnn()
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    del model.graph.value_info[:]
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "N"
    paths = []
    for name, m in (("cnn", model), ("attention", attention()), ("heads", several_outputs())):
        paths.append(tmp_path / f"{name}.onnx")
        onnx.save(m, paths[-1])
    paths.append(tmp_path / EXAMPLE_ENCODER.name)  # a TorchScript export with free batch and sequence axes
    shutil.copy(EXAMPLE_ENCODER, paths[-1])
    expected, got = _printed("onnxruntime", paths), _printed("uhop_onnx", paths)
    assert len(got) == len(expected)
    assert sum(line.startswith("num ") for line in got) > 20
    for mine, theirs in zip(got, expected, strict=True):
        if theirs.startswith("num "):
            assert mine.split()[:2] == theirs.split()[:2]
            np.testing.assert_allclose([float(v) for v in mine.split()[2:]], [float(v) for v in theirs.split()[2:]],
                                       rtol=1e-4, atol=1e-4, err_msg=theirs[:80])
        else:
            assert mine == theirs


def test_positional_order_and_provider_names_of_onnxruntime():
    import onnxruntime as ort

    model = cnn().SerializeToString()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = uhop_onnx.InferenceSession(model, options, ["CPUExecutionProvider"], profile=False, policy="literal")
    assert session.get_providers() == ["ort-cpu"] and session.threads == 2
    assert session.get_session_options() is options
    listed = uhop_onnx.InferenceSession(model, ["CPUExecutionProvider"], profile=False, policy="literal")
    assert listed.get_providers() == ["ort-cpu"]
    with pytest.raises(InputError, match="sess_options must be an onnxruntime.SessionOptions"):
        uhop_onnx.InferenceSession(model, {"threads": 2}, profile=False)
    with pytest.raises(InputError, match="provider_options has 2 entries; it needs one per provider"):
        uhop_onnx.InferenceSession(model, None, ["CPUExecutionProvider"], [{}, {}], profile=False)


def test_absent_providers_are_skipped():
    """(ONNX Runtime's names and options: tests/test_provider_names.py.)"""
    from uhop_onnx.providers import resolve

    absent = [a.id for a in uhop_onnx.devices() if not a.present and a.id.startswith("ort-")]
    if not absent:
        pytest.skip("every ONNX Runtime provider is present here")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = resolve([absent[0], "ort-cpu"])
    assert [p.id for p in chosen] == ["ort-cpu"]
    assert [str(w.message) for w in caught if f"provider {absent[0]!r} is not available here" in str(w.message)]
    assert len(caught) == 1
    with pytest.raises(ProviderError, match=f"provider {absent[0]!r} is not available"):
        resolve([absent[0], "ort-cpu"], strict=True)
    with pytest.raises(ProviderError, match="not available"):
        uhop_onnx.InferenceSession(cnn(), providers=[absent[0]], strict=True, profile=False)


def test_feeds_are_converted_as_onnxruntime_converts_them():
    import onnxruntime as ort

    model = several_outputs()
    session = uhop_onnx.InferenceSession(model, providers=["ort-cpu"], profile=False)
    x = np.arange(10, dtype=np.float32).reshape(2, 5) - 4
    expected = reference(model, {"x": x})
    assert_matches(session.run(None, {"x": x.tolist()}), expected)
    assert_matches(session.run(None, {"x": ort.OrtValue.ortvalue_from_numpy(x)}), expected)
    gain = np.ones(5, np.float32)
    assert [i.name for i in session.get_overridable_initializers()] == ["gain"]
    assert_matches(session.run(None, {"x": x, "gain": gain}), reference(model, {"x": x, "gain": gain}))
    with pytest.raises(ValueError, match="missing input\\(s\\) 'x'"):
        session.run(None, {})


def test_fallback_switches_and_profile_trace(tmp_path, monkeypatch):
    import json

    import onnxruntime as ort

    monkeypatch.chdir(tmp_path)
    options = ort.SessionOptions()
    options.enable_profiling = True
    model = several_outputs()
    session = uhop_onnx.InferenceSession(model, options, profile=False, fallback=True)
    session.disable_fallback()
    assert session.fallback is False
    session.enable_fallback()
    assert session.fallback is True
    session.run(None, {"x": np.ones((3, 5), np.float32)})
    events = json.loads(Path(session.end_profiling()).read_text())
    stages = [e for e in events if e["cat"] == "Node"]
    assert len(stages) == len(session.plan.stages)
    assert [e["args"]["provider"] for e in stages] == [s.label for s in session.plan.stages]
    assert all(e["ph"] == "X" and e["dur"] >= 0 for e in events)
    assert session.end_profiling() == ""


def test_io_binding_by_host_pointer_and_the_getters():
    model = several_outputs()
    session = uhop_onnx.InferenceSession(model, providers=["ort-cpu"], profile=False)
    x = np.arange(10, dtype=np.float32).reshape(2, 5)
    binding = session.io_binding()
    binding.bind_input("x", "cpu", 0, np.float32, x.shape, x.ctypes.data)
    binding.bind_output("argmax")
    session.run_with_iobinding(binding)
    [argmax] = binding.copy_outputs_to_cpu()
    np.testing.assert_array_equal(argmax, reference(model, {"x": x})[1])
    with pytest.raises(InputError, match="only host \\(cpu\\) buffers can be bound by pointer"):
        binding.bind_input("x", "cuda", 0, np.float32, x.shape, x.ctypes.data)
    with pytest.raises(InputError, match="binding a preallocated buffer is not supported"):
        binding.bind_output("relu", "cpu", 0, np.float32, [2, 5], x.ctypes.data)
    assert session.get_provider_options() == {"ort-cpu": {}}
    assert session.get_session_options().intra_op_num_threads == 0
    meta = session.get_modelmeta()
    assert (meta.graph_name, meta.version, meta.custom_metadata_map) == ("heads", 2**63 - 1, {})


def test_free_dimensions_nobody_sized_are_placed_without_measuring():
    """onnxruntime scripts give no sizes: a session that does not adapt still runs, placed without timing,
    and says why."""
    with pytest.warns(UserWarning, match="placed without measuring: free dimension.*'seq'"):
        session = uhop_onnx.InferenceSession(attention(), providers=["ort-cpu"], adapt=False)
    assert session.plan.placement == "first-supported"
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    assert_matches(session.run(None, {"x": x}), reference(attention(), {"x": x}))
    with pytest.raises(uhop_onnx.FreeDimensionError, match="'seq'"):
        uhop_onnx.optimize(attention(), providers=["ort-cpu"])


@pytest.mark.slow
@pytest.mark.parametrize("adapt", [True, False])
@pytest.mark.parametrize("names", [[], ()])
def test_no_output_names_means_every_output_as_in_onnxruntime(adapt, names):
    model = cnn()
    feeds = {"input": np.random.default_rng(0).random((1, 3, 32, 32), dtype=np.float32)}
    session = uhop_onnx.InferenceSession(model.SerializeToString(), adapt=adapt, adapt_budget=0)
    assert_matches(session.run(names, feeds), reference(model, feeds))
    session.close()


def test_input_error_is_a_value_error():
    assert issubclass(InputError, ValueError)


def test_a_second_construction_reuses_the_measured_plan(caplog):
    import logging

    from uhop_onnx.models import mlp

    model = mlp(seed=11)
    with caplog.at_level(logging.INFO, logger="uhop_onnx"):
        first = uhop_onnx.InferenceSession(model, providers=["ort-cpu"], budget=0, adapt=False)
    measured = [r.getMessage() for r in caplog.records if r.name == "uhop_onnx.products.optimizer"]
    assert any("chose" in m and "figures measured" in m for m in measured)
    assert any("candidate" in m and " ms " in m for m in measured)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="uhop_onnx"):
        second = uhop_onnx.InferenceSession(model, providers=["ort-cpu"], budget=0, adapt=False)
    assert [r.getMessage() for r in caplog.records if "reusing the plan measured earlier" in r.getMessage()]
    assert not [r for r in caplog.records if "figures measured" in r.getMessage()]
    assert second.plan.placement == "measured" and second.plan.profile == first.plan.profile
    feeds = {"input": np.ones((4, 64), np.float32)}
    assert_matches(second.run(None, feeds), first.run(None, feeds))


def test_a_stage_sharing_its_process_plans_no_memory_pattern_and_a_whole_model_keeps_onnxruntimes_defaults():
    """ONNX Runtime allocates the memory pattern its first run planned on its second, beside what the first left
    in its arena: each session of a plan of several stages held its activations twice."""
    from uhop_onnx.providers import create

    model = mlp()
    shared, whole = (create("ort-cpu").compile(model, exclusive=exclusive) for exclusive in (False, True))
    assert shared.session.get_session_options().enable_mem_pattern is False
    assert whole.session.get_session_options().enable_mem_pattern is True
    feeds = random_feeds(model)
    assert_matches([shared.run(feeds)[o.name] for o in model.graph.output], reference(model, feeds))
    shared.close()
    whole.close()
