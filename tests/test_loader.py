"""`uhop_onnx.load`: names, checks, and a clear `ModelError` for each kind of broken model."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import uhop_onnx
from uhop_onnx import ModelError
from uhop_onnx.models import cnn


def _value(name, shape=(2,)):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def _model(nodes, inputs=("x",), outputs=("y",), initializers=(), opset=17):
    graph = helper.make_graph(nodes, "g", [_value(i) for i in inputs], [_value(o) for o in outputs], list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def test_unnamed_nodes_get_op_type_and_index_and_clashes_a_suffix():
    model = _model([
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Neg", ["a"], ["b"], name="Relu_0"),
        helper.make_node("Neg", ["b"], ["c"], name="same"),
        helper.make_node("Neg", ["c"], ["y"], name="same"),
    ])
    assert [n.name for n in uhop_onnx.load(model).graph.node] == ["Relu_0", "Relu_0_1", "same", "same_1"]


def test_loads_from_a_path_and_infers_shapes(tmp_path):
    path = tmp_path / "cnn.onnx"
    onnx.save(cnn(), path)
    loaded = uhop_onnx.load(path)
    assert loaded.graph.value_info, "shape inference added intermediate types"
    assert [n.name for n in loaded.graph.node] == [n.name for n in cnn().graph.node]


def test_an_unsorted_graph_is_sorted():
    model = _model([helper.make_node("Neg", ["a"], ["y"], name="second"), helper.make_node("Relu", ["x"], ["a"], name="first")])
    assert [n.name for n in uhop_onnx.load(model).graph.node] == ["first", "second"]


@pytest.mark.parametrize("data, message", [
    (b"", "empty"),
    (b"\x08\x07garbage that is not protobuf \xff\xff\xff", "not an ONNX model"),
    (cnn().SerializeToString()[:300], "not an ONNX model"),
])
def test_unreadable_files(tmp_path, data, message):
    path = tmp_path / "bad.onnx"
    path.write_bytes(data)
    with pytest.raises(ModelError, match=message):
        uhop_onnx.load(path)


def test_missing_file(tmp_path):
    with pytest.raises(ModelError, match="no such file"):
        uhop_onnx.load(tmp_path / "absent.onnx")


def test_cycle_is_named():
    model = _model([helper.make_node("Add", ["x", "b"], ["a"], name="n1"), helper.make_node("Relu", ["a"], ["b"], name="n2"),
                    helper.make_node("Neg", ["a"], ["y"], name="n3")])
    with pytest.raises(ModelError, match="cycle through nodes n1 -> n2 -> n1"):
        uhop_onnx.load(model)


def test_dangling_input_is_named():
    model = _model([helper.make_node("Add", ["x", "ghost"], ["y"], name="adder")])
    with pytest.raises(ModelError, match="node 'adder' reads 'ghost'"):
        uhop_onnx.load(model)


def test_tensor_written_twice():
    model = _model([helper.make_node("Relu", ["x"], ["y"], name="a"), helper.make_node("Neg", ["x"], ["y"], name="b")])
    with pytest.raises(ModelError, match="written by both node 'a' and node 'b'"):
        uhop_onnx.load(model)


@pytest.mark.parametrize("opset", [0, 99])
def test_unsupported_opset(opset):
    with pytest.raises(ModelError, match=f"opset {opset} of ai.onnx is outside"):
        uhop_onnx.load(_model([helper.make_node("Relu", ["x"], ["y"])], opset=opset))


def test_shape_inference_errors_are_model_errors():
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
                   initializers=[numpy_helper.from_array(np.ones((3, 3), np.float32), "w")])
    with pytest.raises(ModelError, match="mm|MatMul|dimension"):
        uhop_onnx.load(model)


def _external_model(tmp_path, location: str):
    weight = numpy_helper.from_array(np.ones((2,), np.float32), "w")
    weight.data_location = TensorProto.EXTERNAL
    weight.ClearField("raw_data")
    for key, value in (("location", location), ("offset", "0"), ("length", "8")):
        weight.external_data.add(key=key, value=value)
    model = _model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], initializers=[weight])
    path = tmp_path / "model" / "m.onnx"
    path.parent.mkdir()
    path.write_bytes(model.SerializeToString())
    return path


@pytest.mark.parametrize("location", ["/etc/passwd", "../secret.bin", "sub/../../secret.bin"])
def test_external_data_cannot_escape_the_model_folder(tmp_path, location):
    (tmp_path / "secret.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ModelError, match="outside the model's folder"):
        uhop_onnx.load(_external_model(tmp_path, location))


def test_external_data_inside_the_folder_loads(tmp_path):
    path = _external_model(tmp_path, "weights.bin")
    (path.parent / "weights.bin").write_bytes(np.full(2, 3, np.float32).tobytes())
    loaded = uhop_onnx.load(path)
    np.testing.assert_array_equal(numpy_helper.to_array(loaded.graph.initializer[0]), [3, 3])


def test_external_data_shorter_than_declared(tmp_path):
    path = _external_model(tmp_path, "weights.bin")
    (path.parent / "weights.bin").write_bytes(b"\0" * 4)
    with pytest.raises(ModelError, match="runs past the end"):
        uhop_onnx.load(path)


def test_a_session_gives_onnxruntime_the_path_of_a_model_that_keeps_data_in_other_files(tmp_path, monkeypatch):
    path = _external_model(tmp_path, "weights.bin")
    (path.parent / "weights.bin").write_bytes(np.full(2, 3, np.float32).tobytes())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the data is read beside the model, not where the program runs
    session = uhop_onnx.InferenceSession(str(path))
    [stage] = session.plan.stages
    assert stage.data == str(path.resolve())  # not serialized again: ONNX Runtime reads the file and its data
    x = np.array([1, 2], np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], x + 3)
    session.close()


def test_external_data_that_onnx_cannot_read_into_the_model_is_refused(tmp_path):
    """A sparse initializer's data in another file is inside the folder, but onnx reads none there."""
    (tmp_path / "w.bin").write_bytes(np.zeros(2, np.float32).tobytes() + np.arange(2, dtype=np.int64).tobytes())
    values = TensorProto(name="v", data_type=TensorProto.FLOAT, dims=[2], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", "w.bin"), ("offset", "0"), ("length", "8")):
        values.external_data.add(key=key, value=value)
    indices = numpy_helper.from_array(np.arange(2, dtype=np.int64), "i")
    sparse = helper.make_sparse_tensor(values, indices, [2])
    model = _model([helper.make_node("Add", ["x", "v"], ["y"], name="add")])
    model.graph.sparse_initializer.append(sparse)
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(ModelError, match="keeps its data in another file, which is read only for initializers"):
        uhop_onnx.load(path)


def _with_every_kind_of_tensor() -> onnx.ModelProto:
    """Large initializers, a large Constant, a subgraph's initializer, a sparse initializer and an external
    tensor's entries: every place `files.skeleton` leaves values out of."""
    big = np.arange(4096, dtype=np.float32)
    branch = helper.make_graph([helper.make_node("Add", ["x", "b"], ["z"], name="inner")], "then", [],
                               [_value("z", (4096,))], [numpy_helper.from_array(big * 2, "b")])
    nodes = [helper.make_node("Constant", [], ["c"], name="const", value=numpy_helper.from_array(big + 1)),
             helper.make_node("Add", ["x", "w"], ["s"], name="add"),
             helper.make_node("Add", ["s", "c"], ["t"], name="add2"),
             helper.make_node("If", ["cond"], ["y"], name="if", then_branch=branch, else_branch=branch)]
    model = _model(nodes, inputs=("x",), initializers=[numpy_helper.from_array(big, "w"),
                                                        numpy_helper.from_array(np.array(True), "cond")])
    model.graph.output.append(_value("t", (4096,)))
    sparse = helper.make_sparse_tensor(numpy_helper.from_array(big[:300], "sv"),
                                       numpy_helper.from_array(np.arange(300, dtype=np.int64), "si"), [4096])
    model.graph.sparse_initializer.append(sparse)
    far = TensorProto(name="far", data_type=TensorProto.FLOAT, dims=[2], data_location=TensorProto.EXTERNAL)
    far.external_data.add(key="location", value="w.bin")
    model.graph.initializer.append(far)
    return model


def test_a_skeleton_is_the_model_without_its_tensors_values():
    from uhop_onnx.foundation.files import skeleton
    from uhop_onnx.model.loader import _tensors

    model = _with_every_kind_of_tensor()
    data = model.SerializeToString()
    shape = onnx.ModelProto.FromString(skeleton(data))
    assert len(skeleton(data)) < len(data) / 10
    values = ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data")
    for tensor in _tensors(model):
        if tensor.ByteSize() >= 1024:  # a smaller message is kept as it is
            for field in values:
                tensor.ClearField(field)
    assert shape == model
    assert {t.name: t for t in _tensors(shape)}["far"].external_data[0].value == "w.bin"


@pytest.mark.parametrize("data", [b"\x0a\xff\xff\xff\xff\x0f" + b"\0" * 2_000_000, b"\x0b" * 2_000_000])
def test_a_large_file_that_is_no_model_is_named_at_the_start(tmp_path, data):
    path = tmp_path / "m.onnx"
    path.write_bytes(data)
    with pytest.raises(ModelError, match="not an ONNX model"):
        uhop_onnx.InferenceSession(str(path))


def test_a_session_on_a_large_model_holds_it_whole_where_it_is_needed(tmp_path):
    """A session starts from the model's structure; its plan, saved, is the model with every weight."""
    weight = np.random.default_rng(0).random((512, 1024), dtype=np.float32)  # 2 MiB, past `_SKELETON`
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [_value("x", (3, 512))], [_value("y", (3, 1024))], [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    session = uhop_onnx.InferenceSession(str(path))
    assert session.plan.stages[0].data == str(path.resolve())  # ONNX Runtime reads the file, not a copy
    x = np.ones((3, 512), np.float32)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], x @ weight, rtol=1e-5)
    folder = session.plan.save(tmp_path / "plan")
    session.close()
    [stage] = uhop_onnx.Plan.load(folder).stages
    saved = onnx.load(str(folder / stage.file))
    np.testing.assert_array_equal(numpy_helper.to_array(saved.graph.initializer[0]), weight)


