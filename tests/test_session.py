"""`InferenceSession` and `Plan`: feeds are checked, outputs chosen, plan folders written whole or not at all."""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import uhop_onnx
from uhop_onnx import InputError, PlanError, ProviderError
from uhop_onnx.models import mlp, resnet

from .conftest import assert_matches, random_feeds, reference


@pytest.fixture(scope="module")
def session():
    return uhop_onnx.InferenceSession(resnet(), providers=["ort-cpu"], profile=False)


@pytest.fixture(scope="module")
def adapting():
    """An adapting session, its explorer given no CPU time."""
    adapting = uhop_onnx.InferenceSession(resnet(), providers=["ort-cpu"], adapt_budget=0)
    yield adapting
    adapting.close()


def test_signatures_look_like_onnxruntime(session):
    [x] = session.get_inputs()
    assert (x.name, x.type, x.shape) == ("input", "tensor(float)", [1, 3, 32, 32])
    [y] = session.get_outputs()
    assert (y.name, y.type, y.shape) == ("output", "tensor(float)", [1, 10])
    assert session.get_providers() == ["ort-cpu"]


@pytest.mark.parametrize("feeds, message", [
    ({}, "missing input\\(s\\) 'input'"),
    ({"input": np.zeros((1, 3, 32, 32), np.float32), "extra": np.zeros(1)}, "unknown input\\(s\\) 'extra'"),
    ({"input": np.zeros((1, 3, 32, 32), np.float64)}, "has dtype float64.*expects float32"),
    ({"input": np.zeros((3, 32, 32), np.float32)}, "rank 3.*expects rank 4"),
    ({"input": np.zeros((1, 3, 32, 31), np.float32)}, "dimension 3 must be 32"),
    ({"input": [[1.0]]}, "rank 2.*expects rank 4"),
    ({"input": "text"}, "is a str; pass a numpy array, a list or an OrtValue"),
    ([np.zeros((1, 3, 32, 32), np.float32)], "feeds must be a dict of input name -> numpy array, got list"),
])
@pytest.mark.parametrize("which", ["session", "adapting"])
def test_bad_feeds_are_named(request, which, feeds, message):
    with pytest.raises(InputError, match=message):
        request.getfixturevalue(which).run(None, feeds)


def test_unknown_output_name(session):
    with pytest.raises(InputError, match="unknown output\\(s\\) 'nope'; the model's outputs: output"):
        session.run(["nope"], {"input": np.zeros((1, 3, 32, 32), np.float32)})


def test_intermediate_tensors_are_freed_and_results_match():
    model = mlp()
    names = [n.name for n in model.graph.node]
    assign = {name: ("openvino", "ort-cpu")[i % 2] for i, name in enumerate(names)}
    session = uhop_onnx.InferenceSession(model, providers=["openvino", "ort-cpu"], assign=assign, profile=False)
    feeds = random_feeds(model)
    assert_matches(session.run(["output"], feeds), reference(model, feeds))
    assert len(session.plan.stages) == len(names)


def test_outputs_that_no_stage_computes():
    """A graph output that is a constant, and one that is a graph input passed through."""
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Constant", [], ["c"], value=onnx.numpy_helper.from_array(np.arange(2, dtype=np.float32))),
         onnx.helper.make_node("Relu", ["x"], ["r"], name="relu")],
        "g", [x], [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [2]) for n in ("c", "x", "r")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    feeds = {"x": np.array([-1, 2], np.float32)}
    session = uhop_onnx.InferenceSession(model, profile=False)
    assert_matches(session.run(None, feeds), reference(model, feeds))


def test_assign_errors_name_the_problem():
    model = mlp()
    with pytest.raises(PlanError, match="no node named 'ghost'"):
        uhop_onnx.optimize(model, assign={"ghost": "ort-cpu"}, profile=False)
    with pytest.raises(ProviderError, match="unknown provider 'warp-drive'; valid providers: "):
        uhop_onnx.optimize(model, assign={model.graph.node[0].name: "warp-drive"}, profile=False)
    with pytest.raises(ProviderError, match="unknown provider"):
        uhop_onnx.optimize(model, providers=["cuda"], profile=False)


def test_assign_to_a_provider_that_cannot_run_the_node():
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.STRING, [2])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.STRING, [2])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"], name="copy")], "g", [x], [y])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    with pytest.raises(PlanError, match="node 'copy' is assigned to openvino, which cannot run it: tensor 'x' is string"):
        uhop_onnx.optimize(model, assign={"copy": "openvino"}, profile=False)


def test_save_refuses_a_non_empty_folder(tmp_path):
    plan = uhop_onnx.optimize(mlp(), providers=["ort-cpu"], profile=False)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(PlanError, match="not an empty folder"):
        plan.save(tmp_path / "busy")
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"


FULL_DISK = """
import sys, uhop_onnx
from uhop_onnx.models import mlp
plan = uhop_onnx.optimize(mlp(), providers=["ort-cpu"], profile=False)
try:
    plan.save(sys.argv[1])
except uhop_onnx.OutputError as error:
    sys.exit(f"{error.exit_code} {error}")
"""


