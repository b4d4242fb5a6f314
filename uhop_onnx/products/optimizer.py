"""`optimize`: model -> graph -> capabilities -> placement -> stages -> Plan."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import replace
from functools import partial
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import onnx
from onnx import numpy_helper

from ..foundation.cache import JsonTable, cache_dir, code_fingerprint, device_fingerprint, discard, model_digest, prune, touch
from ..foundation.errors import InputError, PlanError, TooLargeError, UhopError, first_line, logger
from ..foundation.graph import Graph, declared_outputs
from ..foundation.inputs import Inputs, Shapes, free_inputs, inputs_digest, measured_shapes, profile_feeds
from ..model.loader import load, sha256
from ..runtime.measure import (CALL_SECONDS, LATE, Measurement, Profiler, SearchWorker, WorkerFailed,
                               time_plans_in_processes)
from ..partitioner.capabilities import capabilities, only_the_rest, whole_model
from ..partitioner.extract import extract
from ..partitioner.partition import partition
from ..partitioner.first_supported import FirstSupported, first_supported
from ..partitioner.placer import Analysis, Choice, Placement
from ..partitioner.search import Search, in_process
from ..foundation.metadata import ModelMetadata, model_name
from ..runtime.plan import PLAN_FILE, Plan, Stage
from ..precision import FP32_TOLERANCE, Precision, check_samples, compare, read_choice, sample_error, wanted
from ..providers import (
    LAST_RESORT,
    Provider,
    ProviderSpec,
    Support,
    create,
    parse_spec,
    resolve,
)
from ..providers.capability import ANY_OPSET
from ..providers.quantize import Calibration
from ..runtime.report import ms_text
from ..runtime.compile import compile_plan
from ..foundation.samples import check_runs_fit, reference_outputs, reference_runs, shapes_text
from ..model.simplify import at_fixed_shapes, opset, simplify, within_opsets
from ..foundation.timing import Deadline

log = logger(__name__)
SIMPLIFIER = "onnxscript"  # what a search worker loads to simplify (`SearchWorker.call`'s runtime)


def analyze(model: str | os.PathLike | onnx.ModelProto, providers: Sequence[ProviderSpec] | None = None,
            assign: Mapping[str, str] | None = None, threads: int | None = None,
            progress: Callable[[str], None] = lambda step: None, *,
            chosen: list[Provider] | None = None, strict: bool = False,
            resolved: list[Provider] | None = None, shapes: Shapes | None = None, inputs: Inputs | None = None,
            sample: bool = False, deadline: Deadline | None = None, worker: SearchWorker | None = None) -> Analysis:
    """Load, check and simplify `model`, and ask every provider which of its nodes it can run.

    `chosen` gives the provider objects directly (a target board's, present here or not); a provider not
    present on this host answers from its table alone. `resolved` is `resolve(providers, threads, strict)`
    when the caller has it already. With `sample` (or given `shapes` or `inputs`), the inputs measurements
    run on are settled first (`inputs.profile_feeds`), so that free dimensions nobody gave stop it before
    anything is measured. With a `worker`, the model is simplified there (`_simplified`) and providers but
    ONNX Runtime's CPU are asked there (`_asked`).
    """
    progress("loading and checking the model")
    loaded = load(model)
    progress("simplifying the graph")
    try:
        simplified = _simplified(worker, simplify, loaded)
    except WorkerFailed as failure:
        if worker.abandoned:
            raise
        log.warning("simplifying the model failed (%s); it is planned as loaded", failure)
        simplified = loaded
    graph = Graph.from_model(simplified)
    signatures = [graph.signature(name) for name in graph.inputs]
    if sample or shapes is not None or inputs is not None:
        feeds = profile_feeds(signatures, shapes, inputs)
    else:  # nothing is measured: the default shapes, where the model has them, still help fixed-shape runtimes
        try:
            feeds = profile_feeds(signatures)
        except InputError:
            feeds = None
    extend = chosen is None
    if chosen is not None:
        chosen = list(chosen)
    else:
        chosen = list(resolved) if resolved is not None else resolve(providers, threads, strict)
    chosen = list({p.label: p for p in reversed(chosen)}.values())[::-1]  # a provider listed twice counts once
    if sample or shapes is not None or inputs is not None:  # the whole plans timed at once, and the search
        check_runs_fit(simplified, measured_shapes(feeds), len(chosen) + 2)
    pinned = _pins(assign or {}, loaded, graph, chosen, threads, extend)
    fixed = None
    if feeds is not None and free_inputs(simplified):
        try:
            fixed = FixedShapes(_simplified(worker, at_fixed_shapes, simplified, measured_shapes(feeds)))
        except WorkerFailed:
            if worker.abandoned:
                raise
            log.warning("the model at %s could not be prepared for fixed-shape runtimes: simplifying it there "
                        "failed", shapes_text(measured_shapes(feeds)))
        except Exception as error:  # noqa: BLE001 - inference may refuse the shapes; such runtimes then refuse too
            log.warning("the model at %s could not be prepared for fixed-shape runtimes: %s",
                        shapes_text(measured_shapes(feeds)), first_line(error))
    support = {}
    for provider in list(chosen):
        progress(f"asking {provider.label} what it can run")
        if deadline is not None and deadline.passed and provider not in (chosen[0], chosen[-1]) \
                and provider.label not in pinned.values():
            log.warning("%s is left out: the budget ran out before it was asked what it can run (give a larger "
                        "budget)", provider.label)
            chosen.remove(provider)
            continue
        if fixed and provider.static_shapes:
            support[provider.label] = _asked(worker, provider, graph, fixed.capabilities, graph, provider)
        else:
            support[provider.label] = _asked(worker, provider, graph, capabilities, simplified, graph, provider,
                                             provider.availability.present)
    if worker is not None and fixed is not None:
        worker.forget(fixed.model)  # every provider asked: the model at fixed shapes is needed no more
    support = _opsets_converted(simplified, graph, chosen, support, feeds)
    last = chosen[-1].label
    if chosen[-1].appended:
        support[last] = only_the_rest(support, keep={node for node, p in pinned.items() if p == last})
    return Analysis(model, loaded, simplified, graph, chosen, support, pinned, feeds)


def _opsets_converted(simplified: onnx.ModelProto, graph: Graph, chosen: Sequence[Provider],
                      support: dict[str, dict[str, Support]],
                      feeds: Mapping[str, Any] | None) -> dict[str, dict[str, Support]]:
    """`support` where a provider's table refuses the model's ai.onnx opset: that provider asked again about the
    model converted into its range (`within_opsets`, checked against ONNX Runtime on the original), each node the
    converter cannot move left off with its reason. Its stages are converted when it builds them."""
    version, support = opset(simplified), dict(support)
    for provider in chosen:
        low, high = provider.table.domains.get("", ANY_OPSET)
        if version is None or low <= version <= high or provider.label not in support:
            continue
        try:
            converted, failed = within_opsets(simplified, low, high, feeds)
        except Exception as error:  # noqa: BLE001 - the converter, or ONNX Runtime on the original, fails in any way
            log.warning("%s: the model's opset %d is outside its %d..%d and converting it failed: %s", provider.label,
                        version, low, high, first_line(error))
            continue
        answers = capabilities(converted, Graph.from_model(converted), provider, provider.availability.present)
        support[provider.label] = {n.name: Support(False, failed[n.name]) if n.name in failed else answers[n.name]
                                   for n in graph.nodes}
    return support


def _asked(worker: SearchWorker | None, provider: Provider, graph: Graph, question: Callable[..., dict[str, Support]],
           *args: Any) -> dict[str, Support]:
    """`question(*args)`: `provider`'s capability answers, in `worker` (where its conversions and queries
    may crash natively, and what its runtime keeps of them leaves with the worker: ONNX Runtime's CPU
    session of the whole model too); when the worker crashes, a "no" for every node, naming the signal."""
    if worker is None or not worker.takes(provider):
        return question(*args)
    try:
        return worker.call(question, *args, runtime=provider.id)
    except WorkerFailed as failure:  # it crashed, or did not answer in time and was stopped
        if worker.abandoned:
            raise  # stopped as the search was abandoned: nobody waits for the answer
        log.warning("%s: asking it what it can run failed (%s); it runs nothing here", provider.label, failure)
        return {n.name: Support(False, f"asking {provider.label} failed: {failure}", "check") for n in graph.nodes}


def _simplified(worker: SearchWorker | None, simplification: Callable[..., onnx.ModelProto],
                model: onnx.ModelProto, *args: Any) -> onnx.ModelProto:
    """`simplification(model, *args)` (`simplify`, `at_fixed_shapes`), in `worker` where there is one: this
    process then never imports the simplifier (onnx-ir, onnxscript and sympy, about 60 MiB), and a crash in it
    costs the worker (`WorkerFailed`). It is not bound by the search's deadline (as in this process, the search
    needs its result); a model it leaves as it was is `model` itself, not a copy."""
    if worker is None:
        return simplification(model, *args)
    changed = worker.call(_changed, simplification, model, *args, runtime=SIMPLIFIER, seconds=CALL_SECONDS)
    return model if changed is None else changed


def _changed(simplification: Callable[..., onnx.ModelProto], model: onnx.ModelProto, *args: Any
             ) -> onnx.ModelProto | None:
    """`simplification(model, *args)`, or None where it returned `model` as it was (nothing to send back)."""
    simplified = simplification(model, *args)
    return None if simplified is model else simplified


class FixedShapes:
    """The model at the shapes it is measured at, simplified again (its shape arithmetic folded there,
    `at_fixed_shapes`): what a runtime that builds for fixed shapes is asked about."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.graph = Graph.from_model(model)

    def capabilities(self, graph: Graph, provider: Provider) -> dict[str, Support]:
        """`provider`'s answer for every node of `graph`; a node folded away at these shapes is a constant
        there, which the provider computes when it builds the stage."""
        verdicts = capabilities(self.model, self.graph, provider, query=provider.availability.present)
        folded = Support(True, "a constant at the measured shapes", "simplify")
        return {n.name: verdicts.get(n.name, folded) for n in graph.nodes}


