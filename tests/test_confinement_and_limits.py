"""Trust in plans, bundles and limits: what a red team broke, each held now.

A forged stage's external data never reads a file outside its folder; a signed archive is refused on its
signature before a member is written; limits nobody set (threads, sample sizes, nesting, pickled arrays, a
graph of no nodes) end in named errors or valid plans; staging a killed process left is swept; a
fixed-batch model calibrates from the documented `.npz` forms.
"""

from __future__ import annotations

import builtins
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import uhop_onnx
from uhop_onnx import BundleError, InputError, PlanError
from uhop_onnx.bundle.manifest import MANIFEST, SIGNATURE, hash_files
from uhop_onnx.bundle.signature import keygen
from uhop_onnx.foundation.dtypes import TensorSig
from uhop_onnx.foundation.files import atomic_file, new_folder, temporary_folder
from uhop_onnx.foundation.host import cores
from uhop_onnx.models import mlp
from uhop_onnx.runtime.plan import Plan
from uhop_onnx.precision import read_calibration, read_choice
from uhop_onnx.providers import REGISTRY, create
from uhop_onnx.runtime.compile import compile_plan
from uhop_onnx.foundation.samples import sample_feeds

from .conftest import random_feeds, reference

CLI = [sys.executable, "-m", "uhop_onnx.cli"]
SECRET = np.full(128 * 128, 1234.5, np.float32).tobytes()  # as large as the mlp's largest weight


def _model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)])


# -- a stage's external data stays in its folder -------------------------------------------------------------

def _externalise(data: bytes, location: str) -> tuple[bytes, str]:
    """A stage model whose largest initializer keeps its data at `location` (the forger's edit)."""
    model = onnx.load_from_string(data)
    weight = max(model.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    weight.ClearField("raw_data")
    weight.ClearField("float_data")
    weight.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(int(np.prod(weight.dims)) * 4))):
        weight.external_data.add(key=key, value=value)
    return model.SerializeToString(), weight.name


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """The victim's home, the working directory, holding `.ssh/id_rsa`."""
    folder = tmp_path / "home"
    (folder / ".ssh").mkdir(parents=True)
    (folder / ".ssh" / "id_rsa").write_bytes(SECRET)
    monkeypatch.chdir(folder)
    return folder


def _forged_plan(provider: str, folder: Path, location: str) -> bytes:
    """A plan in `folder` whose stage keeps a weight at `location`, its sha256 in plan.json rewritten to match;
    the weight's own bytes."""
    if not REGISTRY[provider](None).present:
        pytest.skip(f"{provider} is not present here")
    uhop_onnx.optimize(mlp(), providers=[provider], profile=False).save(folder)
    meta = json.loads((folder / "plan.json").read_text())
    stage = meta["stages"][0]
    original = (folder / stage["file"]).read_bytes()
    data, name = _externalise(original, location)
    (folder / stage["file"]).write_bytes(data)
    stage["sha256"] = hashlib.sha256(data).hexdigest()
    (folder / "plan.json").write_text(json.dumps(meta))
    return next(t.raw_data for t in onnx.load_from_string(original).graph.initializer if t.name == name)


@pytest.mark.parametrize("provider", ["ort-cpu", "openvino", "litert"])
@pytest.mark.parametrize("location", [".ssh/id_rsa", "../home/.ssh/id_rsa", "absolute", "link"])
def test_a_forged_plan_stage_never_reads_a_file_outside_its_folder(provider, location, home, tmp_path):
    """Run from the victim's home: `.ssh/id_rsa` there, or anywhere outside the plan folder, is never read."""
    folder = tmp_path / "plan"
    secret = home / ".ssh" / "id_rsa"
    _forged_plan(provider, folder, {"absolute": str(secret), "link": "weights.bin"}.get(location, location))
    if location == "link":  # a link inside the folder, to the secret
        (folder / "weights.bin").symlink_to(secret)
    with pytest.raises(PlanError, match="outside the model's folder|is missing"):
        compile_plan(Plan.load(folder)).run(None, random_feeds(mlp()))


