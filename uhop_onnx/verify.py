"""`verify_bundle`: hashes first, then every stage this host can run, against ONNX Runtime on the same inputs.

Stages run in their own formats where the runtime is here; an `.rknn` stage runs in Rockchip's simulator and
an aarch64 kernels stage in a static aarch64 driver under qemu, each rebuilt from the stage's ONNX the bundle
carries; a stage nothing here can run is said so, and ONNX Runtime's result on its ONNX stands in for it so
that later stages still get checked.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .bundle import load_stage
from .bundle.manifest import BundleError, check_files, read_manifest, unpacked
from .errors import UhopError, first_line
from .files import read_npz
from .samples import reference_outputs

# Providers with a simulator on the host: the provider spec that runs a stage's ONNX there, and its name.
SIMULATORS = {
    "rknn": (lambda options: ("rknn", {**options, "simulate": True}), "the RKNN simulator"),
    "kernels": (lambda options: ("kernels", {**options, "emulate": True}), "qemu"),
}


def verify_bundle(path: str | os.PathLike) -> dict[str, Any]:
    """A report: `ok` is True only when every hash matches and every stage run here matches its reference."""
    with unpacked(path) as folder:
        manifest = read_manifest(folder)
        problems = check_files(folder, manifest)
        report: dict[str, Any] = {"bundle": str(path), "files": problems, "stages": [], "outputs": None}
        if problems:  # never load what does not match the manifest
            report["ok"] = False
            return report
        values = read_npz(folder / manifest["samples"]["inputs"])
        if manifest.get("constants"):
            values.update(read_npz(folder / manifest["constants"]))
        for k, stage in enumerate(manifest["stages"]):
            feeds = {name: values[name] for name in stage["inputs"] if name in values}
            entry, produced = _check_stage(folder, stage, feeds)
            report["stages"].append({"index": k, "provider": stage["provider"], **entry})
            values.update(produced)
        expected = read_npz(folder / manifest["samples"]["outputs"])
        tolerance = manifest["tolerance"]
        report["outputs"] = {name: _compare(values[name], want, tolerance) for name, want in expected.items()}
        report["ok"] = all(s["ok"] is not False for s in report["stages"]) and all(
            o["ok"] for o in report["outputs"].values())
        return report


def _check_stage(folder, stage: dict, feeds: dict[str, np.ndarray]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(what happened, the stage's outputs) for one stage."""
    reference = reference_outputs(folder / stage["reference"], feeds)
    runner, how = _host_runner(folder, stage)
    if runner is None:
        return {"ran": False, "how": how, "ok": None}, reference
    try:
        results = {name: np.asarray(v) for name, v in runner.run(feeds).items()}
    except Exception as error:  # noqa: BLE001 - a failing stage is a failed check, reported
        return {"ran": True, "how": how, "ok": False, "error": first_line(error)}, reference
    finally:
        runner.close()
    compared = {name: _compare(results[name], reference[name], stage["tolerance"]) for name in stage["outputs"]}
    ok = all(c["ok"] for c in compared.values())
    return {"ran": True, "how": how, "ok": ok, "outputs": compared}, results


def _host_runner(folder, stage: dict):
    """A runner for the stage on this host and how it runs, or (None, why not)."""
    try:
        return load_stage(folder, stage, threads=None, exclusive=False), f"{stage['artifact']['format']} natively"
    except (BundleError, UhopError, OSError) as native:
        if stage["provider"] not in SIMULATORS:
            return None, f"cannot run here: {first_line(native)}"
        simulate, simulator = SIMULATORS[stage["provider"]]
        import onnx

        from .providers import create

        options = dict(stage["options"])
        carried = [f for f in stage["artifact"]["files"] if f.endswith(".calibration.npz")]
        if carried:  # an int8 stage rebuilds with the calibration samples the bundle carries
            options["calibration"] = str(folder / carried[0])
        provider = create(simulate(options))
        if not provider.present:
            return None, f"cannot run here: {first_line(native)}; no simulator: {provider.availability.reason}"
        try:
            return provider.compile(onnx.load(folder / stage["reference"])), f"{simulator}, rebuilt from the stage's ONNX"
        except UhopError as error:
            return None, f"cannot run here: {first_line(native)}; {simulator} failed: {first_line(error)}"


def _compare(got: np.ndarray, want: np.ndarray, tolerance: dict[str, float]) -> dict[str, Any]:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return {"ok": False, "error": f"shape {list(got.shape)}, expected {list(want.shape)}"}
    if got.dtype.kind not in "fc":
        return {"ok": bool(np.array_equal(got, want)), "max_abs_error": None}
    error = float(np.max(np.abs(got.astype(np.float64) - want))) if got.size else 0.0
    ok = bool(np.allclose(got, want, rtol=tolerance["rtol"], atol=tolerance["atol"], equal_nan=True))
    return {"ok": ok, "max_abs_error": error}