@pytest.mark.parametrize("location", ["../secret.bin", "link.bin", "absolute"])
def test_a_session_refuses_external_data_outside_the_model_folder(tmp_path, location):
    (tmp_path / "secret.bin").write_bytes(np.full(2, 7, np.float32).tobytes())
    path = _external_model(tmp_path, str(tmp_path / "secret.bin") if location == "absolute" else location)
    (path.parent / "link.bin").symlink_to(tmp_path / "secret.bin")
    with pytest.raises(ModelError, match="outside the model's folder"):
        uhop_onnx.InferenceSession(str(path))
    # what the session hands the path to refuses it too, were the file changed after uhop-onnx's check
    import onnxruntime

    with pytest.raises(Exception, match="External data path"):
        onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_a_model_nested_past_protobufs_limit_is_named_not_a_recursion_error():
    """Graphs inside If attributes, 400 deep (1200 messages; protobuf's own parser stops at 100), each large
    enough to be walked into: written on the wire, as onnx cannot build them."""
    from uhop_onnx.foundation.files import _encoded, skeleton

    def field(number: int, payload: bytes) -> bytes:
        return _encoded(number << 3 | 2) + _encoded(len(payload)) + payload

    graph = field(5, field(9, bytes(1200)))  # GraphProto.initializer, its raw_data
    for _ in range(400):
        graph = field(1, field(5, field(6, graph)))  # GraphProto.node -> NodeProto.attribute -> AttributeProto.g
    with pytest.raises(ModelError, match="nested over 100 deep"):
        skeleton(field(7, graph))


@pytest.mark.parametrize("source", [3, None, 2.5])
def test_a_model_of_no_known_kind_is_named(source):
    """A file descriptor number is not read as a model file (a session sized the model by it before)."""
    with pytest.raises(TypeError, match=f"a file path, bytes or an onnx.ModelProto, not {type(source).__name__}"):
        uhop_onnx.InferenceSession(source)
    with pytest.raises(TypeError, match="a file path, bytes or an onnx.ModelProto"):
        uhop_onnx.load(source)
