"""`verify_bundle`: the signature (given a key) and hashes first, then every stage this host can run, against ONNX Runtime on the same inputs.

Each stage and the outputs are held to the manifest's tolerances: `{"rtol", "atol"}` element by element, or a
reduced-precision stage's `{"scaled": t}`, the precision gate's rule: the one accuracy rule of
`precision.accuracy.compare`.

Stages run in their own formats where the runtime is here; an `.rknn` stage runs in Rockchip's simulator and
an aarch64 kernels stage in a static aarch64 driver under qemu, each rebuilt from the stage's ONNX the bundle
carries; a stage nothing here can run is said so. The bundle runs through the runtime's `Executor`, each
stage's runner wrapped (`Checked`) so that its outputs are compared with ONNX Runtime's on the stage's ONNX;
where the stage cannot run here, fails or does not match, that reference stands in for its outputs, so
that later stages still get checked on the right inputs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from ..bundle import KeySource, check_signature, load_stage
from ..bundle.manifest import check_files, read_manifest, unpacked
from ..bundle.signature import signed
from ..foundation.dtypes import TensorSig
from ..foundation.errors import BundleError, UhopError, first_line
from ..runtime.executor import Executor
from ..foundation.files import read_npz
from ..runtime.plan import Stage
from ..precision.accuracy import compare
from ..providers import Runner
from ..foundation.samples import reference_outputs


def verify_bundle(path: str | os.PathLike, key: KeySource | None = None, allow_unrun: bool = False) -> dict[str, Any]:
    """A report: `ok` is True only when the signature (with `key`, a public key's PEM path or bytes) and every
    hash match, every stage run here matches its reference, and at least one stage ran here (unless
    `allow_unrun`). Without a key, `signature` says whether the bundle is signed: its hashes then prove only
    that no file was corrupted, not who made them."""
    report: dict[str, Any] = {"bundle": str(path), "signature": None, "files": [], "stages": [], "outputs": None,
                              "ok": False}

    def signature_first(folder: Path) -> None:  # in an archive, before any member but the manifest is written
        report["signature"] = _signature(folder, path, key)
        if report["signature"].get("ok") is False:
            raise BundleError(report["signature"]["error"])

    try:
        with unpacked(path, signature_first) as folder:
            if report["signature"] is None:  # a folder: nothing was unpacked
                signature_first(folder)
            return _verified(folder, report, key is not None, allow_unrun)
    except BundleError:
        if report["signature"] is not None and report["signature"].get("ok") is False:
            return report
        raise


def _verified(folder: Path, report: dict[str, Any], trusted: bool, allow_unrun: bool) -> dict[str, Any]:
    """`verify_bundle`'s report on the bundle in `folder`, once its signature passed (`trusted` when a key
    checked it)."""
    manifest = read_manifest(folder)
    report["files"] = check_files(folder, manifest)
    if report["files"]:  # never load what does not match the manifest
        return report
    constants = read_npz(folder / manifest["constants"], BundleError) if manifest.get("constants") else {}
    with ExitStack() as compiled:  # every stage's runner is closed once the samples ran
        checked = [compiled.enter_context(Checked(folder, stage, trusted)) for stage in manifest["stages"]]
        executor = Executor([Stage.from_json(s) for s in manifest["stages"]], checked,
                            [TensorSig(**t) for t in manifest["inputs"]], [t["name"] for t in manifest["outputs"]],
                            constants)
        feeds = read_npz(folder / manifest["samples"]["inputs"], BundleError)
        got = dict(zip(executor.outputs, executor.run(None, feeds)))
    report["stages"] = [{"index": k, "provider": stage["provider"], "precision": stage.get("precision", "fp32"),
                         "tolerance": stage["tolerance"], **c.entry}
                        for k, (stage, c) in enumerate(zip(manifest["stages"], checked))]
    expected = read_npz(folder / manifest["samples"]["outputs"], BundleError)
    report["outputs"] = {name: compare(got[name], want, manifest["tolerance"])
                         for name, want in expected.items()}
    report["unrun"] = bool(report["stages"]) and not any(s["ran"] for s in report["stages"])
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


class Checked(Runner):
    """A bundle stage run here if it can be (`_host_runner`), beside its reference (ONNX Runtime on the
    stage's ONNX): its outputs when they match the reference, else the reference's. What happened is in
    `entry` (`ran`, `how`, `ok`, and the per-output comparison or the error); `trusted` as for
    `load_stage`."""

    def __init__(self, folder: Path, stage: dict[str, Any], trusted: bool):
        self.reference, self.tolerance, self.outputs = folder / stage["reference"], stage["tolerance"], stage["outputs"]
        self.runner, self.how = _host_runner(folder, stage, trusted)
        self.entry: dict[str, Any] = {"ran": False, "how": self.how, "ok": None}

    def run(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        reference = reference_outputs(self.reference, dict(feeds))
        if self.runner is None:
            return reference
        try:
            results = {name: self.runner.to_host(v) for name, v in self.runner.run(feeds).items()}
        except Exception as error:  # noqa: BLE001 - a failing stage is a failed check, reported
            self.entry = {"ran": True, "how": self.how, "ok": False, "error": first_line(error)}
            return reference
        compared = {name: compare(results[name], reference[name], self.tolerance) if name in results else
                    {"ok": False, "error": "missing from the stage's results"} for name in self.outputs}
        ok = all(c["ok"] for c in compared.values())
        self.entry = {"ran": True, "how": self.how, "ok": ok, "outputs": compared}
        return results if ok else reference

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


def _host_runner(folder, stage: dict, trusted: bool):
    """A runner for the stage on this host and how it runs, or (None, why not): its own runtime, else the
    provider's simulator (`Provider.simulator`) rebuilding it from the stage's ONNX."""
    try:
        return (load_stage(folder, stage, threads=None, exclusive=False, trusted=trusted),
                f"{stage['artifact']['format']} natively")
    except (UhopError, OSError) as native:
        why = f"cannot run here: {first_line(native)}"
    import onnx

    from ..providers import create

    options = dict(stage["options"])
    carried = [f for f in stage["artifact"]["files"] if f.endswith(".calibration.npz")]
    if carried:  # an int8 stage rebuilds with the calibration samples the bundle carries
        options["calibration"] = str(folder / carried[0])
    try:
        simulator = create((stage["provider"], options)).at_precision(stage.get("precision", "fp32")).simulator()
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
