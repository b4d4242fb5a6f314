"""Kernels stages in bundles: steps as JSON, constants as .npz, the library for the board's architecture."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from uhop_onnx.custom_ops import cross
from uhop_onnx.models import cnn
from uhop_onnx.providers.kernels import KernelsProvider, KernelsRunner, host_arch

import uhop_onnx
from uhop_onnx.foundation.errors import ProviderError

from .conftest import random_feeds, reference

# The static cost model favours ort-cpu on x86-64, so the convolutions, their Relus and the head are pinned.
ON_KERNELS = {f"/block{i}/{op}": "kernels" for i in range(3) for op in ("conv/Conv", "relu/Relu")} | {
    "/head/fc/Gemm": "kernels"}

NO_ONNX = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("onnx", "onnxruntime", "onnx_ir"):
            raise ImportError(f"{name} is blocked: a board has no onnx")
sys.meta_path.insert(0, Refuse())
from pathlib import Path
import json, numpy as np
from uhop_onnx.bundle import load_stage
folder = Path(sys.argv[1])
stage = next(s for s in json.loads((folder / "manifest.json").read_text())["stages"] if s["provider"] == "kernels")
with np.load(sys.argv[2]) as feeds:
    out = load_stage(folder, stage, 1, True).run({name: feeds[name] for name in feeds.files})
np.savez(sys.argv[3], **out)
print(sorted(m for m in sys.modules if m.split(".")[0] in ("onnx", "onnxruntime", "onnx_ir")))
"""


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    if host_arch() != "x86_64":
        pytest.skip(f"the x86-64 target is built with this host's compiler; this host is {host_arch()}")
    return uhop_onnx.export_bundle(cnn(), "x86-64", tmp_path_factory.mktemp("k") / "cnn",
                                   providers=["kernels", "ort-cpu"], assign=ON_KERNELS)


def _kernels_stages(bundle: Path) -> list[dict]:
    stages = json.loads((bundle / "manifest.json").read_text())["stages"]
    return [s for s in stages if s["provider"] == "kernels"]


def test_stages_are_plain_data_and_a_library(bundle):
    stages = _kernels_stages(bundle)
    files = [{Path(f).suffix: bundle / f for f in s["artifact"]["files"]} for s in stages]
    programs = [json.loads(f[".json"].read_text()) for f in files]
    steps = [[(s["op"], s["lo"], s["hi"]) for s in p["steps"]] for p in programs]
    assert steps == [[("Conv", 0.0, None)]] * 3 + [[("Gemm", None, None)]], "each Relu is fused into its Conv"
    assert [p["outputs"] for p in programs] == [s["outputs"] for s in stages]
    assert all(s["artifact"]["options"]["target"] == "x86-64-avx2" for s in stages)
    for f, program in zip(files, programs, strict=True):
        with np.load(f[".npz"]) as stored:
            assert len(stored.files) == len(program["constants"]) == 2  # weight and bias
    assert len({f[".so"] for f in files}) == 1, "one library shared by every stage"
    assert files[0][".so"].read_bytes()[18] == 62  # ELF e_machine EM_X86_64


def test_loaded_bundle_matches_onnxruntime(bundle):
    model = cnn()
    feeds = random_feeds(model, seed=7)
    got = uhop_onnx.load_bundle(bundle).run(None, feeds)
    for g, want in zip(got, reference(model, feeds), strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5)


def test_verify_runs_the_kernels_stages(bundle):
    report = uhop_onnx.verify_bundle(bundle)
    assert report["ok"], report
    kernels = [s for s in report["stages"] if s["provider"] == "kernels"]
    assert kernels and all(s["ran"] and s["ok"] and s["how"] == "kernels natively" for s in kernels)


