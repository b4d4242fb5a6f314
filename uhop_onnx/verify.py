"""`verify_bundle`: the signature (given a key) and hashes first, then every stage this host can run, against ONNX Runtime on the same inputs.

Stages run in their own formats where the runtime is here; an `.rknn` stage runs in Rockchip's simulator and
an aarch64 kernels stage in a static aarch64 driver under qemu, each rebuilt from the stage's ONNX the bundle
carries; a stage nothing here can run is said so, and ONNX Runtime's result on its ONNX stands in for it so
that later stages still get checked.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .bundle import KeySource, check_signature, load_stage
from .bundle.manifest import check_files, read_manifest, unpacked
from .bundle.signature import signed
from .compare import compare_arrays
from .errors import BundleError, UhopError, first_line
from .files import read_npz
from .samples import reference_outputs


def verify_bundle(path: str | os.PathLike, key: KeySource | None = None, allow_unrun: bool = False) -> dict[str, Any]:
    """A report: `ok` is True only when the signature (with `key`, a public key's PEM path or bytes) and every
    hash match, every stage run here matches its reference, and at least one stage ran here (unless
    `allow_unrun`). Without a key, `signature` says whether the bundle is signed: its hashes then prove only
    that no file was corrupted, not who made them."""
    with unpacked(path) as folder:
        report: dict[str, Any] = {"bundle": str(path), "signature": _signature(folder, path, key), "files": [],
                                  "stages": [], "outputs": None, "ok": False}
        if report["signature"].get("ok") is False:
            return report
        manifest = read_manifest(folder)
        report["files"] = check_files(folder, manifest)
        if report["files"]:  # never load what does not match the manifest
            return report
        values = read_npz(folder / manifest["samples"]["inputs"])
        if manifest.get("constants"):
            values.update(read_npz(folder / manifest["constants"]))
        for k, stage in enumerate(manifest["stages"]):
            feeds = {name: values[name] for name in stage["inputs"] if name in values}
            entry, produced = _check_stage(folder, stage, feeds, key is not None)
            report["stages"].append({"index": k, "provider": stage["provider"], **entry})
            values.update(produced)
        expected = read_npz(folder / manifest["samples"]["outputs"])
        tolerance = manifest["tolerance"]
        report["outputs"] = {name: compare_arrays(values[name], want, tolerance["rtol"], tolerance["atol"]) for name, want in expected.items()}
        report["unrun"] = not any(s["ran"] for s in report["stages"])
        report["ok"] = (all(s["ok"] is not False for s in report["stages"])
                        and all(o["ok"] for o in report["outputs"].values()) and (allow_unrun or not report["unrun"]))
        return report


def _signature(folder, path, key: KeySource | None) -> dict[str, Any]:
    """The signature's part of the report: checked with `key`, else only whether there is one."""
    if key is None:
        return {"ok": None, "signed": signed(folder), "checked": False}
    try:
        check_signature(folder, path, key)
    except BundleError as error:
        return {"ok": False, "signed": signed(folder), "checked": True, "error": str(error)}
    return {"ok": True, "signed": True, "checked": True}


def _check_stage(folder, stage: dict, feeds: dict[str, np.ndarray],
                 trusted: bool) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(what happened, the stage's outputs) for one stage; `trusted` as for `load_stage`."""
    reference = reference_outputs(folder / stage["reference"], feeds)
    runner, how = _host_runner(folder, stage, trusted)
    if runner is None:
        return {"ran": False, "how": how, "ok": None}, reference
    try:
        results = {name: np.asarray(v) for name, v in runner.run(feeds).items()}
    except Exception as error:  # noqa: BLE001 - a failing stage is a failed check, reported
        return {"ran": True, "how": how, "ok": False, "error": first_line(error)}, reference
    finally:
        runner.close()
    compared = {name: compare_arrays(results[name], reference[name], stage["tolerance"]["rtol"],
                                     stage["tolerance"]["atol"]) for name in stage["outputs"]}
    ok = all(c["ok"] for c in compared.values())
    return {"ran": True, "how": how, "ok": ok, "outputs": compared}, results


def _host_runner(folder, stage: dict, trusted: bool):
    """A runner for the stage on this host and how it runs, or (None, why not): its own runtime, else the
    provider's simulator (`Provider.simulator`) rebuilding it from the stage's ONNX."""
    try:
        return (load_stage(folder, stage, threads=None, exclusive=False, trusted=trusted),
                f"{stage['artifact']['format']} natively")
    except (UhopError, OSError) as native:
        why = f"cannot run here: {first_line(native)}"
    import onnx

    from .providers import create

    options = dict(stage["options"])
    carried = [f for f in stage["artifact"]["files"] if f.endswith(".calibration.npz")]
    if carried:  # an int8 stage rebuilds with the calibration samples the bundle carries
        options["calibration"] = str(folder / carried[0])
    try:
        simulator = create((stage["provider"], options)).simulator()
    except UhopError as error:
        return None, f"{why}; its options do not make a provider here: {first_line(error)}"
    if simulator is None:
        return None, why
    if not simulator.present:
        return None, f"{why}; no simulator: {simulator.availability.reason}"
    name = simulator.simulator_name
    try:
        return simulator.compile(onnx.load(folder / stage["reference"])), f"{name}, rebuilt from the stage's ONNX"
    except UhopError as error:
        return None, f"{why}; {name} failed: {first_line(error)}"