def with_precisions(a: Analysis, choice: str, tolerance: float, samples: list[dict[str, Any]] | None,
                    offered: Callable[[Provider], Sequence[str]] | None = None,
                    cpu: tuple[str, Sequence[str]] | None = None) -> Analysis:
    """`a` with each provider's reduced-precision variants that compete under `choice` placed right after it
    (each runs what its provider runs), of the precisions `offered` says it has (default: what it builds on
    this host). Gated on the calibration `samples`, or without them on generated ones, with a warning; int8
    needs the calibration samples and is left out without them, and is quantized for `cpu` (a target's arch
    and ISA extensions; None: this host's)."""
    offered = offered or (lambda provider: provider.precisions())
    names = list(a.graph.inputs)
    signatures = [a.graph.signature(name) for name in names]
    if samples is None:
        if "int8" in {p for provider in a.providers for p in wanted(choice, offered(provider))}:
            warnings.warn("precision: int8 variants are not tried without calibration samples (calibration=...)",
                          UserWarning, stacklevel=4)
        warnings.warn("precision: no calibration samples given; reduced-precision plans are checked on 4 "
                      "generated samples only (give calibration=samples.npz to check them on real data)",
                      UserWarning, stacklevel=4)
        gate_samples = [profile_feeds(signatures, measured_shapes(a.feeds), seed=seed) for seed in range(1, 5)]
        calibration = None
    else:
        check_samples(samples, names)
        gate_samples = [profile_feeds(signatures, inputs=s) for s in samples]
        calibration = Calibration(a.simplified, gate_samples, cpu)
    providers, support = [], {}
    for provider in a.providers:
        for p in wanted(choice, offered(provider)):  # fp32 first: a pin stays on the provider's fp32 stages
            if p == "int8" and calibration is None:
                continue
            variants = [provider] if p == "fp32" else provider.variants(p, calibration)
            providers += variants
            support |= {variant.label: a.support[provider.label] for variant in variants}
    if len(providers) == len(a.providers):
        warnings.warn(f"precision={choice!r}: no provider here offers it; the plan is fp32", UserWarning, stacklevel=4)
    references = reference_runs(a.loaded.SerializeToString(), gate_samples)
    return Analysis(a.source, a.loaded, a.simplified, a.graph, providers, support, a.pinned, a.feeds,
                    Precision(choice, tolerance, gate_samples, references, calibration))


