"""Hostile models: a corpus of broken and odd ONNX files, generated here, through the Python API and the CLI.

Every case ends in our own clear error (a `UhopError` naming the problem) or in a run that matches ONNX
Runtime; never in another exception, a crash of the interpreter, a hang, or a file written outside the
output folder.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import uhop_onnx
from uhop_onnx import UhopError

from .conftest import assert_matches, reference
from .support import deadline

SECONDS = 120  # per case: far above what a healthy case takes on a loaded 2-core machine


def _value(name: str, shape=(2, 3), elem=TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, None if shape is None else list(shape))


def _model(nodes, inputs=("x",), outputs=("y",), initializers=(), opset=17, shape=(2, 3), **graph) -> onnx.ModelProto:
    g = helper.make_graph(nodes, graph.pop("name", "g"), [_value(i, shape) for i in inputs],
                          [_value(o, shape) for o in outputs], list(initializers), **graph)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _relu() -> onnx.ModelProto:
    return _model([helper.make_node("Relu", ["x"], ["y"], name="relu")])


def _bytes(model: onnx.ModelProto) -> bytes:
    return model.SerializeToString()


def _external(location: str, length: int = 24, offset: int = 0) -> onnx.ModelProto:
    """x + w, with w (2x3 float) stored as external data at `location`."""
    weight = numpy_helper.from_array(np.ones((2, 3), np.float32), "w")
    weight.data_location = TensorProto.EXTERNAL
    weight.ClearField("raw_data")
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        weight.external_data.add(key=key, value=value)
    return _model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], initializers=[weight])


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes | int) -> bytes:
    """One protobuf field: a varint, or length-delimited bytes."""
    if isinstance(payload, int):
        return _varint(number << 3) + _varint(payload)
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _nested_ifs(depth: int) -> bytes:
    """A model whose graph holds an If whose branch holds an If ... `depth` deep, written byte by byte
    (protobuf itself refuses to build it): deeper than protobuf parses."""
    graph = _field(1, _field(1, b"x") + _field(2, b"y") + _field(4, b"Relu"))  # GraphProto.node
    for _ in range(depth):
        branch = _field(1, b"then_branch") + _field(6, graph) + _field(20, onnx.AttributeProto.GRAPH)
        graph = _field(1, _field(1, b"c") + _field(2, b"y") + _field(4, b"If") + _field(5, branch))
    opset = _field(1, b"") + _field(2, 17)
    return _field(1, 8) + _field(7, graph + _field(2, b"g")) + _field(8, opset)


@dataclass(frozen=True)
class Case:
    """One corpus entry: how to write it into a folder, and what must come of it."""

    name: str
    write: Callable[[Path], Path]  # folder -> model file
    runs: bool  # True: must run and match ONNX Runtime; False: must end in a UhopError
    message: str = ""  # for errors: a regex the message must match
    gap: str = ""  # why it fails today, in code outside these tests (an expected failure)


def model_file(data: bytes | onnx.ModelProto, name: str = "model.onnx") -> Callable[[Path], Path]:
    def write(folder: Path) -> Path:
        path = folder / name
        path.write_bytes(_bytes(data) if isinstance(data, onnx.ModelProto) else data)
        return path

    return write


def with_file(model: onnx.ModelProto, extra: str, content: bytes | None = None, link: str | None = None):
    """The model beside an extra file (or a symlink to `link`), both in the model's folder."""

    def write(folder: Path) -> Path:
        target = folder / extra
        target.parent.mkdir(parents=True, exist_ok=True)
        if link is not None:
            target.symlink_to(link)
        else:
            target.write_bytes(content or b"")
        return model_file(model)(folder)

    return write


def outside_secret(model: onnx.ModelProto):
    """The model in a subfolder, and a secret file beside that subfolder."""

    def write(folder: Path) -> Path:
        (folder / "secret.bin").write_bytes(np.full((2, 3), 7, np.float32).tobytes())
        (folder / "model").mkdir()
        return model_file(model)(folder / "model")

    return write


