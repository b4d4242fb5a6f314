"""Bundles: export for every target, run with only the runtimes they name, verify, and refuse tampering."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import venv
from pathlib import Path

import numpy as np
import pytest

import uhop_onnx
from uhop_onnx.bundle.manifest import BundleError
from uhop_onnx.foundation.errors import ProviderError
from uhop_onnx.models import cnn, mlp, resnet
from uhop_onnx.providers import REGISTRY, create
from uhop_onnx.providers.kernels import KernelsProvider, host_arch
from uhop_onnx.providers.rknn import Rknn
from uhop_onnx.products.targets import builtin_targets

from .conftest import assert_matches, random_feeds, reference

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def x86_bundle(tmp_path_factory) -> Path:
    return uhop_onnx.export_bundle(resnet(), "x86-64", tmp_path_factory.mktemp("b") / "resnet.tar.gz")


@pytest.mark.parametrize("target", sorted(builtin_targets()))
def test_export_for_every_target_then_verify(target, tmp_path):
    try:
        bundle = uhop_onnx.export_bundle(cnn(), target, tmp_path / "bundle")
    except ProviderError as error:
        assert target == "rk3588" and "uhop-onnx setup rknn" in str(error) or "cannot write" in str(error)
        pytest.skip(f"{target}: {error}")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["target"]["name"] == target
    assert {s["provider"] for s in manifest["stages"]} <= {p["id"] for p in manifest["target"]["providers"]}
    report = uhop_onnx.verify_bundle(bundle)
    assert report["ok"], report
    assert all(s["ok"] or not s["ran"] for s in report["stages"])


def test_bundle_runs_like_onnxruntime(x86_bundle):
    model = resnet()
    feeds = random_feeds(model, seed=3)
    bundle = uhop_onnx.load_bundle(x86_bundle)
    assert [i.name for i in bundle.get_inputs()] == ["input"]
    assert_matches(bundle.run(None, feeds), reference(model, feeds))


def test_openvino_ir_stages(tmp_path):
    model = mlp()
    bundle = uhop_onnx.export_bundle(model, "x86-64", tmp_path / "b", providers=["openvino"])
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert [s["artifact"]["format"] for s in manifest["stages"]] == ["openvino-ir"]
    feeds = random_feeds(model)
    assert_matches(uhop_onnx.load_bundle(bundle).run(None, feeds), reference(model, feeds))


@pytest.mark.parametrize("ident", ["ort-cpu", "openvino"])
def test_a_provider_loads_the_stage_it_exported(ident, tmp_path):
    """`load_artifact` runs what the same provider's `export` wrote, as ONNX Runtime runs the model."""
    model = mlp()
    feeds = random_feeds(model, seed=4)
    provider = create(ident)
    artifact = provider.export(model, tmp_path, "stage").to_json()
    assert artifact["format"] == type(provider).artifact_format
    runner = type(provider).load_artifact(tmp_path, artifact, threads=1)
    try:
        got = runner.run(feeds)
    finally:
        runner.close()
    assert_matches([got[o.name] for o in model.graph.output], reference(model, feeds))


@pytest.mark.parametrize("ident, artifact, error", [
    ("ort-cpu", {"files": ["stages/s.onnx"], "options": {}}, "KeyError: 'ep'"),
    ("openvino", {"files": [], "options": {"device": "CPU"}}, "IndexError"),
    ("litert", {"files": [], "options": {}}, "IndexError"),
    ("rknn", {"files": ["stages/s.rknn"], "options": {"inputs": ["x"]}}, "KeyError: 'outputs'"),
    ("kernels", {"files": ["stages/s.json"], "options": {}}, "KeyError: 'target'"),
])
def test_a_malformed_artifact_is_a_bundle_error_naming_it(ident, artifact, error, tmp_path):
    fmt = REGISTRY[ident].artifact_format
    files = ", ".join(artifact["files"]) or "no files"
    with pytest.raises(BundleError, match=rf"^{ident} stage \({files}\): its {fmt} artifact options are malformed "
                                          rf"\({error}"):
        REGISTRY[ident].load_artifact(tmp_path, {"format": fmt, **artifact})


def test_a_stage_of_another_provider_s_format_is_refused(x86_bundle, tmp_path):
    folder = _unpack(x86_bundle, tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["stages"][0]["artifact"]["format"] = "rknn" if manifest["stages"][0]["provider"] != "rknn" else "onnx"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=r"stages\[0\]\.artifact\.format '\w+' is unknown for [\w-]+, whose stages"):
        uhop_onnx.load_bundle(folder)
    manifest["stages"][0]["provider"] = "tpu"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=r"stages\[0\]\.provider 'tpu' is unknown; known: ort-tensorrt, "):
        uhop_onnx.load_bundle(folder)


