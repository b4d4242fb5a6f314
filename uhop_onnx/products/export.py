"""`export_bundle`: a model placed for a target board, each stage in its runtime's own format, with a manifest;
`tune_bundle`: a bundle placed again by measurement on the board itself.

Without the board, placement uses the target profile's providers (their tables; the runtime's query too
where the runtime is on this host) and its static cost model, by the same blocks and dynamic programme
as the measured placement. On the board, `tune_bundle` rebuilds the model from the bundle's stages and
places it by the measured search over the profile's providers present there.

At a reduced precision, each (provider, precision) pair the profile declares is a provider of its own for
the static cost model (`openvino[bf16]`, at its declared speed), and the plan it chooses is gated here as
`optimize` gates one: each stage that runs (or is simulated) here runs, the others stand in as ONNX
Runtime fp32, and a plan outside the tolerance gives up its lowest precision (int8, then fp16, then bf16)
and is placed again. A reduced-precision stage's tolerance in the manifest is the gate's, the contract the
board is held to, not the error measured here.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from ..bundle.manifest import (
    MANIFEST,
    SCHEMA,
    SIGNATURE,
    hash_files,
    read_checked,
    unpacked,
)
from ..bundle import signature
from ..foundation.dtypes import TensorSig
from ..foundation.errors import BundleError, InputError, ProviderError, TooLargeError, UhopError
from ..runtime.executor import Executor
from ..foundation.files import check_writable, new_folder, read_npz, temporary_folder, write_archive, writing
from ..foundation.graph import Graph, declared_outputs
from ..foundation.inputs import Inputs, Shapes, at_shapes, free_inputs, measured_shapes, profile_feeds, read_inputs
from ..model.loader import load, sha256
from .optimizer import analyze, build_plan, place_measured, with_precisions
from ..partitioner.placer import Analysis
from ..partitioner.static_placer import StaticCost
from ..partitioner.static_cost import off_preferred, sized
from ..runtime.plan import Plan
from ..precision import FP32_TOLERANCE, compare, lowest, read_choice, sample_error, wanted
from ..providers import Provider, Runner, create
from ..providers.base import Artifact
from ..foundation.samples import reference_outputs, shapes_text
from ..model.simplify import at_fixed_shapes
from .targets import Target, TargetProvider, load_target, target_from_json

log = logging.getLogger(__name__)


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
    inputs (and any measurement) are at `shapes` or the given `inputs`, as `optimize` takes them; without
    them, at the first calibration sample.

    `precision`, `tolerance` and `calibration` as for `optimize`; under the static cost model the precisions
    competing are those the profile declares for each provider (int8 only with `calibration`), and the plan
    is gated here where its stages run here (see the module's docstring). Each manifest stage records its
    `precision`; a reduced-precision one, whether it was `gated` here and, as its `tolerance`, the gate's
    (`{"scaled": tolerance}`), which `verify_bundle` checks with the gate's rule."""
    tolerance, samples, measure_on = read_choice(precision, tolerance, calibration, shapes, inputs, model)
    out = Path(out)
    archive = out.name.endswith(".tar.gz")
    if out.exists() and (archive or out.is_file() or any(out.iterdir())):
        raise UhopError(f"{out}: exists; give a new folder or .tar.gz path")
    check_writable(out)
    signer = None if sign is None else signature.signer(sign)
    profile = target if isinstance(target, Target) else load_target(target)
    entries, chosen = _providers(profile, providers, threads, present=measure)
    try:
        loaded = load(model)
        fixed = _at_export_shapes(loaded, shapes, measure_on) if any(p.static_shapes for p in chosen) else None
        a = analyze(model if fixed is None else fixed.model, assign=_kept(assign, fixed), threads=threads,
                    progress=progress, chosen=chosen, shapes=shapes, inputs=measure_on, sample=True)
    except InputError as error:
        if measure_on is inputs or isinstance(error, TooLargeError):  # not the samples' form
            raise
        raise sample_error(error) from None
    a = replace(a, source=model)  # the bundle's model is named after the source
    gated, off = None, {}
    if measure:
        if precision != "fp32":
            progress("preparing reduced-precision variants and the fp32 reference")
            a = with_precisions(a, precision, tolerance, samples)
        plan = place_measured(a, threads, budget=budget, progress=progress)
        plan = replace(plan, placement=f"measured on this host for target {profile.name}")
        if a.precision is not None:
            gated = Gated(plan.accuracy, [], [])
    else:
        if precision != "fp32":
            progress("preparing the target's reduced-precision variants and the fp32 reference")
            declared = _declared(a, entries, precision, profile)
            a = with_precisions(a, precision, tolerance, samples, offered=lambda p: declared[p.label],
                                cpu=(profile.arch, profile.isa))
        progress("placing for the target with its static cost model")
        models = {label: e.at(a.provider(label).precision) for label, e in _entries(a, entries).items()}
        plan, gated = _place_static(a, models, threads, progress)
        accelerator = next((e for e in entries if not e.on_cpu), None)  # each node off it, and why
        preferred = [label for label, e in _entries(a, entries).items() if e is accelerator]
        if preferred:
            off = {"off_accelerator": {"provider": preferred[0],
                                       "nodes": off_preferred(sized(a), plan.stages, models, preferred)}}
        plan = replace(plan, placement=f"static cost model of target {profile.name}")
    plan = replace(plan, model_hash=sha256(loaded))  # the source's, even where the bundle's is fixed at its shapes
    with writing(out), (temporary_folder("export") if archive else new_folder(out)) as staging:
        staging = Path(staging)
        manifest = {**_write(staging, a, plan, profile, _entries(a, entries), progress, gated, fixed is not None),
                    **off,
                    **({"fixed_shapes": fixed.shapes} if fixed else {})}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if signer is not None:
            signer(staging)
        if archive:
            write_archive(staging, out, first=(MANIFEST, SIGNATURE))
    return out