def _cycle() -> onnx.ModelProto:
    return _model([helper.make_node("Add", ["x", "b"], ["a"], name="n1"), helper.make_node("Relu", ["a"], ["b"], name="n2"),
                   helper.make_node("Neg", ["a"], ["y"], name="n3")])


def _huge_constant() -> onnx.ModelProto:
    """ConstantOfShape asked for 2**40 x 2**40 floats."""
    shape = numpy_helper.from_array(np.array([2**40, 2**40], np.int64), "shape")
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["big"], name="fill"),
             helper.make_node("Add", ["x", "big"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "g", [_value("x")], [_value("y", ["n", "m"])], [shape])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _initializer_without_data() -> onnx.ModelProto:
    """An initializer that declares 2**31 x 4 floats and holds none."""
    weight = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[2**31, 4])
    return _model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], initializers=[weight])


def _zero_size() -> onnx.ModelProto:
    empty = numpy_helper.from_array(np.zeros((0, 3), np.float32), "e")
    nodes = [helper.make_node("Concat", ["x", "e"], ["c"], axis=0, name="concat"),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    return _model(nodes, initializers=[empty], shape=(0, 3))


def _duplicate_inputs() -> onnx.ModelProto:
    model = _relu()
    model.graph.input.append(_value("x"))
    return model


def _duplicate_initializers() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.ones((2, 3), np.float32), "w")
    return _model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], initializers=[w, w])


def _path_like_names() -> onnx.ModelProto:
    """Graph, node and tensor names that look like paths out of the output folder."""
    nodes = [helper.make_node("Relu", ["x"], ["../../a"], name="../../../escape"),
             helper.make_node("Neg", ["../../a"], ["y"], name="/etc/passwd")]
    return _model(nodes, name="../../../../tmp/uhop-escape")


def _unknown_domain() -> onnx.ModelProto:
    model = _model([helper.make_node("Pwn", ["x"], ["y"], domain="com.example.evil", name="pwn")])
    model.opset_import.append(helper.make_opsetid("com.example.evil", 1))
    return model


def _ir_version(version: int) -> onnx.ModelProto:
    model = _relu()
    model.ir_version = version
    return model