def optimize(model: str | os.PathLike | onnx.ModelProto, providers: Sequence[ProviderSpec] | None = None,
             assign: Mapping[str, str] | None = None, profile: bool = True, threads: int | None = None, *,
             strict: bool = False, shapes: Shapes | None = None, inputs: Inputs | None = None,
             precision: str = "fp32", tolerance: float | None = None,
             calibration: str | os.PathLike | Mapping[str, Any] | None = None,
             budget: float = 60.0, profiler: Profiler | None = None,
             progress: Callable[[str], None] = lambda step: None, policy: str = "device",
             stop: Callable[[], bool] | None = None) -> Plan:
    """Place every node of `model` on a provider and split it into stages.

    `providers` lists provider ids (or `(id, options)`) in preference order; None means every provider
    present. `assign` pins nodes (by name in the loaded model) to provider ids. With `profile`, candidate
    placements are measured on this machine and the fastest is kept (block figures cached on disk); without
    it, each node goes to the first provider that supports it. `budget` bounds the whole call, in seconds:
    it returns by then (plus the measurement under way) with the best plan found so far, `progress` told
    each step and each new best plan (as `partitioner.search.BEST` + its name and figure). Once `stop()` is
    true the search is abandoned: the measurements under way stop (their workers killed), and it raises
    `UhopError` at its next step.
    Whole plans are timed each in its own process, as they will run; a given `profiler` times everything
    in this process instead (with a fake clock, tests get exact figures). A measured plan is kept in the
    cache, keyed by the model's bytes, the providers present (and their versions), the arguments and this
    machine; the same call again reuses it. A listed provider absent here is skipped with one warning;
    `strict` makes that an error. `policy` says how ONNX Runtime's EP names are read (`providers.resolve`):
    "device" (`CPUExecutionProvider` is every provider on this host's CPU) or "literal" (an alias).

    Measurements run at `shapes` (`{input: (1, 3, 640, 640)}`) or on `inputs` (arrays by name, or an `.npz`
    path); without them a free leading dimension is 1, and any other free dimension raises `InputError`
    naming it. The plan records the shapes and runs at every shape the model allows.

    `precision` other than `"fp32"` lets reduced-precision variants of the providers compete (`"auto"`:
    every one a provider offers here; `"bf16"`, `"fp16"`, `"int8"`: that one or fp32, per stage); a plan
    is chosen only if, on every calibration sample, each output `y` is within `tolerance` (default 1e-2) of
    ONNX Runtime fp32's `ref` on the original model: `max|y - ref| <= tolerance * (1 + max|ref|)`.
    `calibration` is an `.npz` (or a dict) whose arrays carry a leading sample axis, or a folder of `.npz`
    files, one sample each; int8 is tried only with it. Without `shapes` or `inputs`, measurements run at
    the first calibration sample.
    """
    deadline = Deadline.after(budget, stop)
    if stop is not None:  # abandoned already: not even a plan from the cache
        _abandoned_if(stop)
        progress = partial(_unless_abandoned, stop, progress)
    tolerance, samples, measure_on = read_choice(precision, tolerance, calibration, shapes, inputs, model)
    if precision != "fp32" and not profile:
        raise InputError(f"precision={precision!r} chooses by measuring: it needs profile=True (drop --no-profile)")
    chosen = resolve(providers, threads, strict, policy)

    def analysis(worker: SearchWorker | None = None) -> Analysis:
        try:
            a = analyze(model, providers, assign, threads, progress, resolved=chosen, shapes=shapes,
                        inputs=measure_on, sample=profile, deadline=deadline, worker=worker)
        except InputError as error:
            if measure_on is inputs or isinstance(error, TooLargeError):  # not the samples' form
                raise
            raise sample_error(error) from None
        if precision == "fp32":
            return a
        progress("preparing reduced-precision variants and the fp32 reference")
        return with_precisions(a, precision, tolerance, samples)

    if not profile:
        a = analysis()
        progress("placing nodes and cutting stages")
        return build_plan(a, FirstSupported().place(a).choice, threads)
    if profiler is not None:
        return place_measured(analysis(), threads, budget=budget, profiler=profiler, progress=progress,
                              deadline=deadline)
    measured_at = {"shapes": {k: list(v) for k, v in (shapes or {}).items()},
                   "inputs": None if measure_on is None else inputs_digest(measure_on)}
    if precision != "fp32":
        measured_at["precision"] = [precision, tolerance, None if calibration is None else (
            inputs_digest(calibration) if isinstance(calibration, (str, os.PathLike)) else
            inputs_digest({f"{k}/{n}": v for k, s in enumerate(samples) for n, v in s.items()}))]
    def cached() -> tuple[Path, Plan | None]:
        folder = cache_dir() / "plans" / _plan_key(model, chosen, assign=assign, threads=threads, budget=budget,
                                                   **measured_at)
        return folder, _cached_plan(folder)

    folder, plan = cached()
    # its providers may have been listed from their files alone: one that fails its probe now is left out
    broken = [p for p in chosen if p.id in plan.get_providers() and not p.present] if plan is not None else []
    if broken:
        log.warning("the plan measured earlier runs on %s, not available here now (%s); planning without it",
                    broken[0].label, broken[0].probed.reason)
        chosen = [p for p in chosen if p not in broken]
        folder, plan = cached()
    if plan is not None:
        log.info("reusing the plan measured earlier on this machine: %s", folder)
        touch(folder)
        return plan
    with SearchWorker(deadline) as worker:  # what may crash natively while the plan is sought runs there
        plan = place_measured(analysis(worker), threads, budget=budget, progress=progress, deadline=deadline,
                              worker=worker)
    try:
        plan.save(folder, report=False)  # the report is written where the user saves the plan
    except (UhopError, OSError) as error:  # a full disk, or another process caching the same plan
        log.warning("could not keep the plan in the cache at %s: %s", folder, error)
    prune()
    return plan