@dataclass(frozen=True)
class Fixed:
    """The model at the export's input shapes, everything computed from shapes folded, and those shapes."""

    model: onnx.ModelProto
    shapes: dict[str, list[int]]
    folded: frozenset[str]  # the names of the source's nodes folded away


def _at_export_shapes(loaded: onnx.ModelProto, shapes: Shapes | None, inputs: Inputs | None) -> Fixed | None:
    """`loaded` fixed at the export's input shapes (`shapes`, `inputs`, or the declared ones) and simplified
    there (`at_fixed_shapes`), for a target whose runtimes build for fixed shapes; checked against ONNX Runtime
    running `loaded` on the same seeded inputs. None, with a warning, where the two differ."""
    graph = Graph.from_model(loaded)
    feeds = profile_feeds([graph.signature(name) for name in graph.inputs], shapes, inputs)
    model = at_fixed_shapes(loaded, measured_shapes(feeds))
    fixed = Fixed(model, measured_shapes(feeds),
                  frozenset(n.name for n in loaded.graph.node) - {n.name for n in model.graph.node})
    want = reference_outputs(loaded.SerializeToString(), feeds)
    got = reference_outputs(fixed.model.SerializeToString(), feeds)
    wrong = [name for name, value in want.items() if not compare(got[name], value, FP32_TOLERANCE)["ok"]]
    if wrong:
        log.warning("the model folded at %s differs from ONNX Runtime's results on output(s) %s; it is placed "
                    "unfolded", shapes_text(fixed.shapes), ", ".join(wrong))
        return None
    return fixed


def _kept(assign: Mapping[str, str] | None, fixed: Fixed | None) -> Mapping[str, str] | None:
    """`assign` without the nodes folded away at the export's shapes (as simplification's are ignored)."""
    if assign is None or fixed is None:
        return assign
    return {name: spec for name, spec in assign.items() if name not in fixed.folded}


@dataclass(frozen=True)
class Gated:
    """What the precision gate found of the plan it passed here: the worst errors per output (None when no
    reduced-precision stage ran here), the stages that could not run here (accepted on the profile's word),
    and the plans it rejected before."""

    accuracy: dict[str, Any] | None
    ungated: list[int]
    rejected: list[dict[str, Any]]


def _declared(a: Analysis, entries: Sequence[TargetProvider], choice: str, profile: Target) -> dict[str, list[str]]:
    """Per provider of `a` (`entries` are their profile entries), the precisions the profile declares for it,
    fp32 first; one that competes under `choice` and that its bundle stages cannot hold is a `ProviderError`."""
    declared = {}
    for provider, entry in zip(a.providers, entries):
        offered = ["fp32", *entry.precisions]
        unheld = [p for p in wanted(choice, offered) if p not in provider.bundle_precisions]
        if unheld:
            raise ProviderError(f"target {profile.name} declares {provider.id} at {', '.join(unheld)}, which its "
                                f"bundle stages ({provider.artifact_format}) cannot hold (they hold "
                                f"{', '.join(provider.bundle_precisions)}); drop it from the profile's precisions")
        declared[provider.label] = offered
    return declared


def _entries(a: Analysis, entries: Sequence[TargetProvider]) -> dict[str, TargetProvider]:
    """The profile entry of each provider of `a` (`entries` are its fp32 providers'), by label: a variant's is
    that of the provider it varies, which it follows (as `with_precisions` places them)."""
    out, left, entry = {}, iter(entries), None
    for provider in a.providers:
        if provider.precision == "fp32":
            entry = next(left)
        out[provider.label] = entry
    return out