def _subgraph_reads_nothing() -> onnx.ModelProto:
    branch = helper.make_graph([helper.make_node("Relu", ["ghost"], ["y"])], "b", [], [_value("y")])
    node = helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch, name="if")
    graph = helper.make_graph([node], "g", [_value("c", [], TensorProto.BOOL)], [_value("y")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _type_clash() -> onnx.ModelProto:
    """Add of a float and an int64 tensor."""
    return _model([helper.make_node("Add", ["x", "i"], ["y"], name="add")],
                  initializers=[numpy_helper.from_array(np.ones((2, 3), np.int64), "i")])


VALID = _bytes(_relu())
CORPUS = [
    Case("empty file", model_file(b""), False, "empty"),
    Case("truncated", model_file(VALID[: len(VALID) // 2]), False, "not an ONNX model|truncated"),
    Case("one byte", model_file(VALID[:1]), False, "not an ONNX model|truncated"),
    Case("png magic", model_file(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4), False, "not an ONNX model"),
    Case("zip magic", model_file(b"PK\x03\x04" + b"\0" * 200), False, "not an ONNX model"),
    Case("text", model_file(b"ir_version: 8\ngraph { node { op_type: 'Relu' } }\n"), False, "not an ONNX model"),
    Case("a name that is not UTF-8", model_file(VALID.replace(b"relu", b"\xffelu")), False, "not valid UTF-8"),
    Case("random bytes", model_file(np.random.default_rng(0).bytes(4096)), False, "not an ONNX model"),
    Case("a folder, not a file", lambda folder: (folder / "dir.onnx").mkdir() or folder / "dir.onnx", False,
         "no such file|not a plan"),
    Case("cycle", model_file(_cycle()), False, "cycle through nodes n1 -> n2 -> n1"),
    Case("missing initializer", model_file(_model([helper.make_node("Add", ["x", "w"], ["y"], name="add")])), False,
         "node 'add' reads 'w'"),
    Case("dangling output", model_file(_model([helper.make_node("Relu", ["x"], ["a"], name="relu")])), False,
         "graph output 'y' is produced by nothing"),
    Case("subgraph reads an undefined name", model_file(_subgraph_reads_nothing()), False, "ghost"),
    Case("tensor written twice", model_file(_model([helper.make_node("Relu", ["x"], ["y"], name="a"),
                                                    helper.make_node("Neg", ["x"], ["y"], name="b")])), False,
         "written by both node 'a' and node 'b'"),
    Case("duplicate node names", model_file(_model([helper.make_node("Relu", ["x"], ["a"], name="same"),
                                                    helper.make_node("Neg", ["a"], ["y"], name="same")])), True),
    Case("duplicate graph inputs", model_file(_duplicate_inputs()), False, "'x'"),
    Case("duplicate initializers", model_file(_duplicate_initializers()), False, r"\bw\b"),
    Case("path-like names", model_file(_path_like_names()), True),
    Case("huge declared input dimensions", model_file(_model([helper.make_node("Relu", ["x"], ["y"], name="relu")],
                                                             shape=(2**40, 2**40))), False, "shape|dimension"),
    Case("huge constant", model_file(_huge_constant()), False, ""),
    Case("initializer without its data", model_file(_initializer_without_data()), False, r"\bw\b"),
    Case("zero-size tensors", model_file(_zero_size()), True),
    Case("external data outside the folder", outside_secret(_external("../secret.bin")), False,
         "outside the model's folder"),
    Case("external data at /etc/passwd", model_file(_external("/etc/passwd")), False, "outside the model's folder"),
    Case("external data through a symlink", with_file(_external("link.bin"), "link.bin", link="/etc/passwd"), False,
         "outside the model's folder"),
    Case("external data past the end", with_file(_external("w.bin", offset=16), "w.bin", b"\0" * 24), False,
         "past the end"),
    Case("external data file missing", model_file(_external("absent.bin")), False, "missing"),
    Case("external data inside the folder", with_file(_external("w.bin"), "w.bin",
                                                      np.full((2, 3), 2, np.float32).tobytes()), True),
    Case("unknown domain", model_file(_unknown_domain()), False, "pwn|com.example.evil"),
    Case("unknown op", model_file(_model([helper.make_node("NoSuchOp", ["x"], ["y"], name="nope")])), False,
         "NoSuchOp"),
    Case("opset from the future", model_file(_model([helper.make_node("Relu", ["x"], ["y"])], opset=999)), False,
         "opset 999"),
    Case("opset from the past", model_file(_model([helper.make_node("Relu", ["x"], ["y"])], opset=2)), False,
         "opset 2"),
    Case("IR version 0", model_file(_ir_version(0)), False, "IR version|not an ONNX model"),
    Case("IR version from the future", model_file(_ir_version(99)), False, "IR version 99"),
    Case("type clash", model_file(_type_clash()), False, "add|Add|type"),
    Case("Ifs nested 120 deep", model_file(_nested_ifs(120)), False, ""),
]
PARAMS = [pytest.param(c, id=c.name.replace(" ", "-"), marks=[pytest.mark.xfail(reason=c.gap, strict=True)] if c.gap else [])
          for c in CORPUS]


def files_under(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*")}


def feeds_for(session) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {s.name: rng.standard_normal([d if isinstance(d, int) else 1 for d in s.shape]).astype(s.dtype)
            for s in session.get_inputs()}


@pytest.mark.parametrize("case", PARAMS)
def test_python_api(case, tmp_path, monkeypatch):
    corpus, out = tmp_path / "corpus", tmp_path / "out"
    corpus.mkdir()
    path = case.write(corpus)
    monkeypatch.chdir(corpus)
    before = files_under(tmp_path)
    with deadline(SECONDS):
        try:
            plan = uhop_onnx.optimize(path, profile=False)
            plan.save(out)
            session = uhop_onnx.InferenceSession(out)
            feeds = feeds_for(session)
            results = session.run(None, feeds)
        except UhopError as error:
            assert not case.runs, f"a valid model was refused: {error}"
            assert error.__class__ is not UhopError, "raise a specific subclass"
            message = str(error)
            assert message and "\n" not in message.strip(), "one clear line"
            if case.message:
                assert re.search(case.message, message), message
        else:
            assert case.runs, f"{case.name}: ran without an error"
            assert_matches(results, reference(uhop_onnx.load(path), feeds))  # loaded: nodes named apart
    written = files_under(tmp_path) - before
    assert all(out in p.parents or p == out for p in written), f"written outside {out}: {sorted(written)}"


def test_cli(tmp_path):
    """The whole corpus through `uhop-onnx optimize`, in one interpreter: exit 2 with one line of error and no
    traceback for a bad model, 0 for a good one; no crash, no hang, nothing written outside the output."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    jobs = []
    for index, case in enumerate(CORPUS):
        folder = corpus / f"{index:02d}"
        folder.mkdir()
        jobs.append({"model": str(case.write(folder)), "out": str(tmp_path / "plans" / f"{index:02d}")})
    before = files_under(tmp_path)
    driver = (  # stderr is caught at its descriptor: the command writes there past the runtimes it silences
        "import io, json, os, sys, contextlib, tempfile\n"
        "from uhop_onnx.cli import main\n"
        "codes = []\n"
        "for job in json.loads(sys.argv[1]):\n"
        "    sys.argv = ['uhop-onnx', 'optimize', job['model'], '-o', job['out'], '--no-profile', '--json']\n"
        "    out, caught, kept = io.StringIO(), tempfile.TemporaryFile(mode='w+'), os.dup(2)\n"
        "    os.dup2(caught.fileno(), 2)\n"
        "    sys.stderr = open(2, 'w', buffering=1, closefd=False)\n"
        "    with contextlib.redirect_stdout(out):\n"
        "        try:\n"
        "            main(); code = 0\n"
        "        except SystemExit as exit:\n"
        "            code = exit.code\n"
        "    sys.stderr.flush(); sys.stderr = sys.__stderr__; os.dup2(kept, 2); os.close(kept)\n"
        "    caught.seek(0)\n"
        "    codes.append({'code': code, 'stderr': caught.read()})\n"
        "print(json.dumps(codes))\n"
    )
    done = subprocess.run([sys.executable, "-c", driver, json.dumps(jobs)], capture_output=True, text=True,
                          timeout=SECONDS * 3, cwd=corpus, env={**os.environ, "COLUMNS": "250"}, check=False)
    assert done.returncode == 0, f"the interpreter died ({done.returncode}): {done.stderr[-2000:]}"
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for case, job, result in zip(CORPUS, jobs, results, strict=True):
        if case.gap:
            continue
        assert "Traceback" not in result["stderr"], f"{case.name}: {result['stderr']}"
        if case.runs:
            assert result["code"] == 0, f"{case.name}: {result['stderr']}"
            assert (Path(job["out"]) / "plan.json").is_file()
        else:
            assert result["code"] == 2, f"{case.name}: exit {result['code']}: {result['stderr']}"
            assert result["stderr"].startswith("error:"), f"{case.name}: {result['stderr']}"
    plans = tmp_path / "plans"
    written = files_under(tmp_path) - before
    assert all(plans in p.parents or p == plans for p in written), sorted(written - {plans})