def _cached_plan(folder: Path) -> Plan | None:
    """The plan cached in `folder`, every stage file checked against its sha256; None when there is none, or
    when it fails its check (it is dropped then, with a warning)."""
    if not (folder / PLAN_FILE).is_file():
        return None
    try:
        plan = Plan.load(folder)
        for stage in plan.stages:
            plan.stage_model(stage)
    except UhopError as error:
        log.warning("cached plan %s fails its check (%s); it is dropped and measured again", folder, error)
        discard(folder)
        return None
    return plan


def _plan_key(model: str | os.PathLike | onnx.ModelProto | bytes, chosen: Sequence[Provider], **arguments: Any) -> str:
    """What a measured plan depends on, hashed: the model's bytes, the providers (with options and
    versions), `arguments`, this machine and uhop-onnx's version and source."""
    from .. import __version__

    described = [(p.id, p.options, p.availability.version) for p in chosen]
    settings = json.dumps([__version__, code_fingerprint(), device_fingerprint(), described, arguments],
                          sort_keys=True, default=repr)
    return hashlib.sha256(f"{model_digest(model)}\0{settings}".encode()).hexdigest()[:32]


def place_measured(a: Analysis, threads: int | None, *, budget: float = 60.0, profiler: Profiler | None = None,
                   progress: Callable[[str], None] = lambda step: None, deadline: Deadline | None = None,
                   worker: SearchWorker | None = None) -> Plan:
    """The plan of `a` that measures fastest on this machine by the `deadline` (default: `budget` seconds
    from now), with what may crash natively in `worker` (`Search.worker`); see `optimize`."""
    deadline = deadline or Deadline.after(budget)
    plan_of = partial(build_plan, a, threads=threads,  # built again when needed again: plans hold the weights
                      model_hash=sha256(a.loaded))

    if profiler is None:
        def time_plans(choices: Mapping[str, Choice]) -> dict[str, Measurement]:
            def built():  # one at a time, each saved for its worker and let go; none after the deadline
                for name, c in choices.items():
                    if deadline.passed:
                        return
                    yield name, plan_of(c)

            timed = time_plans_in_processes(built(), a.feeds, threads, deadline=deadline, worker=worker)
            return {name: timed.get(name) or Measurement.failed(LATE) for name in choices}
    else:
        def run_plan(choice: Choice):
            executor = compiled.enter_context(compile_plan(plan_of(choice), threads))
            return lambda: executor.run(None, a.feeds)

        time_plans = in_process(run_plan, profiler, deadline)
    labels = [p.label for p in a.providers]
    store = JsonTable(cache_dir() / "profiles" / f"{device_fingerprint(threads, *labels)}.json",
                      check=Measurement.from_json)
    gated = a.precision is not None or whole_model(a.support, a.pinned)
    placer = Search(time_plans, profiler=profiler or Profiler(), store=store, budget_s=budget, threads=threads,
                    gate=partial(_gate, a, threads=threads) if gated else None,
                    deadline=deadline, progress=progress, worker=worker)
    with ExitStack() as compiled:  # the plans timed in this process, closed once the search is done
        placement = placer.place(a)
    chosen = plan_of(placement.choice)  # with what the search found of it, a new plan
    plan = replace(chosen, stages=_with_costs(chosen.stages, placement), placement=placement.method,
                   profile=placement.to_json(), tolerance=None if a.precision is None else a.precision.tolerance,
                   accuracy=None if a.precision is None else placement.plans[placement.chosen].accuracy)
    _log_measured(plan.model_name, placement)
    return plan