def test_a_plan_stage_with_its_data_beside_it_still_runs(tmp_path):
    folder = tmp_path / "plan"
    weight = _forged_plan("ort-cpu", folder, "weights.bin")
    (folder / "weights.bin").write_bytes(weight)
    feeds = random_feeds(mlp())
    got = compile_plan(Plan.load(folder)).run(None, feeds)
    np.testing.assert_allclose(got[0], reference(mlp(), feeds)[0], rtol=1e-4, atol=1e-5)


def _pointing(location: str, offset: str = "0") -> TensorProto:
    tensor = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[2], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", offset), ("length", "8")):
        tensor.external_data.add(key=key, value=value)
    return tensor


def _hidden(where: str, tensor: TensorProto) -> onnx.ModelProto:
    """x + w, with w a tensor kept where a scan of initializers alone would miss it."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    constant = helper.make_node("Constant", [], ["w"], value=tensor)
    if where == "attribute":
        return _model([constant, helper.make_node("Add", ["x", "w"], ["y"])], [x], [y])
    if where == "subgraph":
        branch = helper.make_graph([constant], "b", [], [helper.make_tensor_value_info("w", TensorProto.FLOAT, [2])])
        cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
        return _model([helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)], [cond], [y])
    body = [constant, helper.make_node("Add", ["x", "w"], ["y"])]
    function = helper.make_function("local", "AddW", ["x"], ["y"], body, [helper.make_opsetid("", 17)])
    model = _model([helper.make_node("AddW", ["x"], ["y"], domain="local")], [x], [y])
    model.functions.append(function)
    model.opset_import.append(helper.make_opsetid("local", 1))
    return model


@pytest.mark.parametrize("where", ["attribute", "subgraph", "function"])
@pytest.mark.parametrize("location, offset, message", [
    ("../secret.bin", "0", "outside the model's folder"), ("/etc/passwd", "0", "outside the model's folder"),
    ("w\0.bin", "0", "not usable"), ("w.bin", "-4", "runs past the end")])
def test_external_data_hidden_in_attributes_subgraphs_and_functions_is_checked(where, location, offset, message,
                                                                                  tmp_path):
    (tmp_path / "secret.bin").write_bytes(SECRET[:8])
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "w.bin").write_bytes(SECRET[:8])
    path = folder / "m.onnx"
    onnx.save(_hidden(where, _pointing(location, offset)), path)
    with pytest.raises(uhop_onnx.ModelError, match=message):
        uhop_onnx.load(path)


@pytest.fixture(scope="module")
def ort_bundle(tmp_path_factory) -> Path:
    return uhop_onnx.export_bundle(mlp(), "x86-64", tmp_path_factory.mktemp("b") / "mlp", providers=["ort-cpu"])


@pytest.mark.parametrize("which", ["artifact", "reference"])
def test_a_forged_bundle_stage_never_reads_a_file_outside_its_folder(ort_bundle, which, home, tmp_path):
    folder = tmp_path / "bundle"
    shutil.copytree(ort_bundle, folder)
    manifest = json.loads((folder / MANIFEST).read_text())
    stage = manifest["stages"][0]
    name = stage["artifact"]["files"][0] if which == "artifact" else stage["reference"]
    data, _ = _externalise((folder / name).read_bytes(), "../../home/.ssh/id_rsa")
    (folder / name).write_bytes(data)
    manifest["files"] = hash_files(folder)  # the forger rewrites the hashes (the bundle is unsigned)
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="keeps its data in another file"):
        uhop_onnx.load_bundle(folder)
    report = uhop_onnx.verify_bundle(folder)
    assert not report["ok"] and any("another file" in problem for problem in report["files"])


# -- a signed archive: the signature before any member -------------------------------------------------------

ZEROS = 1 << 20


def _archive(path: Path, members: list[tuple[str, int, bytes | None]], kind: bytes = tarfile.REGTYPE) -> Path:
    """A `.tar.gz` of `members` (name, size, data; None for `size` zero bytes), written fast as a gzip member
    per piece: a member of zeros is one compressed MiB of zeros repeated (about 1 KB per MiB)."""
    zeros = gzip.compress(bytes(ZEROS), 9)
    with open(path, "wb") as out:
        for name, size, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.type = size, kind
            out.write(gzip.compress(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")))
            whole, rest = divmod(size, ZEROS) if data is None else (0, 0)
            out.write(zeros * whole)
            out.write(gzip.compress((bytes(rest) if data is None else data) + bytes(-size % 512)))
        out.write(gzip.compress(bytes(1024)))
    return path


@pytest.fixture(scope="module")
def signed(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("signed")
    private, public = keygen(folder / "release")
    bundle = uhop_onnx.export_bundle(mlp(), "x86-64", folder / "mlp", providers=["ort-cpu"], sign=private)
    return bundle, public


@pytest.fixture
def scratch(tmp_path, monkeypatch) -> Path:
    """The temporary folder archives are unpacked into."""
    folder = tmp_path / "scratch"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", None)
    return folder


def test_a_gzip_bomb_under_a_signed_manifest_is_refused_on_its_signature(signed, scratch, tmp_path, monkeypatch):
    """1 GiB of zeros (about 1 MB packed) declared by a manifest edited after signing: refused on the
    signature, before the member is written (without a key it would be written, then fail its sha256)."""
    bundle, public = signed
    manifest = json.loads((bundle / MANIFEST).read_text())
    victim = next(name for name in manifest["files"] if name.startswith("stages/"))
    manifest["files"][victim]["size"] = 1 << 30
    data = json.dumps(manifest).encode()
    sig = (bundle / SIGNATURE).read_bytes()
    bomb = _archive(tmp_path / "bomb.tar.gz", [(MANIFEST, len(data), data), (SIGNATURE, len(sig), sig),
                                               (victim, 1 << 30, None)])
    assert bomb.stat().st_size < 2 << 20
    written = []
    real_open = builtins.open

    def watched(file, mode="r", *args, **kwargs):  # what the unpacking writes
        if "x" in mode or "w" in mode:
            written.append(Path(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", watched)
    with pytest.raises(BundleError, match="signature does not match"):
        uhop_onnx.load_bundle(bomb, key=public)
    monkeypatch.setattr(builtins, "open", real_open)
    assert not any(path.name == Path(victim).name for path in written)
    assert not list(scratch.iterdir())
    report = uhop_onnx.verify_bundle(bomb, key=public)
    assert report["ok"] is False and "signature does not match" in report["signature"]["error"]


def test_a_signed_member_changed_in_the_archive_is_refused_as_it_streams(signed, scratch, tmp_path):
    bundle, public = signed
    manifest = json.loads((bundle / MANIFEST).read_text())
    members = [(MANIFEST, (bundle / MANIFEST).read_bytes()), (SIGNATURE, (bundle / SIGNATURE).read_bytes())]
    members += [(name, (bundle / name).read_bytes()) for name in manifest["files"]]
    victim = next(k for k, (name, _) in enumerate(members) if name.startswith("stages/"))
    members[victim] = (members[victim][0], bytes(len(members[victim][1])))  # same size, other bytes
    archive = _archive(tmp_path / "changed.tar.gz", [(name, len(data), data) for name, data in members])
    with pytest.raises(BundleError, match="does not match its sha256"):
        uhop_onnx.load_bundle(archive, key=public)
    assert not list(scratch.iterdir())


def test_an_archive_larger_than_its_manifest_says_or_than_the_disk_is_refused(signed, scratch, tmp_path):
    bundle, _ = signed
    data = (bundle / MANIFEST).read_bytes()
    padded = _archive(tmp_path / "pax.tar.gz", [("pax", 32 << 20, None)], kind=tarfile.XHDTYPE)  # a header of 32 MiB
    with pytest.raises(BundleError, match="unpacks to more than"):
        uhop_onnx.load_bundle(padded)
    manifest = json.loads(data)
    victim = next(name for name in manifest["files"] if name.startswith("stages/"))
    manifest["files"][victim]["size"] = 1 << 60
    data = json.dumps(manifest).encode()
    huge = _archive(tmp_path / "huge.tar.gz", [(MANIFEST, len(data), data)])
    with pytest.raises(BundleError, match="bytes free"):
        uhop_onnx.load_bundle(huge)
    assert not list(scratch.iterdir())


# -- limits nobody set ---------------------------------------------------------------------------------------

def _threads_now() -> int:
    return len(os.listdir("/proc/self/task"))


def test_threads_past_the_hosts_cores_are_bounded(tmp_path):
    folder = tmp_path / "plan"
    uhop_onnx.optimize(mlp(), providers=["ort-cpu"], profile=False).save(folder)
    meta = json.loads((folder / "plan.json").read_text())
    meta["threads"] = 10000
    (folder / "plan.json").write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match="10000 is more than the"):
        plan = Plan.load(folder)
    assert plan.threads == cores()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert create("ort-cpu", 10000).threads == cores()
        before = _threads_now()
        executor = compile_plan(plan, threads=10000)
        executor.run(None, random_feeds(mlp()))
    assert _threads_now() - before <= 4 * cores() + 8
    executor.close()


@pytest.mark.slow
def test_inputs_too_large_for_this_host_are_named_before_allocating(tmp_path):
    dims = [100000, 100000, 1000]
    model = _model([helper.make_node("Relu", ["x"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)])
    path = tmp_path / "huge.onnx"
    onnx.save(model, path)
    with pytest.raises(InputError, match=r"x: 100000x100000x1000 need .* GiB, more than the"):
        sample_feeds([TensorSig("x", "tensor(float)", dims)])
    done = subprocess.run([*CLI, "optimize", str(path), "-o", str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 2, done.stderr
    assert "GiB" in done.stderr + done.stdout and "Traceback" not in done.stderr


def test_deeply_nested_plan_and_manifest_are_named(tmp_path, ort_bundle):
    folder = tmp_path / "plan"
    uhop_onnx.optimize(mlp(), providers=["ort-cpu"], profile=False).save(folder)
    deep = "[" * 100000 + "]" * 100000
    text = (folder / "plan.json").read_text().rstrip().rstrip("}") + f', "extra": {deep}}}'
    (folder / "plan.json").write_text(text)
    with pytest.raises(PlanError, match="nested too deep"):
        Plan.load(folder)
    bundle = tmp_path / "bundle"
    shutil.copytree(ort_bundle, bundle)
    (bundle / MANIFEST).write_text((bundle / MANIFEST).read_text().rstrip().rstrip("}") + f', "extra": {deep}}}')
    with pytest.raises(BundleError, match="nested too deep"):
        uhop_onnx.load_bundle(bundle)


def test_object_arrays_in_constants_are_named(tmp_path, ort_bundle):
    folder = tmp_path / "plan"
    uhop_onnx.optimize(mlp(), providers=["ort-cpu"], profile=False).save(folder)
    np.savez(folder / "constants.npz", c=np.array([{"a": 1}], dtype=object))
    meta = json.loads((folder / "plan.json").read_text())
    meta["constants"] = ["c"]
    meta["constants_sha256"] = hashlib.sha256((folder / "constants.npz").read_bytes()).hexdigest()
    (folder / "plan.json").write_text(json.dumps(meta))
    with pytest.raises(PlanError, match="'c' holds Python objects"):
        Plan.load(folder)
    bundle = tmp_path / "bundle"
    shutil.copytree(ort_bundle, bundle)
    np.savez(bundle / "constants.npz", c=np.array([None], dtype=object))
    manifest = json.loads((bundle / MANIFEST).read_text())
    manifest["constants"] = "constants.npz"
    manifest["files"] = hash_files(bundle)
    (bundle / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="holds Python objects"):
        uhop_onnx.load_bundle(bundle)


@pytest.mark.parametrize("profile", [False, True])
def test_a_graph_of_no_nodes_is_a_plan_of_no_stages(profile, tmp_path):
    """As ONNX Runtime runs it: each output is the input it names."""
    model = _model([], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])])
    plan = uhop_onnx.optimize(model, providers=["ort-cpu"], profile=profile)
    assert plan.stages == []
    plan.save(tmp_path / "plan")
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    got = compile_plan(Plan.load(tmp_path / "plan")).run(None, feeds)
    np.testing.assert_array_equal(got[0], reference(model, feeds)[0])
    if not profile:  # and a bundle of no stages
        bundle = uhop_onnx.export_bundle(model, "x86-64", tmp_path / "bundle", providers=["ort-cpu"])
        np.testing.assert_array_equal(uhop_onnx.load_bundle(bundle).run(None, feeds)[0], feeds["x"])
        assert uhop_onnx.verify_bundle(bundle)["ok"]


# -- staging a killed process left ---------------------------------------------------------------------------

KILLED = """
import os, signal, sys
from pathlib import Path
from uhop_onnx.foundation.files import atomic_file, new_folder, temporary_folder
where = Path(sys.argv[1])
scratch = temporary_folder("plans")
with atomic_file(where / "b.tar.gz", "wb"), new_folder(where / "plans" / "key"):
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_staging_of_a_killed_process_is_swept_on_the_next_write(tmp_path, scratch):
    done = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == -9, done.stderr
    left = sorted(p.name for p in [*tmp_path.iterdir(), *(tmp_path / "plans").iterdir(), *scratch.iterdir()]
                  if p.name.startswith((".", "uhop-")))
    assert len(left) == 3, left  # .b.tar.gz.uhop-PID-*, .key.uhop-PID-*, uhop-plans-PID-*
    alive = tmp_path / f".c.uhop-{os.getpid()}-abcdefgh"  # this process's: kept
    alive.write_bytes(b"")
    with atomic_file(tmp_path / "b.tar.gz", "wb") as handle:
        handle.write(b"whole")
    with new_folder(tmp_path / "plans" / "other"):
        pass
    with temporary_folder("plans"):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, "b.tar.gz", "plans", "scratch"])
    assert [p.name for p in (tmp_path / "plans").iterdir()] == ["other"]
    assert not list(scratch.iterdir())