def _place_static(a: Analysis, models: Mapping[str, TargetProvider], threads: int | None,
                  progress: Callable[[str], None]) -> tuple[Plan, Gated | None]:
    """The static cost model's plan; at a reduced precision, the first that passes the gate here, giving up
    the lowest precision in use (`precision.lowest`) after each that fails."""
    rejected = []
    while True:
        plan = build_plan(a, StaticCost(models).place(sized(a)).choice, threads)
        if a.precision is None:
            return plan, None
        in_use = {s.precision for s in plan.stages} - {"fp32"}
        if not in_use:
            return plan, Gated(None, [], rejected)
        progress("checking the plan's accuracy on the calibration samples")
        ok, accuracy, ungated = _gate_here(a, plan, threads)
        if ok:
            return plan, Gated(accuracy, ungated, rejected)
        dropped = lowest(in_use)
        stages = " > ".join(f"{s.label} x{len(s.nodes)}" for s in plan.stages)
        log.warning("precision: the plan %s is outside the tolerance %g here; placing it again without %s",
                    stages, a.precision.tolerance, dropped)
        rejected.append({"stages": stages, "accuracy": accuracy, "gave_up": dropped})
        kept = [p for p in a.providers if p.precision != dropped]
        a = replace(a, providers=kept, support={p.label: a.support[p.label] for p in kept})


def _gate_here(a: Analysis, plan: Plan, threads: int | None) -> tuple[bool, dict[str, Any], list[int]]:
    """Whether `plan` is within the tolerance on every gate sample, run here: each stage on its provider, or its
    simulator, or else as ONNX Runtime fp32 on its fp32 model (a reduced-precision stage so run is ungated:
    its index is in the list returned). A stage that fails to build or run fails the plan."""
    ungated = []

    @contextmanager
    def compiled() -> Iterator[Executor]:
        with ExitStack() as opened:
            runners = []
            for k, stage in enumerate(plan.stages):
                runner = _runner_here(a.provider(stage.label), plan.stage_model(stage))
                if runner is None:
                    runner = create("ort-cpu", threads).compile(stage.fp32)
                    if stage.precision != "fp32":
                        ungated.append(k)
                runners.append(opened.enter_context(runner))
            yield Executor(plan.stages, runners, plan.inputs, [o.name for o in plan.outputs], plan.constants)

    ok, accuracy = a.precision.check(compiled)
    return ok, accuracy, ungated


def _runner_here(provider: Provider, model: onnx.ModelProto) -> Runner | None:
    """`model` compiled by `provider` on this host, or by its simulator at its precision; None when neither is here."""
    if not provider.present:
        simulator = provider.simulator()
        if simulator is None or not simulator.present:
            return None
        provider = simulator.at_precision(provider.precision, provider.calibration)
    return provider.compile(model, exclusive=False)


def tune_bundle(bundle: str | os.PathLike, out: str | os.PathLike, threads: int | None = None,
                budget: float = 60.0, progress: Callable[[str], None] = lambda step: None, *,
                shapes: Shapes | None = None, inputs: Inputs | None = None, calibration: Any = None) -> Path:
    """Place the model of `bundle` again by measurement on this host (the board), and write the new bundle
    to `out` for the same target profile; measured on the bundle's own sample inputs unless `shapes` or
    `inputs` are given. A reduced-precision bundle's precision and tolerance compete again (int8 only with
    `calibration`, which a bundle does not carry)."""
    with unpacked(bundle) as folder:
        manifest = read_checked(folder, bundle)
        model = _bundled_model(folder, manifest)
        if shapes is None and inputs is None:
            inputs = read_inputs(folder / manifest["samples"]["inputs"])
    profile = target_from_json(manifest["target"], f"{bundle}: target")
    gated = manifest.get("precision") or {}
    return export_bundle(model, profile, out, threads=threads, progress=progress, shapes=shapes, inputs=inputs,
                         measure=True, budget=budget, precision=gated.get("choice", "fp32"),
                         tolerance=gated.get("tolerance"), calibration=calibration)


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
                                 for name, value in read_npz(folder / manifest["constants"], BundleError).items())
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
    kept, providers, blocked = [], [], []
    work = "run and build stages for" if present else "build stages for"
    for entry in entries:
        provider = create((entry.id, entry.options), threads)
        blocker = provider.export_blocker() or (None if not present or provider.present
                                                else provider.probed.reason)
        if blocker is None:
            kept.append(entry)
            providers.append(provider)
        elif entry.required:
            raise ProviderError(f"target {profile.name} needs {entry.id}, which this host cannot {work}: {blocker}")
        else:
            blocked.append(f"{entry.id}: {blocker}")
    if not providers:
        raise ProviderError(f"this host can {work} none of {profile.name}'s providers ({'; '.join(blocked)})")
    for why in blocked:
        log.warning("target %s: left out, as this host cannot %s it: %s", profile.name, work, why)
    return kept, providers