def _stage_reference(bundle: Path, stage: dict, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    model = onnx.load(bundle / stage["reference"])
    return dict(zip([o.name for o in model.graph.output], reference(model, feeds), strict=True))


def _feeds_of(bundle: Path, stage: dict) -> dict[str, np.ndarray]:
    """The inputs `stage` gets on the cnn's sample, computed by ONNX Runtime on the stages before it."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    values = dict(random_feeds(cnn(), seed=1))
    if manifest["constants"]:
        with np.load(bundle / manifest["constants"]) as stored:
            values.update({name: stored[name] for name in stored.files})
    for earlier in manifest["stages"]:
        feeds = {name: values[name] for name in earlier["inputs"] if name in values}
        if earlier == stage:
            return feeds
        values.update(_stage_reference(bundle, earlier, feeds))
    raise AssertionError("stage not in its bundle")


def test_stage_loads_and_runs_without_onnx(bundle, tmp_path):
    stage = _kernels_stages(bundle)[0]
    feeds = _feeds_of(bundle, stage)
    np.savez(tmp_path / "in.npz", **feeds)
    done = subprocess.run([sys.executable, "-c", NO_ONNX, str(bundle), str(tmp_path / "in.npz"),
                           str(tmp_path / "out.npz")], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    want = _stage_reference(bundle, stage, feeds)
    with np.load(tmp_path / "out.npz") as got:
        assert sorted(got.files) == sorted(stage["outputs"])
        for name in got.files:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5)


def test_aarch64_needs_the_cross_compiler(monkeypatch):
    provider = KernelsProvider({"arch": "aarch64"})
    monkeypatch.setenv("PATH", "/nonexistent")
    blocker = provider.export_blocker()
    assert "aarch64-linux-gnu-gcc" in blocker and "apt-get install -y gcc-aarch64-linux-gnu" in blocker
    with pytest.raises(ProviderError, match="aarch64-linux-gnu-gcc"):
        provider.export(cnn(), Path("/nonexistent"), "stage")


def test_unknown_arch_is_named():
    assert "valid: x86_64, aarch64" in KernelsProvider({"arch": "mips"}).export_blocker()


def test_only_aarch64_is_emulated():
    with pytest.raises(ProviderError, match="emulate runs aarch64 kernels under qemu; arch is 'x86_64'"):
        KernelsProvider({"arch": "x86_64", "emulate": True}).compile(cnn())


@pytest.mark.skipif(bool(cross.missing_tools()), reason=f"no aarch64 cross compiler or qemu; install: {cross.INSTALL}")
def test_aarch64_bundle_ships_an_arm_library_and_verifies_under_qemu(tmp_path):
    profile = tmp_path / "arm.json"
    profile.write_text(json.dumps({"name": "arm-kernels", "arch": "aarch64", "providers": [
        {"id": "kernels", "options": {"arch": "aarch64"}, "gflops": 20, "gbps": 8, "stage_ms": 0.02},
        {"id": "ort-cpu", "options": {}, "gflops": 25, "gbps": 8, "stage_ms": 0.05}]}))
    bundle = uhop_onnx.export_bundle(cnn(), str(profile), tmp_path / "b", assign=ON_KERNELS)
    stages = _kernels_stages(bundle)
    assert stages and all(s["artifact"]["options"]["target"] == "aarch64-neon" for s in stages)
    so = bundle / next(f for f in stages[0]["artifact"]["files"] if f.endswith(".so"))
    assert so.read_bytes()[18] == 183  # e_machine EM_AARCH64
    with pytest.raises(ProviderError, match="built for aarch64-neon"):
        uhop_onnx.load_bundle(bundle)
    report = uhop_onnx.verify_bundle(bundle)
    kernels = [s for s in report["stages"] if s["provider"] == "kernels"]
    assert kernels and all(s["ran"] and s["ok"] and s["how"].startswith("qemu") for s in kernels), kernels
    assert report["ok"], report


def _lone_sum_model() -> onnx.ModelProto:
    """Relu(a + b) on its own, then a dilated, strided depthwise Conv with a bias Add and a Relu6."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(4)
    nodes = [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Relu", ["s"], ["r"]),
             helper.make_node("Conv", ["r", "w"], ["c"], group=4, strides=[2, 2], dilations=[2, 1], pads=[2, 1, 2, 1]),
             helper.make_node("Add", ["c", "bias"], ["d"]), helper.make_node("Clip", ["d", "lo", "hi"], ["y"])]
    constants = {"w": rng.standard_normal((4, 1, 3, 3)), "bias": rng.standard_normal((4, 1, 1)),
                 "lo": np.array(0.0), "hi": np.array(6.0)}
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, (1, 4, 9, 11)) for n in ("a", "b")]
    graph = helper.make_graph(nodes, "lone", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v.astype(np.float32), n) for n, v in constants.items()])
    return onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))


@pytest.mark.skipif(bool(cross.missing_tools()), reason=f"no aarch64 cross compiler or qemu; install: {cross.INSTALL}")
@pytest.mark.parametrize("name", ["resnet", "mobilenet", "lone sum"])
def test_every_lowered_op_runs_under_qemu(name):
    """With `emulate`, each kernels stage runs the aarch64 build under qemu: convolutions with fused residual
    sums, depthwise, strided and dilated ones, Gemm and a lone Add+Relu; the whole model matches ONNX Runtime."""
    from uhop_onnx.models import BUILDERS

    model = _lone_sum_model() if name == "lone sum" else BUILDERS[name]()
    session = uhop_onnx.InferenceSession(model, providers=[("kernels", {"arch": "aarch64", "emulate": True}),
                                                           "ort-cpu"], profile=False, threads=1)
    runners = [r for r in session._executor.runners if isinstance(r, KernelsRunner)]
    assert runners and all(isinstance(r.lib, cross.Emulated) for r in runners)
    if name == "lone sum":
        assert [(s.kind, s.residual, s.epilogue.lo) for s in runners[0].steps] == [("Add", "b", 0.0), ("Conv", None, 0.0)]
    feeds = random_feeds(model, seed=3)
    for got, want in zip(session.run(None, feeds), reference(model, feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