# -- calibration of a model with a fixed batch ---------------------------------------------------------------

@pytest.mark.parametrize("form", ["sample axis", "stacked on the batch axis", "folder"])
def test_a_fixed_batch_model_calibrates_from_the_documented_forms(form, tmp_path):
    model = mlp()  # input (4, 64): a batch fixed at 4
    rng = np.random.default_rng(0)
    samples = rng.standard_normal((3, 4, 64)).astype(np.float32)
    if form == "sample axis":
        np.savez(tmp_path / "c.npz", input=samples)
        source = tmp_path / "c.npz"
    elif form == "stacked on the batch axis":
        np.savez(tmp_path / "c.npz", input=samples.reshape(12, 64))
        source = tmp_path / "c.npz"
    else:
        source = tmp_path / "c"
        source.mkdir()
        for k, sample in enumerate(samples):
            np.savez(source / f"{k}.npz", input=sample)
    _, read, first = read_choice("int8", None, source, None, None, model)
    assert [s["input"].shape for s in read] == [(4, 64)] * 3 and first is read[0]
    np.testing.assert_array_equal(np.stack([s["input"] for s in read]), samples)


def test_a_fixed_batch_model_is_optimized_at_int8_from_a_leading_axis_npz(tmp_path):
    np.savez(tmp_path / "c.npz", input=np.random.default_rng(0).standard_normal((3, 4, 64)).astype(np.float32))
    plan = uhop_onnx.optimize(mlp(), providers=["ort-cpu"], precision="int8", calibration=tmp_path / "c.npz")
    assert plan.shapes == {"input": [4, 64]} and plan.tolerance is not None


def test_a_batch_that_does_not_divide_is_named():
    with pytest.raises(InputError, match="must be a multiple of 4"):
        read_calibration({"input": np.zeros((6, 64), np.float32)}, {"input": [4, 64]})