def _gate(a: Analysis, choice: Choice, threads: int | None) -> tuple[bool, dict[str, Any] | None]:
    """Whether the plan of `choice` is within the tolerance on every gate sample, and its worst errors per
    output; a plan whose stages are all fp32, each node where its provider's answer (or a pin) put it, is
    not checked (None). Without reduced precisions, a plan that runs nodes where the answers refused them
    (a whole-model plan) is held to fp32's tolerance against ONNX Runtime on the measured inputs."""
    def compiled():
        return compile_plan(build_plan(a, choice, threads), threads)

    answered = all(a.support[label][node.name].ok or a.pinned.get(node.name) == label
                   for label, node in zip(choice, a.graph.nodes))
    if answered and all(a.provider(label).precision == "fp32" for label in set(choice)):
        return True, None
    if a.precision is not None:
        return a.precision.check(compiled)
    reference = reference_outputs(a.loaded.SerializeToString(), a.feeds)
    try:
        with compiled() as executor:
            got = dict(zip(executor.outputs, executor.run(None, a.feeds), strict=True))
    except Exception as error:  # noqa: BLE001 - a plan that cannot run is not accepted
        return False, {"error": first_line(error)}
    figures = {name: compare(got[name], want, FP32_TOLERANCE) for name, want in reference.items()}
    return all([f.pop("ok") for f in figures.values()]), figures


