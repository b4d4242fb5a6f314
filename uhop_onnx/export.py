"""`export_bundle`: a model placed for a target board, each stage in its runtime's own format, with a manifest;
`tune_bundle`: a bundle placed again by measurement on the board itself.

Without the board, placement uses the target profile's providers (their tables; the runtime's query too
where the runtime is on this host) and its static cost model, by the same blocks and dynamic programme
as the measured placement. On the board, `tune_bundle` rebuilds the model from the bundle's stages and
places it by the measured search over the profile's providers present there.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from .bundle.manifest import (
    FP32_TOLERANCE,
    MANIFEST,
    SCHEMA,
    SIGNATURE,
    hash_files,
    read_checked,
    unpacked,
)
from .bundle import signature
from .dtypes import TensorSig
from .errors import InputError, ProviderError, UhopError
from .files import check_writable, new_folder, read_npz, write_archive, writing
from .graph import Graph, declared_outputs
from .inputs import Inputs, Shapes, at_shapes, free_inputs, read_inputs
from .optimizer import analyze, build_plan, place_measured
from .precision import check_choice
from .partitioner.placer import Analysis
from .partitioner.static import StaticCost
from .providers import Provider, create
from .samples import reference_outputs
from .simplify import simplify
from .targets import Target, TargetProvider, load_target, target_from_json


def export_bundle(model: str | os.PathLike | onnx.ModelProto, target: str | Target, out: str | os.PathLike,
                  providers: Sequence[str] | None = None, assign: Mapping[str, str] | None = None,
                  threads: int | None = None, progress: Callable[[str], None] = lambda step: None, *,
                  shapes: Shapes | None = None, inputs: Inputs | None = None, measure: bool = False,
                  budget: float = 60.0, sign: str | os.PathLike | bytes | None = None, precision: str = "fp32",
                  tolerance: float | None = None, calibration: Any = None) -> Path:
    """Write a bundle for `target` (a built-in profile name, a JSON profile path, or a `Target`) to `out`: a
    folder (absent or empty) or a file ending `.tar.gz`. Returns `out`. With `sign` (an Ed25519 private key,
    PEM path or bytes, as `uhop-onnx keygen` writes), the manifest is signed.

    With `measure`, this host is the board: placement is measured here (as `optimize` does) over the
    profile's providers present here, instead of the profile's static cost model. The bundle's sample
    inputs (and any measurement) are at `shapes` or the given `inputs`, as `optimize` takes them. Bundles
    are fp32: another `precision` is refused (`InputError`) until bundles carry reduced-precision stages."""
    check_choice(precision, tolerance)
    if precision != "fp32":
        raise InputError(f"precision={precision!r}: bundles hold fp32 stages only for now; export with "
                         "precision='fp32' (reduced-precision plans run through optimize and InferenceSession)")
    out = Path(out)
    archive = out.name.endswith(".tar.gz")
    if out.exists() and (archive or out.is_file() or any(out.iterdir())):
        raise UhopError(f"{out}: exists; give a new folder or .tar.gz path")
    check_writable(out)
    signer = None if sign is None else signature.signer(sign)
    profile = target if isinstance(target, Target) else load_target(target)
    entries, chosen = _providers(profile, providers, threads, present=measure)
    a = analyze(model, assign=assign, threads=threads, progress=progress, chosen=chosen, shapes=shapes, inputs=inputs,
                sample=True)
    if measure:
        plan = place_measured(a, threads, budget=budget, progress=progress)
        plan.placement = f"measured on this host for target {profile.name}"
    else:
        progress("placing for the target with its static cost model")
        placer = StaticCost({p.label: e for p, e in zip(a.providers, entries)})
        plan = build_plan(a, placer.place(a).choice, threads)
        plan.placement = f"static cost model of target {profile.name}"
    with writing(out), (tempfile.TemporaryDirectory() if archive else new_folder(out)) as staging:
        staging = Path(staging)
        manifest = _write(staging, a, plan, profile, entries, progress)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if signer is not None:
            signer(staging)
        if archive:
            write_archive(staging, out, first=(MANIFEST, SIGNATURE))
    return out


def tune_bundle(bundle: str | os.PathLike, out: str | os.PathLike, threads: int | None = None,
                budget: float = 60.0, progress: Callable[[str], None] = lambda step: None, *,
                shapes: Shapes | None = None, inputs: Inputs | None = None) -> Path:
    """Place the model of `bundle` again by measurement on this host (the board), and write the new bundle
    to `out` for the same target profile; measured on the bundle's own sample inputs unless `shapes` or
    `inputs` are given."""
    with unpacked(bundle) as folder:
        manifest = read_checked(folder, bundle)
        model = _bundled_model(folder, manifest)
        if shapes is None and inputs is None:
            inputs = read_inputs(folder / manifest["samples"]["inputs"])
    profile = target_from_json(manifest["target"], f"{bundle}: target")
    return export_bundle(model, profile, out, threads=threads, progress=progress, shapes=shapes, inputs=inputs,
                         measure=True, budget=budget)


def _bundled_model(folder: Path, manifest: Mapping[str, Any]) -> onnx.ModelProto:
    """The whole model again, from the bundle's reference stage models (and its folded constant outputs)."""
    stages = [onnx.load(folder / s["reference"]) for s in manifest["stages"]]
    graph = onnx.helper.make_graph(
        [node for m in stages for node in m.graph.node], manifest["model"]["name"],
        [_value_info(TensorSig(**t)) for t in manifest["inputs"]],
        [_value_info(TensorSig(**t)) for t in manifest["outputs"]],
        list({i.name: i for m in stages for i in m.graph.initializer}.values()))
    if manifest.get("constants"):
        graph.initializer.extend(onnx.numpy_helper.from_array(value, name)
                                 for name, value in read_npz(folder / manifest["constants"]).items())
    opsets = {o.domain: o.version for m in stages for o in m.opset_import}
    functions = list({(f.domain, f.name): f for m in stages for f in m.functions}.values())
    ir_version = max((m.ir_version for m in stages), default=onnx.IR_VERSION)
    return onnx.helper.make_model(graph, ir_version=ir_version, functions=functions,
                                  opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()])


