"""The trust model on bundles: hashes detect corruption, signatures detect tampering, and no native code a
bundle carries is loaded unless a signature the loader was given covers it or this host built it.

A hostile corpus: forged hashes, swapped stages, planted libraries whose constructor writes a file (which
must never appear), oversize, unnamed and misplaced archive members, malformed manifest fields. Each ends in
a named error, within a bounded time.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

import uhop_onnx
from uhop_onnx import BundleError, KeyFileError
from uhop_onnx.bundle.manifest import MANIFEST, MANIFEST_LIMIT, SIGNATURE, hash_files
from uhop_onnx.bundle.signature import keygen
from uhop_onnx.models import cnn, mlp
from uhop_onnx.providers.kernels import host_arch

from .conftest import random_feeds, reference

SECONDS = 300
CLI = [sys.executable, "-m", "uhop_onnx.cli"]
# The cnn's convolutions and head on kernels (the static cost model alone would put them on ort-cpu).
ON_KERNELS = {f"/block{i}/{op}": "kernels" for i in range(3) for op in ("conv/Conv", "relu/Relu")} | {
    "/head/fc/Gemm": "kernels"}
needs_x86 = pytest.mark.skipif(host_arch() != "x86_64", reason="the x86-64 target is built with this host's cc")


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> tuple[Path, Path]:
    return keygen(tmp_path_factory.mktemp("keys") / "release")


@pytest.fixture(scope="module")
def kernels_bundle(tmp_path_factory, keys) -> Path:
    """A signed x86-64 bundle of the cnn with kernels and ort-cpu stages."""
    if host_arch() != "x86_64":
        pytest.skip("the x86-64 target is built with this host's cc")
    return uhop_onnx.export_bundle(cnn(), "x86-64", tmp_path_factory.mktemp("k") / "cnn", providers=["kernels", "ort-cpu"],
                                   assign=ON_KERNELS, sign=keys[0])


def _copy(bundle: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "copy"
    shutil.copytree(bundle, folder)
    return folder


def _manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())


def _rehash(folder: Path, change=lambda manifest: None) -> None:
    """What a forger does: edit the manifest and recompute every hash (the signature, if any, stays)."""
    manifest = _manifest(folder)
    change(manifest)
    manifest["files"] = hash_files(folder)
    (folder / MANIFEST).write_text(json.dumps(manifest))


def _planted(tmp_path: Path, name: str = "planted") -> tuple[Path, Path]:
    """A shared library whose constructor writes a file, and the path of that file (absent)."""
    marker = tmp_path / f"{name}-ran"
    source = tmp_path / f"{name}.c"
    source.write_text('#include <stdio.h>\n__attribute__((constructor)) static void pwn(void) {\n'
                      f'  FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("ran", f); fclose(f); }}\n}}\n'
                      'void *tflite_plugin_create_delegate(void *a, void *b, int n, void *e) { return 0; }\n'
                      'void tflite_plugin_destroy_delegate(void *d) {}\n')
    library = tmp_path / f"{name}.so"
    subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(library)], check=True, timeout=60)
    return library, marker


def _cli(*args: str, timeout: int = SECONDS) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "250"}, check=False)


# -- keys and signatures -------------------------------------------------------------------------------------

def test_keygen_writes_a_pem_pair_and_never_overwrites(tmp_path):
    done = _cli("keygen", "-o", tmp_path / "team")
    assert done.returncode == 0, done.stderr
    private, public = tmp_path / "team.key", tmp_path / "team.pub"
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert private.read_text().startswith("-----BEGIN PRIVATE KEY-----")  # PKCS#8
    assert public.read_text().startswith("-----BEGIN PUBLIC KEY-----")  # SubjectPublicKeyInfo
    before = private.read_bytes()
    again = _cli("keygen", "-o", tmp_path / "team")
    assert again.returncode == 2 and "exists" in again.stderr and "Traceback" not in again.stderr
    assert private.read_bytes() == before


@pytest.mark.slow
def test_a_wrong_key_file_is_named_before_any_work(keys, model_file, small_bundle, tmp_path):
    done = _cli("export", model_file, "-t", "x86-64", "-o", tmp_path / "b", "--sign", keys[1])
    assert done.returncode == 2 and "not an unencrypted PEM private key" in done.stderr, done.stderr
    assert not (tmp_path / "b").exists()
    done = _cli("verify", small_bundle, "--key", tmp_path / "absent.pub")
    assert done.returncode == 2 and "cannot read the public key" in done.stderr and "Traceback" not in done.stderr


def test_a_signed_bundle_verifies_and_loads_with_its_key(kernels_bundle, keys):
    report = uhop_onnx.verify_bundle(kernels_bundle, key=keys[1])
    assert report["ok"] and report["signature"]["ok"], report
    model = cnn()
    feeds = random_feeds(model, seed=4)
    loaded = uhop_onnx.load_bundle(kernels_bundle, key=keys[1])
    for got, want in zip(loaded.run(None, feeds), reference(model, feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_another_key_or_no_signature_is_refused(kernels_bundle, tmp_path):
    _, stranger = keygen(tmp_path / "stranger")
    with pytest.raises(BundleError, match="signature does not match"):
        uhop_onnx.load_bundle(kernels_bundle, key=stranger)
    folder = _copy(kernels_bundle, tmp_path)
    (folder / SIGNATURE).unlink()
    with pytest.raises(BundleError, match="unsigned"):
        uhop_onnx.load_bundle(folder, key=stranger)
    with pytest.raises(KeyFileError, match="not a PEM public key"):
        uhop_onnx.load_bundle(folder, key=folder / MANIFEST)


def test_swapped_stages_with_recomputed_hashes_fail_verify_with_the_key(tmp_path, keys):
    """The attack hashes cannot see: another model's stage, reference and sample outputs, hashes recomputed."""
    genuine = uhop_onnx.export_bundle(mlp(seed=0), "x86-64", tmp_path / "genuine", providers=["ort-cpu"], sign=keys[0])
    other = uhop_onnx.export_bundle(mlp(seed=9), "x86-64", tmp_path / "other", providers=["ort-cpu"])
    for name in (*_manifest(genuine)["stages"][0]["artifact"]["files"], "reference/stage_00.onnx",
                 "samples/outputs.npz"):
        shutil.copyfile(other / name, genuine / name)
    _rehash(genuine)
    assert uhop_onnx.verify_bundle(genuine)["ok"], "the forged hashes match: integrity alone cannot tell"
    done = _cli("verify", genuine, "--key", keys[1])
    assert done.returncode == 1 and "tampered" in done.stdout and "signature does not match" in done.stdout
    with pytest.raises(BundleError, match="signature does not match"):
        uhop_onnx.load_bundle(genuine, key=keys[1])