def _small_disk():
    """In the child: files may grow to 16 KiB, and a larger write fails (EFBIG) instead of killing it."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))


def test_a_save_that_runs_out_of_space_leaves_nothing(tmp_path):
    done = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path / "plan")], capture_output=True, text=True,
                          preexec_fn=_small_disk, timeout=300, check=False)
    assert done.returncode == 1 and done.stderr.startswith("1 ") and "writing failed midway" in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []


def test_loading_a_folder_that_is_not_a_plan(tmp_path):
    with pytest.raises(PlanError, match="not a plan folder"):
        uhop_onnx.Plan.load(tmp_path)
    (tmp_path / "plan.json").write_text("{not json")
    with pytest.raises(PlanError, match="not a valid plan"):
        uhop_onnx.Plan.load(tmp_path)


def test_sequence_and_optional_values():
    """A `seq(tensor)` input takes a list of arrays, an `optional` one may be None; both are checked."""
    h, T = onnx.helper, onnx.TensorProto
    seq = h.make_tensor_sequence_value_info("s", T.FLOAT, None)
    opt = h.make_value_info("o", h.make_optional_type_proto(h.make_tensor_type_proto(T.FLOAT, [2])))
    graph = h.make_graph([h.make_node("SequenceLength", ["s"], ["n"], name="length"),
                          h.make_node("OptionalHasElement", ["o"], ["has"], name="has")], "g", [seq, opt],
                         [h.make_tensor_value_info("n", T.INT64, []), h.make_tensor_value_info("has", T.BOOL, [])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], ir_version=8)
    session = uhop_onnx.InferenceSession(model, profile=False)
    assert [s.type for s in session.get_inputs()] == ["seq(tensor(float))", "optional(tensor(float))"]
    n, has = session.run(None, {"s": [np.zeros(2, np.float32)] * 3, "o": None})
    assert int(n) == 3 and not bool(has)
    with pytest.raises(InputError, match="pass a list of numpy arrays"):
        session.run(None, {"s": np.zeros(2, np.float32), "o": None})


@pytest.mark.parametrize("provider", ["ort-cpu", "litert"])
def test_arrays_copied_out_of_an_io_binding_own_their_memory(provider):
    model = mlp()
    session = uhop_onnx.InferenceSession(model.SerializeToString(), providers=[provider], profile=False)
    name, output = session.get_inputs()[0].name, session.get_outputs()[0].name
    kept, expected = [], []
    for seed in range(20):
        feeds = random_feeds(model, seed)
        binding = session.io_binding()
        binding.bind_cpu_input(name, feeds[name])
        binding.bind_output(output)
        session.run_with_iobinding(binding)
        kept.append(binding.copy_outputs_to_cpu()[0])
        expected.append(reference(model, feeds)[0])
        del binding  # its OrtValues go; the copies stay
    assert all(array.flags.owndata or array.base is not None for array in kept)
    assert_matches(kept, expected)


@pytest.mark.slow
def test_a_script_run_in_the_source_checkout_finds_the_subpackages_kept_beside_uhop_onnx():
    """After a plain `pip install .`, a script run in the checkout's root (`python -`, `python -c`, a notebook)
    imports the checkout's `uhop_onnx/`, ahead of the installed copy; its providers/ and partitioner/ lie beside
    it, so a session failed with "No module named 'uhop_onnx.providers'". Here the editable install's finder,
    which maps them, is taken away as a plain install has none."""
    root = Path(uhop_onnx.__file__).resolve().parents[1]
    script = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]\n"
              "import numpy as np, uhop_onnx\n"
              "assert uhop_onnx.__file__.startswith(sys.argv[1]), uhop_onnx.__file__\n"
              "from uhop_onnx.models import mlp\n"
              "session = uhop_onnx.InferenceSession(mlp().SerializeToString(), adapt=False)\n"
              "print(session.run(None, {'input': np.ones((4, 64), np.float32)})[0].shape)\n")
    done = subprocess.run([sys.executable, "-", str(root)], input=script, cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_a_call_missing_an_input_raises_and_onnx_runtime_prints_nothing():
    """ONNX Runtime's native run, which a one-stage plan on it calls, finds a missing input only when a node reads
    it, and logged that at its error severity beside the `InputError` raised: a program's stderr gets nothing
    now (a fresh process: the severity is process-wide)."""
    script = ("import numpy as np, uhop_onnx\n"
              "from uhop_onnx.models import mlp\n"
              "session = uhop_onnx.InferenceSession(mlp().SerializeToString(), adapt=False)\n"
              "try:\n"
              "    session.run(None, {})\n"
              "except uhop_onnx.InputError as error:\n"
              "    print(error)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "missing input(s) 'input'" in done.stdout, done.stderr[-2000:]
    assert "onnxruntime" not in done.stderr, done.stderr


def test_an_input_of_unknown_rank_takes_an_ortvalue_or_a_list_of_any_rank():
    """ONNX Runtime shows such an input's shape as `[]`, as it shows a scalar's: a session that starts from its
    view leaves the rank to ONNX Runtime, which runs these as it would alone."""
    import onnxruntime

    io = [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in "xy"]
    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "relu", io[:1], io[1:])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    session = uhop_onnx.InferenceSession(model.SerializeToString())
    value = onnxruntime.OrtValue.ortvalue_from_numpy(-np.ones((2, 3), np.float32))
    np.testing.assert_array_equal(session.run(None, {"x": value})[0], np.zeros((2, 3), np.float32))
    np.testing.assert_array_equal(session.run(None, {"x": [[1.0, -2.0]]})[0], np.array([[1, 0]], np.float32))