def _log_measured(model_name: str, placement: Placement) -> None:
    for name, candidate in placement.plans.items():
        figure = candidate.figure
        log.info("%s: candidate %s measured %s ms (spread %.1f%%)", model_name, name,
                 ms_text(figure.ms if figure.ok else None) or "no figure", 100 * figure.spread)
    effort = placement.effort
    log.info("%s: chose %s; %d block figures measured, %d from the cache, in %s s%s", model_name,
             placement.chosen, effort.measured, effort.cached, effort.seconds,
             "" if effort.complete else " (stopped at the budget)")


def _with_costs(stages: Sequence[Stage], placement: Placement) -> list[Stage]:
    """The `stages`, each with the measured cost of its blocks on its provider, on every provider that could
    run them all, and the boundary paid where it follows another stage, at the size of what enters it."""
    costs = placement.stage_costs([(stage.label, stage.nodes) for stage in stages])
    return [replace(stage, alternatives=cost.alternatives, cost_ms=cost.alternatives.get(stage.label),
                    boundary_ms=cost.boundary_ms) for stage, cost in zip(stages, costs)]


def _unless_abandoned(stop: Callable[[], bool], progress: Callable[[str], None], step: str) -> None:
    """`progress(step)`, unless `stop()` says the search was abandoned: then `UhopError`."""
    _abandoned_if(stop)
    progress(step)