def test_simulators_are_the_providers_own():
    """RKNN's stages run in Rockchip's simulator; an aarch64 board's kernels under qemu; the rest have none."""
    rknn = Rknn({"target": "rk3576"}, threads=2).at_precision("int8")
    simulator = rknn.simulator()
    assert isinstance(simulator, Rknn) and simulator.simulate and simulator.threads == 2
    assert simulator.options == {"target": "rk3576", "simulate": True} and simulator.precision == "int8"
    assert simulator.simulator() is None and simulator.simulator_name == "the RKNN simulator"
    if host_arch() != "aarch64":
        emulated = KernelsProvider({"arch": "aarch64"}).simulator()
        assert emulated.options == {"arch": "aarch64", "emulate": True} and emulated.simulator_name == "qemu"
    assert KernelsProvider({"arch": host_arch()}).simulator() is None
    assert all(REGISTRY[ident]().simulator() is None for ident in ("ort-cpu", "openvino", "litert"))


def test_gpu_stages_are_said_not_to_run_here(tmp_path):
    bundle = uhop_onnx.export_bundle(mlp(), "jetson-orin", tmp_path / "b", providers=["ort-cuda", "ort-cpu"],
                                     assign={"/fc1/MatMul": "ort-cuda"})
    report = uhop_onnx.verify_bundle(bundle, allow_unrun=True)
    gpu = [s for s in report["stages"] if s["provider"] in ("ort-tensorrt", "ort-cuda")]
    assert gpu and all(not s["ran"] and "onnxruntime" in s["how"] for s in gpu)
    assert report["ok"], "stages that cannot run here are reported, not failed"
    assert report["unrun"] and not uhop_onnx.verify_bundle(bundle)["ok"], "nothing ran: only --allow-unrun accepts it"


@pytest.mark.slow
def test_tune_places_the_bundle_again_by_measurement(x86_bundle, tmp_path):
    tuned = uhop_onnx.tune_bundle(x86_bundle, tmp_path / "tuned", budget=300)
    manifest = json.loads((tuned / "manifest.json").read_text())
    assert manifest["placement"] == "measured on this host for target x86-64"
    profile = manifest["profile"]
    chosen = profile["candidates"][profile["chosen"]]["ms"]
    singles = [c["ms"] for name, c in profile["candidates"].items() if name.endswith(" first")]
    assert chosen <= min(singles), "by its own figures, the tuned plan is never slower than one provider alone"
    assert uhop_onnx.verify_bundle(tuned)["ok"]
    model = resnet()
    feeds = random_feeds(model, seed=4)
    assert_matches(uhop_onnx.load_bundle(tuned).run(None, feeds), reference(model, feeds))


def test_tune_leaves_out_providers_absent_here(tmp_path):
    bundle = uhop_onnx.export_bundle(mlp(), "jetson-orin", tmp_path / "b", providers=["ort-cuda", "ort-cpu"],
                                     assign={"/fc1/MatMul": "ort-cuda"})
    tuned = uhop_onnx.tune_bundle(bundle, tmp_path / "tuned", budget=2)
    manifest = json.loads((tuned / "manifest.json").read_text())
    assert {s["provider"] for s in manifest["stages"]} == {"ort-cpu"}
    assert manifest["target"]["name"] == "jetson-orin"


def test_tune_stops_when_a_required_provider_is_absent_here(tmp_path):
    profile = tmp_path / "gpu-board.json"
    profile.write_text(json.dumps({"name": "gpu-board", "arch": "x86_64", "providers": [
        {"id": "ort-cuda", "required": True, "gflops": 2000}, {"id": "ort-cpu", "gflops": 50}]}))
    bundle = uhop_onnx.export_bundle(mlp(), str(profile), tmp_path / "b")
    with pytest.raises(ProviderError, match="needs ort-cuda, which this host cannot run and build stages for"):
        uhop_onnx.tune_bundle(bundle, tmp_path / "tuned")
    assert not (tmp_path / "tuned").exists()