def _value_info(sig: TensorSig) -> onnx.ValueInfoProto:
    elem_type = onnx.helper.np_dtype_to_tensor_dtype(sig.dtype)
    return onnx.helper.make_tensor_value_info(sig.name, elem_type, sig.shape)


def _providers(profile: Target, only: Sequence[str] | None, threads: int | None,
               present: bool = False) -> tuple[list[TargetProvider], list[Provider]]:
    """The target's providers this host can write stages for (and, with `present`, run here); a required one
    that it cannot is an error."""
    entries = [e for e in profile.providers if only is None or e.id in only]
    unknown = set(only or ()) - {e.id for e in profile.providers}
    if unknown:
        raise UhopError(f"target {profile.name} has no provider {', '.join(sorted(unknown))}; "
                        f"its providers: {', '.join(e.id for e in profile.providers)}")
    kept, providers = [], []
    for entry in entries:
        provider = create((entry.id, entry.options), threads)
        blocker = provider.export_blocker() or (None if not present or provider.present
                                                else provider.availability.reason)
        if blocker is None:
            kept.append(entry)
            providers.append(provider)
        elif entry.required:
            work = "run and build stages for" if present else "build stages for"
            raise ProviderError(f"target {profile.name} needs {entry.id}, which this host cannot {work}: {blocker}")
    if not providers:
        raise ProviderError(f"this host can build stages for none of {profile.name}'s providers "
                            f"({', '.join(e.id for e in entries)})")
    return kept, providers


def _write(folder: Path, a: Analysis, plan, profile: Target, entries: list[TargetProvider],
           progress: Callable[[str], None]) -> dict[str, Any]:
    for sub in ("stages", "reference", "samples"):
        (folder / sub).mkdir()
    by_label = {p.label: (p, e) for p, e in zip(a.providers, entries)}
    stages = []
    sized = None  # the model at the samples' shapes, for stages whose runtime builds for fixed shapes
    for k, stage in enumerate(plan.stages):
        provider, entry = by_label[stage.label]
        progress(f"writing stage {k} for {stage.label}")
        model = plan.stage_model(stage)
        built_for = None
        if provider.static_shapes and free_inputs(model):
            sized = sized or Graph.from_model(at_shapes(a.simplified, plan.shapes))
            built_for = _stage_shapes(sized, free_inputs(model), k)
        built = simplify(at_shapes(model, built_for)) if built_for else model
        artifact = provider.export(built, folder / "stages", f"stage_{k:02d}_{provider.id}")
        reference = f"reference/stage_{k:02d}.onnx"
        onnx.save(model, folder / reference)
        stages.append({
            **replace(stage, file=reference, sha256=None, declared=declared_outputs(model)).to_json(),
            "artifact": {**artifact.to_json(), "files": [f"stages/{f}" for f in artifact.files]},
            "runtime": {"name": entry.id, "version": entry.version, "install": provider.install},
            "reference": reference, "tolerance": artifact.tolerance or FP32_TOLERANCE,
            **({"built_for": built_for} if built_for else {}),
        })
    progress("computing reference outputs with ONNX Runtime")
    feeds = a.feeds
    np.savez(folder / "samples" / "inputs.npz", **feeds)
    np.savez(folder / "samples" / "outputs.npz", **reference_outputs(a.loaded.SerializeToString(), feeds))
    if plan.constants:
        np.savez(folder / "constants.npz", **plan.constants)
    loosest = {key: max(s["tolerance"][key] for s in stages) for key in ("rtol", "atol")}
    return {
        "schema": SCHEMA,
        "model": {"name": plan.model_name, "sha256": plan.model_hash},
        "target": profile.to_json(),
        "placement": plan.placement,
        "profile": plan.profile,
        "inputs": [asdict(t) for t in plan.inputs],
        "outputs": [asdict(t) for t in plan.outputs],
        "shapes": plan.shapes,
        "stages": stages,
        "constants": "constants.npz" if plan.constants else None,
        "samples": {"inputs": "samples/inputs.npz", "outputs": "samples/outputs.npz"},
        "tolerance": loosest,
        "files": hash_files(folder),
    }


def _stage_shapes(sized: Graph, names: Sequence[str], k: int) -> dict[str, list[int]]:
    """The fixed shapes of a stage's inputs at the bundle's sample shapes (`sized`: the model at them)."""
    shapes = {name: list(sized.tensors[name].shape or ()) if name in sized.tensors else None for name in names}
    unknown = [name for name, dims in shapes.items() if dims is None or not all(isinstance(d, int) for d in dims)]
    if unknown:
        raise ProviderError(f"stage {k}: the shape of {', '.join(map(repr, unknown))} at the sample shapes cannot be "
                            "inferred, and its runtime builds for fixed shapes; place those nodes elsewhere "
                            "(assign=...)")
    return shapes
