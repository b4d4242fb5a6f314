"""A LiteRT conversion checked on this machine is kept: the same stage compiles again without converting,
and a kept file that is not the bytes that were checked is converted again."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import uhop_onnx
from uhop_onnx.models import cnn

from .conftest import assert_matches, random_feeds, reference


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("UHOP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "litert"


def _compile(caplog) -> tuple[uhop_onnx.InferenceSession, list[str]]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="uhop_onnx.providers.litert"):
        session = uhop_onnx.InferenceSession(cnn(seed=21), providers=["litert"], profile=False)
    return session, [r.getMessage() for r in caplog.records if r.name == "uhop_onnx.providers.litert"]


def test_a_checked_conversion_is_reused_and_a_damaged_one_redone(fresh_cache, caplog):
    pytest.importorskip("ai_edge_litert")
    first, said = _compile(caplog)
    # converted once, by the capability check: the plan's stage loads that conversion
    assert sum("converted and verified in" in m for m in said) == 1, said
    again, said = _compile(caplog)
    assert said and all("converted and verified earlier on this machine" in m for m in said)
    feeds = random_feeds(cnn(seed=21))
    assert_matches(again.run(None, feeds), reference(cnn(seed=21), feeds))
    for kept in fresh_cache.glob("*.tflite"):
        kept.write_bytes(kept.read_bytes()[:-8] + np.zeros(8, np.uint8).tobytes())
    third, said = _compile(caplog)
    assert any("not the conversion that was checked" in m for m in said)
    assert any("converted and verified in" in m for m in said)
    assert_matches(third.run(None, feeds), reference(cnn(seed=21), feeds))


# A stage with a free dimension, its index input checked against the table it indexes (`indices.checked`).
STAGE = """
import logging, sys, numpy as np, onnx
from onnx import TensorProto, helper, numpy_helper
from uhop_onnx.providers import create

logging.basicConfig(level=logging.INFO)
table = numpy_helper.from_array(np.arange(40, dtype=np.float32).reshape(10, 4), "table")
node = helper.make_node("Gather", ["table", "ids"], ["y"], name="lookup")
graph = helper.make_graph([node], "lookup", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3, 4])], [table])
runner = create("litert").compile(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
got = runner.run({"ids": np.array([[0, 9, -10], [1, 2, 3]], np.int64)})["y"]
assert got[0, 1, 0] == 36 and got[0, 2, 0] == 0, got
try:
    runner.run({"ids": np.array([[0, 10, 1], [1, 2, 3]], np.int64)})
except Exception as error:
    print("refused:", error)
print("simplifier:", "uhop_onnx.model.simplify" in sys.modules or "onnx_ir" in sys.modules)
"""


def test_a_stage_converted_at_a_shape_loads_there_again_without_the_simplifier(fresh_cache):
    """A process that runs a free-shaped stage at a shape converted before loads the kept conversion without
    fixing and simplifying the stage again (no onnx-ir, no sympy), and still checks its index inputs."""
    pytest.importorskip("ai_edge_litert")
    import subprocess
    import sys

    def run() -> str:
        done = subprocess.run([sys.executable, "-c", STAGE], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout + done.stderr

    first, again = run(), run()
    assert "simplifier: True" in first and "converted and verified in" in first
    assert "simplifier: False" in again and "as converted and verified earlier" in again, again
    for said in (first, again):
        assert "refused: lookup: indices 'ids' hold 0..10, outside -10..9" in said


def test_the_nodes_a_capability_check_converted_are_not_converted_again_for_a_stage_of_them(fresh_cache, caplog):
    """The check names its model "check"; a plan's stage of the same nodes, named otherwise, loads that conversion
    (the whole-plan LiteRT candidate converted and checked the model again in its own process)."""
    pytest.importorskip("ai_edge_litert")
    from uhop_onnx.providers import create

    checked = cnn(seed=21)
    checked.graph.name = "check"
    create("litert").check(checked)
    with caplog.at_level(logging.INFO, logger="uhop_onnx.providers.litert"):
        create("litert").compile(cnn(seed=21)).close()
    said = [r.getMessage() for r in caplog.records if r.name == "uhop_onnx.providers.litert"]
    assert said and all("as converted and verified earlier on this machine" in m for m in said), said
    other = cnn(seed=22)  # other weights: another conversion
    with caplog.at_level(logging.INFO, logger="uhop_onnx.providers.litert"):
        caplog.clear()
        create("litert").compile(other).close()
    assert any("converted and verified in" in r.getMessage() for r in caplog.records)



def test_a_stage_that_declares_its_weights_types_loads_the_conversion_of_the_same_nodes(fresh_cache, caplog):
    """A plan's stage of a Paddle-exported model declares its weights' types as value infos, which the capability
    check's simplified model does not: they restate the weights, so the conversion is the same."""
    pytest.importorskip("ai_edge_litert")
    from onnx import helper

    from uhop_onnx.providers import create

    checked = cnn(seed=24)
    checked.graph.name = "check"
    create("litert").check(checked)
    stage = cnn(seed=24)
    stage.graph.value_info.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                                  for t in stage.graph.initializer)
    with caplog.at_level(logging.INFO, logger="uhop_onnx.providers.litert"):
        create("litert").compile(stage).close()
    said = [r.getMessage() for r in caplog.records if r.name == "uhop_onnx.providers.litert"]
    assert said and all("as converted and verified earlier on this machine" in m for m in said), said


def test_a_plans_litert_stage_converted_ahead_in_a_worker_is_loaded_as_kept_by_the_plan(fresh_cache, tmp_path,
                                                                                          caplog):
    """Before a plan is timed in its own process, the search's worker converts its LiteRT stages at the values
    they receive (`convert_ahead`, the other stages run on ONNX Runtime for them): the plan's process then loads
    each conversion as kept (converting is what made it the largest process of an `optimize`)."""
    pytest.importorskip("ai_edge_litert")
    from uhop_onnx.runtime.compile import compile_plan, convert_ahead
    from uhop_onnx.runtime.measure import SearchWorker
    from uhop_onnx.runtime.plan import Plan

    model = cnn(seed=24)
    for value in (model.graph.input[0], model.graph.output[0]):  # a free batch: converted per shape
        value.type.tensor_type.shape.dim[0].dim_param = "batch"
    del model.graph.value_info[:]
    plan = uhop_onnx.optimize(model, providers=["litert", "ort-cpu"], profile=False,
                              assign={"/block0/conv/Conv": "ort-cpu", "/head/fc/Gemm": "ort-cpu"})
    assert [s.provider for s in plan.stages][:3] == ["ort-cpu", "litert", "ort-cpu"], plan.summary()
    folder = str(plan.save(tmp_path / "plan", report=False))
    feeds = {"input": np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)}
    with SearchWorker() as worker:
        worker.call(convert_ahead, folder, feeds, None, runtime="litert")
    with caplog.at_level(logging.INFO, logger="uhop_onnx.providers.litert"):
        with compile_plan(Plan.load(folder)) as executor:
            got = executor.run(None, feeds)
    said = [r.getMessage() for r in caplog.records if r.name == "uhop_onnx.providers.litert"]
    assert said and all("as converted and verified earlier on this machine" in m for m in said), said
    assert_matches(got, reference(model, feeds))