def _write(folder: Path, a: Analysis, plan: Plan, profile: Target, entries: Mapping[str, TargetProvider],
           progress: Callable[[str], None], gated: Gated | None, fixed: bool) -> dict[str, Any]:
    for sub in ("stages", "reference", "samples"):
        (folder / sub).mkdir()
    stages = []
    sized = None  # the model at the samples' shapes, for stages whose runtime builds for fixed shapes
    for k, stage in enumerate(plan.stages):
        provider, entry = a.provider(stage.label), entries[stage.label]
        progress(f"writing stage {k} for {stage.label}")
        model = plan.stage_model(stage)  # as its provider lowered it to its precision
        built_for, free = None, free_inputs(model)
        if provider.static_shapes and (free or fixed):  # a fixed bundle's stages record their shapes too
            sized = sized or Graph.from_model(at_shapes(a.simplified, plan.shapes))
            built_for = _stage_shapes(sized, free or [i.name for i in model.graph.input], k)
        built = at_fixed_shapes(model, built_for) if built_for and free else model
        stem = f"stage_{k:02d}_{provider.id}"
        artifact = provider.export(built, folder / "stages", stem)
        reference = f"reference/stage_{k:02d}.onnx"
        fp32 = model if stage.precision == "fp32" else stage.fp32
        onnx.save(fp32, folder / reference)
        entry_json = {
            **replace(stage, file=reference, sha256=None, declared=declared_outputs(model)).to_json(),
            "artifact": {**artifact.to_json(), "files": [f"stages/{f}" for f in artifact.files]},
            "runtime": {"name": entry.id, "version": entry.version, "install": provider.install},
            "reference": reference, "tolerance": artifact.tolerance or FP32_TOLERANCE,
            **({"built_for": built_for} if built_for else {}),
        }
        if stage.precision != "fp32":
            entry_json["tolerance"] = {"scaled": a.precision.tolerance}
            entry_json["gated"] = k not in gated.ungated
            built_from = _built_from(folder, stem, artifact, built, fp32)
            if built_from:
                entry_json["built_from"] = built_from
        stages.append(entry_json)
    progress("computing reference outputs with ONNX Runtime")
    feeds = a.feeds
    np.savez(folder / "samples" / "inputs.npz", **feeds)
    np.savez(folder / "samples" / "outputs.npz", **reference_outputs(a.loaded.SerializeToString(), feeds))
    if plan.constants:
        np.savez(folder / "constants.npz", **plan.constants)
    scaled = [s["tolerance"]["scaled"] for s in stages if "scaled" in s["tolerance"]]  # fp16 NPU stages' rule
    if any(s.precision != "fp32" for s in plan.stages):  # the plan's outputs are held to the tolerance it was gated with
        loosest = {"scaled": a.precision.tolerance}
    elif scaled:
        loosest = {"scaled": max(scaled)}
    else:
        loosest = {key: max((s["tolerance"][key] for s in stages), default=FP32_TOLERANCE[key])
                   for key in ("rtol", "atol")}
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
        **({} if gated is None else {"precision": {
            "choice": a.precision.choice, "tolerance": a.precision.tolerance,
            "calibrated": a.precision.calibration is not None, "samples": len(a.precision.samples),
            "accuracy": gated.accuracy, "ungated": gated.ungated, "rejected": gated.rejected}}),
        "files": hash_files(folder),
    }


def _built_from(folder: Path, stem: str, artifact: Artifact, built: onnx.ModelProto,
                fp32: onnx.ModelProto) -> str | None:
    """The bundle path of the model a reduced-precision stage's artifact was built from (an int8 stage's QDQ
    model, say): the artifact itself where it is that `.onnx`, else written beside it; None where it is the
    fp32 reference (the runtime was told the precision, or quantizes on the board)."""
    if built.SerializeToString(deterministic=True) == fp32.SerializeToString(deterministic=True):
        return None
    if artifact.format == "onnx":
        return f"stages/{artifact.files[0]}"
    name = f"stages/{stem}.built_from.onnx"
    onnx.save(built, folder / name)
    return name


def _stage_shapes(sized: Graph, names: Sequence[str], k: int) -> dict[str, list[int]]:
    """The fixed shapes of a stage's inputs at the bundle's sample shapes (`sized`: the model at them)."""
    shapes = {name: list(sized.tensors[name].shape or ()) if name in sized.tensors else None for name in names}
    unknown = [name for name, dims in shapes.items() if dims is None or not all(isinstance(d, int) for d in dims)]
    if unknown:
        raise ProviderError(f"stage {k}: the shape of {', '.join(map(repr, unknown))} at the sample shapes cannot be "
                            "inferred, and its runtime builds for fixed shapes; place those nodes elsewhere "
                            "(assign=...)")
    return shapes
