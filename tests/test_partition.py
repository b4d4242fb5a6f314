"""Properties of partitioning over random DAGs and random placements."""

from __future__ import annotations

import numpy as np
import onnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from uhop_onnx.foundation.graph import Graph
from uhop_onnx.partitioner.extract import extract
from uhop_onnx.partitioner.partition import partition
from uhop_onnx.runtime.plan import Plan, Stage


@st.composite
def dags(draw) -> onnx.ModelProto:
    """A random DAG of Add/Relu/Neg nodes over one input; every node may read any earlier tensor."""
    size = draw(st.integers(1, 14))
    tensors = ["x"]
    nodes = []
    for i in range(size):
        a = draw(st.sampled_from(tensors))
        if draw(st.booleans()):
            b = draw(st.sampled_from(tensors))
            nodes.append(helper.make_node("Add", [a, b], [f"t{i}"], name=f"n{i}"))
        else:
            nodes.append(helper.make_node(draw(st.sampled_from(["Relu", "Neg"])), [a], [f"t{i}"], name=f"n{i}"))
        tensors.append(f"t{i}")
    read = {name for n in nodes for name in n.input}
    outputs = [t for t in tensors[1:] if t not in read] or [tensors[-1]]
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [2])  # noqa: E731
    graph = helper.make_graph(nodes, "dag", [value("x")], [value(t) for t in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return onnx.shape_inference.infer_shapes(model)


def _reachable(graph: Graph, start: int) -> set[int]:
    seen, todo = set(), [start]
    while todo:
        for j in graph.successors[todo.pop()]:
            if j not in seen:
                seen.add(j)
                todo.append(j)
    return seen


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), model=dags())
def test_stages_are_convex_acyclic_and_cover_every_node_once(data, model):
    graph = Graph.from_model(model)
    placement = data.draw(st.lists(st.sampled_from(["ort-cpu", "openvino", "litert"]), min_size=len(graph.nodes),
                                   max_size=len(graph.nodes)))
    stages = partition(graph, placement)
    stage_of = {node: k for k, s in enumerate(stages) for node in s.nodes}
    assert sorted(stage_of) == list(range(len(graph.nodes)))
    assert sum(len(s.nodes) for s in stages) == len(graph.nodes)
    for k, stage in enumerate(stages):
        assert {placement[i] for i in stage.nodes} == {stage.provider}
        inside = set(stage.nodes)
        for i in stage.nodes:
            for j in graph.successors[i]:
                assert stage_of[j] >= k, "a stage feeds an earlier stage"
                if j not in inside:
                    assert not (_reachable(graph, j) & inside), "a path leaves the stage and comes back"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), model=dags())
def test_extracted_stages_are_valid_and_the_plan_round_trips(data, model, tmp_path_factory):
    graph = Graph.from_model(model)
    placement = data.draw(st.lists(st.sampled_from(["ort-cpu", "openvino"]), min_size=len(graph.nodes),
                                   max_size=len(graph.nodes)))
    stages = []
    for k, spec in enumerate(partition(graph, placement)):
        stage_model = extract(model, graph, spec.nodes, name=f"stage_{k}")
        onnx.checker.check_model(stage_model, full_check=True)
        assert stage_model.ir_version == model.ir_version
        assert list(stage_model.opset_import) == list(model.opset_import)
        stages.append(Stage(provider=spec.provider, options={},
                            nodes=[graph.nodes[i].name for i in spec.nodes],
                            inputs=[i.name for i in stage_model.graph.input],
                            outputs=[o.name for o in stage_model.graph.output],
                            file=f"stage_{k:02d}.onnx", model=stage_model))
    plan = Plan("dag", "0" * 64, [], [], [], stages, constants={"c": np.arange(3, dtype=np.float32)})
    folder = plan.save(tmp_path_factory.mktemp("plan") / "out")
    loaded = Plan.load(folder)
    assert _unhashed(loaded.to_json()) == _unhashed(plan.to_json())  # save records the files' sha256 in its copy
    assert all(len(stage.sha256) == 64 for stage in loaded.stages) and loaded.constants_hash
    for a, b in zip(loaded.stages, plan.stages):
        assert loaded.stage_model(a) == b.model
    np.testing.assert_array_equal(loaded.constants["c"], plan.constants["c"])


def _unhashed(entry: dict) -> dict:
    """A plan's JSON without the sha256 of its files, which `Plan.save` records."""
    return {**{k: v for k, v in entry.items() if k != "constants_sha256"},
            "stages": [{k: v for k, v in stage.items() if k != "sha256"} for stage in entry["stages"]]}