def test_verify_without_a_key_says_the_bundle_is_unsigned(tmp_path):
    bundle = uhop_onnx.export_bundle(mlp(), "x86-64", tmp_path / "b", providers=["ort-cpu"])
    done = _cli("verify", bundle)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "unsigned" in done.stdout and "prove only that no file was corrupted" in done.stdout
    report = json.loads(_cli("verify", bundle, "--json").stdout)
    assert report["signature"] == {"ok": None, "signed": False, "checked": False}


def test_verify_of_a_bundle_nothing_here_can_run_exits_1(tmp_path):
    bundle = uhop_onnx.export_bundle(mlp(), "jetson-orin", tmp_path / "b", providers=["ort-cuda"])
    done = _cli("verify", bundle)
    assert done.returncode == 1 and "no stage could run here" in done.stdout and "--allow-unrun" in done.stdout
    assert _cli("verify", bundle, "--allow-unrun").returncode == 0


# -- native code the bundle carries --------------------------------------------------------------------------

def test_a_planted_kernels_library_never_runs(kernels_bundle, keys, tmp_path):
    """A swapped `.so` with recomputed hashes: the unsigned load builds this host's own library instead, the
    signed load refuses the forged manifest; neither `load_bundle` nor `verify` runs the constructor."""
    folder = _copy(kernels_bundle, tmp_path)
    library = next(name for name in _manifest(folder)["files"] if name.endswith(".so"))
    planted, marker = _planted(tmp_path)
    shutil.copyfile(planted, folder / library)
    _rehash(folder)
    model = cnn()
    feeds = random_feeds(model, seed=2)
    unsigned = uhop_onnx.load_bundle(folder)  # built here from the shipped C source, which is ours
    for got, want in zip(unsigned.run(None, feeds), reference(model, feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(BundleError, match="signature does not match"):
        uhop_onnx.load_bundle(folder, key=keys[1])
    for args in ([folder], [folder, "--key", keys[1]]):
        done = _cli("verify", *args)
        assert "Traceback" not in done.stderr, done.stderr
    assert uhop_onnx.verify_bundle(folder)["ok"]
    assert not marker.exists(), "the planted library's constructor ran"


def test_a_planted_c_source_is_not_built(kernels_bundle, tmp_path):
    folder = _copy(kernels_bundle, tmp_path)
    source = next(name for name in _manifest(folder)["files"] if name.endswith(".c"))
    marker = tmp_path / "source-ran"
    (folder / source).write_text((folder / source).read_text() + '\n#include <stdio.h>\n__attribute__((constructor)) '
                                 f'static void pwn(void) {{ fclose(fopen("{marker}", "w")); }}\n')
    _rehash(folder)
    with pytest.raises(uhop_onnx.ProviderError, match="C source is missing or not what this uhop-onnx generates"):
        uhop_onnx.load_bundle(folder)
    assert not marker.exists()


def test_a_delegate_path_in_an_unsigned_bundle_is_never_loaded(tmp_path, monkeypatch):
    pytest.importorskip("ai_edge_litert")
    bundle = uhop_onnx.export_bundle(mlp(), "arm64", tmp_path / "b", providers=["litert"])
    planted, marker = _planted(tmp_path, "delegate")

    def plant(manifest):
        manifest["stages"][0]["artifact"]["options"]["delegate"] = str(planted)
    _rehash(bundle, plant)
    with pytest.raises(uhop_onnx.ProviderError, match="neither a known delegate .* UHOP_ALLOWED_DELEGATES"):
        uhop_onnx.load_bundle(bundle)
    report = uhop_onnx.verify_bundle(bundle)
    assert not report["stages"][0]["ran"] and "nor a path the user allowed" in report["stages"][0]["how"]
    assert not marker.exists()
    # The user's own choice, in the call or in the environment: then it is loaded (it is no real delegate:
    # loading fails, but only after the user allowed it).
    with pytest.raises(uhop_onnx.ProviderError, match="delegate"):
        uhop_onnx.load_bundle(bundle, allowed_delegates=[planted])
    assert marker.exists()
    planted, marker = _planted(tmp_path, "other-delegate")  # a library loads once a process: plant another
    _rehash(bundle, plant)
    monkeypatch.setenv("UHOP_ALLOWED_DELEGATES", str(planted))
    with pytest.raises(uhop_onnx.ProviderError, match="delegate"):
        uhop_onnx.load_bundle(bundle)
    assert marker.exists()


def test_ep_options_naming_libraries_in_an_unsigned_bundle_are_refused(small_bundle, tmp_path):
    folder = _copy(small_bundle, tmp_path)

    def plant(manifest):
        manifest["stages"][0]["artifact"]["options"]["ep_options"] = {"trt_extra_plugin_lib_paths": "/tmp/evil.so"}
    _rehash(folder, plant)
    with pytest.raises(uhop_onnx.ProviderError, match="trt_extra_plugin_lib_paths name files on this host"):
        uhop_onnx.load_bundle(folder)


# -- the kernels cache -----------------------------------------------------------------------------------------

CACHE_DRIVER = """
import sys
from uhop_onnx.custom_ops import build, codegen, verify
from uhop_onnx.custom_ops.spec import LibrarySpec
spec = LibrarySpec("scalar", unroll=3)
path = build.build(codegen.generate(spec), spec.target)
if sys.argv[1] == "truncate":  # a truncated file whose sidecar hash was updated: build trusts it
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data[: len(data) // 3])
    build._sidecar(path).write_text(build._digest(path))
lib = verify.load(spec)
print(len(lib.path.read_bytes()))
"""


@pytest.mark.slow
def test_a_truncated_cached_library_cannot_kill_the_caller(tmp_path):
    env = {**os.environ, "UHOP_CACHE_DIR": str(tmp_path / "cache")}
    run = [sys.executable, "-c", CACHE_DRIVER]
    size = int(subprocess.run([*run, "build"], capture_output=True, text=True, env=env, timeout=SECONDS,
                              check=True).stdout)
    done = subprocess.run([*run, "truncate"], capture_output=True, text=True, env=env, timeout=SECONDS, check=False)
    assert done.returncode == 0, done.stderr  # before: SIGBUS
    assert int(done.stdout) == size, "rebuilt whole"
    assert "failed their self-test" in done.stderr


# -- archives and manifests --------------------------------------------------------------------------------------

def _tar(path: Path, members: list[tuple[str, bytes, int | None]]) -> Path:
    """A .tar.gz of (name, data, header size or None for len(data)) written by hand: headers may lie."""
    raw = io.BytesIO()
    for name, data, size in members:
        info = tarfile.TarInfo(name)
        info.size = len(data) if size is None else size
        raw.write(info.tobuf(format=tarfile.PAX_FORMAT))
        raw.write(data + b"\0" * (-len(data) % 512))
    raw.write(b"\0" * 1024)
    path.write_bytes(gzip.compress(raw.getvalue()))
    return path


@pytest.fixture(scope="module")
def small_bundle(tmp_path_factory) -> Path:
    return uhop_onnx.export_bundle(mlp(), "x86-64", tmp_path_factory.mktemp("s") / "mlp", providers=["ort-cpu"])


def _members(bundle: Path) -> list[tuple[str, bytes, int | None]]:
    names = [MANIFEST, *_manifest(bundle)["files"]]
    return [(name, (bundle / name).read_bytes(), None) for name in names]


def test_a_handwritten_archive_of_the_bundle_loads(small_bundle, tmp_path):
    archive = _tar(tmp_path / "ok.tar.gz", _members(small_bundle))
    model = mlp()
    feeds = random_feeds(model)
    np.testing.assert_allclose(uhop_onnx.load_bundle(archive).run(None, feeds)[0], reference(model, feeds)[0],
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attack", ["oversize member", "unnamed member", "manifest not first", "manifest too big",
                                    "member twice", "no manifest"])
def test_hostile_archives_are_refused_before_anything_is_written(small_bundle, tmp_path, attack, monkeypatch):
    members = _members(small_bundle)
    stage = next(k for k, (name, _, _) in enumerate(members) if name.startswith("stages/"))
    expect = {"oversize member": "is 1073741824 bytes; the manifest records", "unnamed member": "not listed",
              "manifest not first": "first member", "manifest too big": "at most", "member twice": "twice",
              "no manifest": "first member"}[attack]
    if attack == "oversize member":  # a 1 GiB header over a few bytes: refused on the header alone
        members[stage] = (members[stage][0], b"x" * 512, 1 << 30)
    elif attack == "unnamed member":
        members.insert(1, ("stages/extra.so", b"\x7fELF", None))
    elif attack == "manifest not first":
        members.append(members.pop(0))
    elif attack == "manifest too big":
        members[0] = (MANIFEST, b"{}", MANIFEST_LIMIT + 1)
    elif attack == "member twice":
        members.append(members[stage])
    else:
        members = members[1:]
    archive = _tar(tmp_path / "evil.tar.gz", members)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    with pytest.raises(BundleError, match=expect):
        uhop_onnx.load_bundle(archive)
    assert not list(scratch.iterdir()), "the unpacked folder is removed"
    assert not (tmp_path / "stages").exists()


def _break(field: str):
    def change(manifest):
        if field == "format":
            manifest["stages"][0]["artifact"]["format"] = "elf"
        elif field == "sha256":
            next(iter(manifest["files"].values()))["sha256"] = "zz"
        elif field == "inputs":
            manifest["inputs"] = "x"
        elif field == "reference":
            manifest["stages"][0]["reference"] = "../../etc/passwd"
        elif field == "stages":
            manifest["stages"] = [7]
        elif field == "tolerance":
            manifest["tolerance"]["rtol"] = "loose"
        elif field == "files":
            manifest["files"]["/etc/passwd"] = {"sha256": "0" * 64, "size": 1}
        elif field == "options":
            manifest["stages"][0]["artifact"]["options"] = {}
    return change


@pytest.mark.slow
@pytest.mark.parametrize("field, message", [
    ("format", r"stages\[0\]\.artifact\.format 'elf' is unknown"), ("sha256", r"\.sha256 must be 64"),
    ("inputs", r"manifest\.inputs must be list"), ("reference", r"stages\[0\]\.reference names '\.\./\.\./etc/passwd'"),
    ("stages", r"stages\[0\] must be an object"), ("tolerance", r"tolerance\.rtol must be int/float"),
    ("files", r"files\['/etc/passwd'\] names '/etc/passwd'"), ("options", r"artifact options are malformed"),
])
def test_malformed_manifest_fields_are_named(small_bundle, tmp_path, field, message):
    folder = _copy(small_bundle, tmp_path)
    manifest = _manifest(folder)
    _break(field)(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=message):
        uhop_onnx.load_bundle(folder)
    done = _cli("verify", folder)
    assert done.returncode in (1, 2) and "Traceback" not in done.stderr, done.stderr


def test_a_symlinked_file_is_refused(small_bundle, tmp_path):
    folder = _copy(small_bundle, tmp_path)
    name = next(name for name in _manifest(folder)["files"] if name.startswith("samples/"))
    (tmp_path / "elsewhere").mkdir()
    shutil.move(folder / name, tmp_path / "elsewhere" / "inputs.npz")
    (folder / name).symlink_to(tmp_path / "elsewhere" / "inputs.npz")
    with pytest.raises(BundleError, match="symbolic link"):
        uhop_onnx.load_bundle(folder)


LEAN = """
import sys
import uhop_onnx
bundle = uhop_onnx.load_bundle(sys.argv[1], key=sys.argv[2] if len(sys.argv) > 2 else None)
heavy = sorted({m.split('.')[0] for m in sys.modules} & {'onnx', 'onnx_ir', 'cryptography', 'pydantic', 'openvino',
                                                         'typer', 'rich'})
print(heavy)
"""


def test_the_runner_stays_lean(small_bundle, keys, tmp_path):
    """numpy and the bundle's runtimes only; cryptography too only when a key is given; never onnx or pydantic."""
    done = subprocess.run([sys.executable, "-c", LEAN, str(small_bundle)], capture_output=True, text=True,
                          timeout=SECONDS, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    signed = uhop_onnx.export_bundle(mlp(), "x86-64", tmp_path / "signed.tar.gz", providers=["ort-cpu"], sign=keys[0])
    done = subprocess.run([sys.executable, "-c", LEAN, str(signed), str(keys[1])], capture_output=True, text=True,
                          timeout=SECONDS, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['cryptography']"


def test_the_board_command_checks_the_key(keys, tmp_path):
    signed = uhop_onnx.export_bundle(mlp(), "x86-64", tmp_path / "signed.tar.gz", providers=["ort-cpu"], sign=keys[0])
    np.savez(tmp_path / "in.npz", **random_feeds(mlp()))
    board = [sys.executable, "-m", "uhop_onnx.bundle", "run", str(signed), "--inputs", str(tmp_path / "in.npz")]
    done = subprocess.run([*board, "--key", str(keys[1])], capture_output=True, text=True, timeout=SECONDS, check=False)
    assert done.returncode == 0 and "output" in done.stdout, done.stderr
    _, stranger = keygen(tmp_path / "stranger")
    done = subprocess.run([*board, "--key", str(stranger)], capture_output=True, text=True, timeout=SECONDS, check=False)
    assert done.returncode == 1 and "signature does not match" in done.stderr and "Traceback" not in done.stderr


# -- plan folders ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("p") / "plan"
    uhop_onnx.optimize(mlp(), providers=["kernels", "ort-cpu"], profile=False).save(folder)
    return folder


def _plan_copy(plan_dir: Path, tmp_path: Path, change=None) -> Path:
    folder = tmp_path / "plan"
    shutil.copytree(plan_dir, folder)
    if change is not None:
        data = json.loads((folder / "plan.json").read_text())
        change(data)
        (folder / "plan.json").write_text(json.dumps(data))
    return folder


def test_a_saved_plan_records_and_checks_each_file_hash(plan_dir):
    data = json.loads((plan_dir / "plan.json").read_text())
    assert all(len(s["sha256"]) == 64 for s in data["stages"])
    model = mlp()
    feeds = random_feeds(model)
    np.testing.assert_allclose(uhop_onnx.InferenceSession(plan_dir).run(None, feeds)[0], reference(model, feeds)[0],
                               rtol=1e-4, atol=1e-5)


def test_a_stage_replaced_by_another_model_is_refused(plan_dir, tmp_path):
    folder = _plan_copy(plan_dir, tmp_path)
    stage = json.loads((folder / "plan.json").read_text())["stages"][0]["file"]
    other = uhop_onnx.optimize(mlp(seed=5), providers=["kernels", "ort-cpu"], profile=False)
    (folder / stage).write_bytes(other.stage_model(other.stages[0]).SerializeToString())
    with pytest.raises(uhop_onnx.PlanError, match=rf"{stage}: refused: the stage file does not match its sha256"):
        uhop_onnx.InferenceSession(folder)


def test_a_stage_file_that_is_a_symlink_is_refused(plan_dir, tmp_path):
    folder = _plan_copy(plan_dir, tmp_path)
    stage = json.loads((folder / "plan.json").read_text())["stages"][0]["file"]
    shutil.move(folder / stage, tmp_path / "outside.onnx")
    (folder / stage).symlink_to(tmp_path / "outside.onnx")
    with pytest.raises(uhop_onnx.PlanError, match=rf"{stage}: refused: a symbolic link"):
        uhop_onnx.Plan.load(folder)


def test_a_delegate_path_in_a_plan_is_never_loaded(tmp_path, monkeypatch):
    pytest.importorskip("ai_edge_litert")
    planted, marker = _planted(tmp_path, "plan-delegate")
    source = tmp_path / "source"
    uhop_onnx.optimize(mlp(), providers=["litert"], profile=False).save(source)

    def plant(data):
        data["stages"][0]["options"]["delegate"] = str(planted)
    folder = _plan_copy(source, tmp_path, plant)
    with pytest.raises(uhop_onnx.PlanError, match=r"field stages\[0\]\.options: delegate .* UHOP_ALLOWED_DELEGATES"):
        uhop_onnx.InferenceSession(folder)
    np.savez(tmp_path / "in.npz", **random_feeds(mlp()))
    done = _cli("run", folder, "--inputs", tmp_path / "in.npz")
    assert done.returncode == 2 and "options: delegate" in done.stderr and "Traceback" not in done.stderr
    assert not marker.exists(), "the plan's delegate was loaded"
    assert uhop_onnx.Plan.load(folder, allowed_delegates=[planted]).stages[0].options["delegate"] == str(planted)
    monkeypatch.setenv("UHOP_ALLOWED_DELEGATES", str(planted))
    assert uhop_onnx.Plan.load(folder).stages[0].options["delegate"] == str(planted)
    assert not marker.exists()


def _set(path: str, value):
    """A change to plan.json: set the field at a dotted path (`stages.0.file`)."""
    def change(data):
        *parents, last = path.split(".")
        for part in parents:
            data = data[int(part)] if part.isdigit() else data[part]
        if value is KeyError:
            del data[int(last) if last.isdigit() else last]
        else:
            data[int(last) if last.isdigit() else last] = value
    return change


@pytest.mark.slow
@pytest.mark.parametrize("path, value, message", [
    ("stages", {}, r"field stages: Input should be a valid array"),
    ("stages", [], r"field plan: no stage, constant or input gives output\(s\) 'output'"),
    ("stages.0.file", KeyError, r"field stages\[0\]\.file: Field required"),
    ("stages.0.file", "../../outside.onnx", r"field stages\[0\]\.file: '\.\./\.\./outside\.onnx' must be a plain"),
    ("stages.0.file", "/etc/passwd", r"field stages\[0\]\.file: '/etc/passwd' must be a plain"),
    ("stages.0.sha256", "0" * 10, r"field stages\[0\]\.sha256: String should match"),
    ("stages.0.nodes", "Gemm", r"field stages\[0\]\.nodes: Input should be a valid array"),
    ("stages.0.options", {"tune": "yes"}, r"field stages\[0\]\.options: kernels option 'tune' must be bool"),
    ("stages.0.options", {"spin": True}, r"field stages\[0\]\.options: kernels has no option 'spin'"),
    ("stages.0.cost_ms", "fast", r"field stages\[0\]\.cost_ms: Input should be a valid number"),
    ("stages.0.extra", 1, r"field stages\[0\]\.extra: Extra inputs are not permitted"),
    ("inputs.0.shape", "1x64", r"field inputs\[0\]\.shape"),
    ("inputs.0", 3, r"field inputs\[0\]: Input should be an object"),
    ("model", KeyError, r"field model: Field required"),
    ("threads", 0, r"field threads: Input should be greater than or equal to 1"),
    ("profile", {"chosen": 3}, r"field profile\.chosen: Input should be a valid string"),
    ("schema", "uhop-onnx.plan/0", r"schema 'uhop-onnx.plan/0' is not"),
])
def test_malformed_plan_fields_are_named(plan_dir, tmp_path, path, value, message):
    folder = _plan_copy(plan_dir, tmp_path, _set(path, value))
    with pytest.raises(uhop_onnx.PlanError, match=message):
        uhop_onnx.Plan.load(folder)
    done = _cli("explain", folder)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "error:" in done.stderr, done.stderr


def test_plan_json_itself_may_not_be_a_symlink(plan_dir, tmp_path):
    folder = tmp_path / "plan"
    folder.mkdir()
    for child in plan_dir.iterdir():
        shutil.copyfile(child, folder / child.name)
    (folder / "plan.json").unlink()
    (folder / "plan.json").symlink_to(plan_dir / "plan.json")
    with pytest.raises(uhop_onnx.PlanError, match="symbolic link"):
        uhop_onnx.Plan.load(folder)


# -- outputs that cannot be written -----------------------------------------------------------------------------

def _small_disk():
    """In the child: files may grow to 16 KiB; a larger write fails (EFBIG) instead of killing the process."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("m") / "mlp.onnx"
    path.write_bytes(mlp().SerializeToString())
    return path


@pytest.mark.slow
@pytest.mark.parametrize("command", ["optimize", "export", "export-archive"])
def test_unwritable_outputs_exit_2_and_full_disks_exit_1_leaving_nothing(command, model_file, tmp_path):
    (tmp_path / "a-file").write_text("")
    name = "out.tar.gz" if command == "export-archive" else "out"
    args = ["optimize", model_file, "--no-profile", "-p", "ort-cpu"] if command == "optimize" else [
        "export", model_file, "-t", "x86-64", "-p", "ort-cpu"]
    unwritable = ["/sys/uhop-out" if os.geteuid() == 0 else "/proc/uhop-out", tmp_path / "a-file" / name]
    for out in unwritable:  # read-only (for root too), and under a file
        done = _cli(*args, "-o", f"{out}/{name}" if out == unwritable[0] else out)
        assert done.returncode == 2 and "cannot be written" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    before = sorted(tmp_path.iterdir())
    done = subprocess.run([*CLI, *map(str, args), "-o", str(tmp_path / name)], capture_output=True, text=True,
                          preexec_fn=_small_disk, timeout=SECONDS, env={**os.environ, "COLUMNS": "250"}, check=False)
    assert done.returncode == 1 and "writing failed midway" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert sorted(tmp_path.iterdir()) == before, "nothing half-written"