def _unpack(archive: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "unpacked"
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    return folder


def test_tune_refuses_a_tampered_bundle(x86_bundle, tmp_path):
    folder = _unpack(x86_bundle, tmp_path)
    reference_model = next((folder / "reference").iterdir())
    reference_model.write_bytes(reference_model.read_bytes()[:-1])
    with pytest.raises(BundleError, match=reference_model.name):
        uhop_onnx.tune_bundle(folder, tmp_path / "tuned")
    assert not (tmp_path / "tuned").exists()


def test_a_flipped_byte_fails_verify_and_load(x86_bundle, tmp_path):
    folder = _unpack(x86_bundle, tmp_path)
    stage = next((folder / "stages").iterdir())
    data = bytearray(stage.read_bytes())
    data[len(data) // 2] ^= 0x01
    stage.write_bytes(bytes(data))
    report = uhop_onnx.verify_bundle(folder)
    assert not report["ok"] and any(stage.name in p for p in report["files"])
    with pytest.raises(BundleError, match=stage.name):
        uhop_onnx.load_bundle(folder)
    result = subprocess.run([sys.executable, "-m", "uhop_onnx.cli", "verify", str(folder)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 1 and "tampered" in result.stdout


def _archive(path: Path, members: list[tarfile.TarInfo], payload: bytes = b"x") -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for member in members:
            tar.addfile(member, io.BytesIO(payload) if member.isfile() else None)
    return path


@pytest.mark.parametrize("member", ["../escape.txt", "/etc/evil", "stages/../../escape.txt", "link"])
def test_malicious_archives_are_refused(tmp_path, member):
    info = tarfile.TarInfo(member)
    if member == "link":
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
    else:
        info.size = 1
    archive = _archive(tmp_path / "evil.tar.gz", [info])
    with pytest.raises(BundleError, match="refused"):
        uhop_onnx.load_bundle(archive)
    assert not (tmp_path / "escape.txt").exists() and not (tmp_path.parent / "escape.txt").exists()


def test_truncated_archive_is_refused(x86_bundle, tmp_path):
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(x86_bundle.read_bytes()[: x86_bundle.stat().st_size // 2])
    with pytest.raises(BundleError):
        uhop_onnx.load_bundle(cut)


def test_export_refuses_an_existing_output(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("keep")
    with pytest.raises(uhop_onnx.UhopError, match="exists"):
        uhop_onnx.export_bundle(mlp(), "x86-64", tmp_path / "taken")
    assert (tmp_path / "taken" / "file").read_text() == "keep"


@pytest.mark.slow
def test_runner_needs_only_numpy_and_the_named_runtime(x86_bundle, tmp_path):
    """Our wheel installed with --no-deps beside numpy and onnxruntime alone runs the bundle, and a bundle of
    int8 stages (QDQ `.onnx`) within the tolerance it was gated with."""
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels),
                    str(ROOT)], check=True, timeout=600)
    env = tmp_path / "board"
    venv.EnvBuilder(with_pip=True).create(env)
    python = env / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "numpy", "onnxruntime"], check=True, timeout=600)
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", next(wheels.glob("*.whl"))], check=True,
                   timeout=600)
    model = resnet()
    feeds = random_feeds(model, seed=5)
    np.savez(tmp_path / "in.npz", **feeds)
    result = subprocess.run([python, "-m", "uhop_onnx.bundle", "run", str(x86_bundle), "--inputs",
                             str(tmp_path / "in.npz"), "--output", str(tmp_path / "out.npz")],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    missing = subprocess.run([python, "-c", "import onnx"], capture_output=True, timeout=60)
    assert missing.returncode != 0, "the board environment must not have onnx"
    with np.load(tmp_path / "out.npz") as got:
        assert_matches([got["output"]], reference(model, feeds))

    small = cnn()
    calibration = {"input": np.random.default_rng(1).standard_normal((8, 3, 32, 32)).astype(np.float32)}
    int8 = uhop_onnx.export_bundle(small, "x86-64-v4", tmp_path / "int8", providers=["ort-cpu"], precision="int8",
                                   tolerance=5e-2, calibration=calibration)
    assert [s["precision"] for s in json.loads((int8 / "manifest.json").read_text())["stages"]] == ["int8"]
    feeds = random_feeds(small, seed=6)
    np.savez(tmp_path / "in8.npz", **feeds)
    result = subprocess.run([python, "-m", "uhop_onnx.bundle", "run", str(int8), "--inputs", str(tmp_path / "in8.npz"),
                             "--output", str(tmp_path / "out8.npz")], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    with np.load(tmp_path / "out8.npz") as got:
        want = reference(small, feeds)[0]
        assert 0 < np.abs(got["output"] - want).max() <= 5e-2 * (1 + np.abs(want).max())