def _abandoned_if(stop: Callable[[], bool]) -> None:
    if stop():
        raise UhopError("the search was abandoned (its session closed, or the program is ending)")


def first_then_rest(a: Analysis, label: str, threads: int | None,
                    support: Mapping[str, Support] | None = None) -> Plan:
    """The plan of `a` with each node on `label`'s provider where it runs (where `support` says so, when
    given), else on the first of the others (in their order) that runs it."""
    order = {label: a.support[label] if support is None else support}
    order.update((other, answers) for other, answers in a.support.items() if other != label)
    return build_plan(a, first_supported(a.graph, order, a.pinned), threads)


def build_plan(a: Analysis, choice: Sequence[str], threads: int | None, model_hash: str | None = None) -> Plan:
    """The plan of a choice (a provider label per node): convex stages, each extracted as its own model.
    `model_hash`: `loader.sha256(a.loaded)`, when the caller has it."""
    graph = a.graph
    stages = []
    for k, spec in enumerate(partition(graph, choice)):
        provider = a.provider(spec.provider)
        fp32 = extract(a.simplified, graph, spec.nodes, name=f"stage_{k}")
        stage_model = provider.lower(fp32)
        stages.append(Stage(
            provider=provider.id,
            options=dict(provider.options),
            nodes=[graph.nodes[i].name for i in spec.nodes],
            inputs=[i.name for i in stage_model.graph.input],
            outputs=[o.name for o in stage_model.graph.output],
            file=f"stage_{k:02d}_{provider.id}.onnx",
            precision=provider.precision,
            declared=declared_outputs(stage_model),
            model=stage_model,
            fp32=fp32,
        ))
    return Plan(
        model_name=model_name(a.source, a.loaded.graph.name),
        model_hash=model_hash or sha256(a.loaded),
        inputs=[graph.signature(name) for name in graph.inputs],
        outputs=[graph.signature(name) for name in graph.outputs],
        providers=[{"id": p.id, "options": dict(p.options), "version": p.availability.version} for p in a.providers
                   if p.precision == "fp32"],
        stages=stages,
        constants={t.name: numpy_helper.to_array(t) for t in a.simplified.graph.initializer if t.name in graph.outputs},
        threads=threads,
        metadata=ModelMetadata.of(a.loaded),
        replaced=[{"node": node, "provider": provider.label, "reason": verdict.reason}
                  for provider in a.providers for node, verdict in a.support[provider.label].items()
                  if verdict.source == "check"],
        shapes=None if a.feeds is None else measured_shapes(a.feeds),
    )


def _pins(assign: Mapping[str, str], loaded: onnx.ModelProto, graph: Graph, chosen: list[Provider],
          threads: int | None, extend: bool) -> dict[str, str]:
    """Node name -> the label of its provider in `chosen`. An assigned provider missing from `chosen` joins
    it, before the last resort, when `extend`; names of nodes that simplification removed are ignored."""
    known = {n.name for n in loaded.graph.node}
    for node, spec in assign.items():
        if node not in known:
            sample = ", ".join(sorted(known)[:10])
            raise PlanError(f"assign: no node named {node!r} in the model (nodes include: {sample})")
        if _find(chosen, spec) is None and not extend:
            raise PlanError(f"assign: {spec!r} is not among the providers ({', '.join(p.label for p in chosen)})")
        if _find(chosen, spec) is None:
            provider = create(spec, threads)
            provider.require()
            chosen.insert(len(chosen) - (chosen[-1].id == LAST_RESORT), provider)
    return {node: _find(chosen, spec).label for node, spec in assign.items() if node in graph.index_of}


def _find(chosen: list[Provider], spec: ProviderSpec) -> Provider | None:
    ident, options = parse_spec(spec)
    return next((p for p in chosen if p.id == ident and (not options or p.options == options)), None)
