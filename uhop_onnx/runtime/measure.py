"""The measuring engine's worker processes: candidates timed each in its own, and the search's `SearchWorker`."""

from __future__ import annotations

import json
import logging
import os
from importlib import import_module
import pickle
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ..foundation.errors import first_line, logger
from ..foundation.files import temporary_folder
from .profiler import Measurement, Profiler
from ..foundation.timing import Deadline, spread
from .worker_protocol import WorkerFailed, exit_reason, kill, last_line, main, module_and_function
from .worker_protocol import reply as _reply
from .worker_protocol import spawn as _spawn

T = TypeVar("T")
log = logger(__name__)


SETTLE_SECONDS = 0.05  # between candidates: worker threads the previous one left spinning go to sleep
LATE = "not timed: the budget ran out before it was ready"
EXIT_SECONDS = 0.5  # a worker told to exit is killed after this long
SAVED_PLAN = "uhop_onnx.runtime.measure:saved_plan"  # the builder of a candidate that names none


@dataclass(frozen=True)
class Candidate:
    """What a worker runs: the plan saved in the folder `target`, or, with `build`
    (`"uhop_onnx.module:function"`), what that function builds of `target`: called as
    `build(target, model, feeds, threads)`, it is a context manager giving `(call, stages)` and releasing
    what it compiled on exit (`worker_protocol.Build`)."""

    name: str
    target: str
    build: str | None = None

    def __post_init__(self) -> None:
        if self.build is not None:
            module_and_function(self.build)


def time_plans_in_processes(plans: Mapping[str, Any] | Iterable[tuple[str, Any]], feeds: dict[str, np.ndarray],
                            threads: int | None, rounds: int = 5, deadline: Deadline | None = None,
                            worker: SearchWorker | None = None) -> dict[str, Measurement]:
    """Whole plans (by name, or `(name, plan)` pairs, which may be made one at a time) timed each in its own
    process on `feeds`, in alternating rounds -> `Measurement` per name (infinite for a plan that failed),
    with its round medians for `faster`. Each plan is saved for its worker without reports, and not held
    here after; with a search `worker`, its stages on a provider that keeps its conversions are converted
    there first (`_converted_ahead`). Past the `deadline`, no round starts after the third."""
    with temporary_folder("plans") as work:
        candidates = []
        for name, plan in plans.items() if isinstance(plans, Mapping) else plans:
            folder = Path(work) / f"plan{len(candidates)}"
            plan.save(folder, report=False)
            if worker is not None and not (deadline is not None and deadline.passed):
                _converted_ahead(worker, plan, str(folder), feeds, threads, deadline)
            candidates.append(Candidate(name, str(folder)))
            del plan  # what its worker needs is on disk
        figures = time_candidates(candidates, None, feeds, threads, rounds, deadline=deadline) if candidates else {}
    return {name: Measurement.of(f["round_medians_ms"]) if f["ms"] is not None else Measurement.failed(f["error"])
            for name, f in figures.items()}


def _converted_ahead(worker: SearchWorker, plan: Any, folder: str, feeds: dict[str, np.ndarray],
                     threads: int | None, deadline: Deadline | None) -> None:
    """The stages of `plan` (saved in `folder`) on a provider that keeps its conversions, converted in `worker`
    at the values they receive on `feeds` (`convert_ahead`), stopped at the `deadline`: the plan's own process
    then loads them as kept, and its peak is the plan's, not a converter's (the simplifier, the converter, ONNX
    Runtime's reference of the stage: more than the plan holds when it runs). A failure is the plan's own
    process's to meet again."""
    from .compile import convert_ahead, keeps_conversions

    ids = sorted({s.provider for s in plan.stages if keeps_conversions(s)})
    if not ids:
        return
    try:
        worker.call(convert_ahead, folder, feeds, threads, runtime="+".join(ids),
                    seconds=None if deadline is None else max(deadline.left(), 0.0))
    except Exception as error:  # noqa: BLE001 - a conversion may fail in any way; the plan's process says how
        log.info("converting %s's stages on %s before timing it failed: %s", folder, ", ".join(ids),
                 first_line(error))


def time_candidates(candidates: list[Candidate], model: str | None, feeds: dict[str, np.ndarray],
                    threads: int | None, rounds: int, calls: int | None = None,
                    deadline: Deadline | None = None, one_by_one: bool = False) -> dict[str, dict]:
    """Each candidate in its own worker process (`worker_protocol`), run on `feeds`: the coordinator asks the
    workers for one round each in turn, in a fresh (seeded) order every round and with a pause between them,
    so that no candidate always follows one whose runtime leaves threads spinning; calls per round follow
    `timing`'s one rule. At the `deadline`, a worker not yet ready is stopped (its error says so), and no round
    starts after the third. With `one_by_one`, each worker starts once the one before is ready (a candidate
    that measures while it builds, an adaptive session, then has the machine to itself). Per name: `ms` (the
    minimum of the round medians), `spread`, `round_medians_ms`, `stages` (`openvino x12` per stage) and
    `error` (one line, or None)."""
    workers, replies, logs = {}, {}, {}
    scratch = temporary_folder("candidates")  # the feeds, and the workers' temporary files
    shared = os.path.join(scratch.name, "feeds.npz")

    def spawn(c: Candidate) -> None:
        request = json.dumps({"candidate": {**asdict(c), "build": c.build or SAVED_PLAN}, "model": model,
                              "feeds": shared, "threads": threads, "calls": calls, "scratch": scratch.name})
        logs[c.name] = tempfile.TemporaryFile(mode="w+")
        workers[c.name], replies[c.name] = _spawn(["worker", request], logs[c.name])

    medians: dict[str, list[float]] = {c.name: [] for c in candidates}
    stages: dict[str, list[str]] = {c.name: [] for c in candidates}
    errors: dict[str, str] = {}
    late: set[str] = set()

    def stop_the_unready() -> None:
        for name, worker in list(workers.items()):
            if name not in stages_told and worker.poll() is None:
                late.add(name)
                kill(worker)

    stages_told: set[str] = set()
    watchdog = _watchdog(deadline, deadline.left(), stop_the_unready) if deadline else None
    ended = False  # the rounds ran to their end (no exception)
    try:
        np.savez(shared, **feeds)
        for c in candidates if not one_by_one else ():
            spawn(c)
        for c in candidates:
            if one_by_one:
                if deadline is not None and deadline.passed:
                    errors[c.name] = LATE
                    continue
                spawn(c)
            name, worker = c.name, workers[c.name]
            try:
                stages[name] = json.loads(_reply(worker, replies[name], "ready", logs[name]))
                stages_told.add(name)
            except WorkerFailed as failure:
                errors[name] = LATE if name in late else str(failure)
            except ValueError as failure:  # its line cut short: stopped at the deadline as it answered
                errors[name] = LATE if name in late else f"the worker's answer is unreadable ({failure})"
        names = [c.name for c in candidates if c.name not in errors]
        order = random.Random(0)
        for r in range(rounds if names else 0):
            if deadline is not None and deadline.abandoned:  # a worker ready meanwhile has no figure either
                errors.update({name: LATE for name in names if name not in errors})
                break
            if deadline is not None and r >= 3 and deadline.passed:
                break
            for name in order.sample(names, len(names)):
                if deadline is not None and deadline.abandoned:
                    errors[name] = LATE
                if name in errors:
                    continue
                time.sleep(SETTLE_SECONDS)
                try:
                    workers[name].stdin.write("round\n")
                    workers[name].stdin.flush()
                    medians[name].append(float(_reply(workers[name], replies[name], "median", logs[name])))
                except (WorkerFailed, BrokenPipeError) as failure:
                    errors[name] = LATE if name in late else str(failure) if isinstance(failure, WorkerFailed) \
                        else "the worker exited"
        ended = True
    finally:
        if watchdog:
            watchdog.set()
        for worker in workers.values():
            if not ended:  # an exception (a signal's, say) ends the run: nothing to release gently
                kill(worker)
            elif worker.poll() is None:
                with suppress(BrokenPipeError):  # it ended meanwhile
                    worker.stdin.write("exit\n")  # the worker's cue to release what it compiled and exit
                    worker.stdin.close()
        for name, worker in workers.items():
            try:
                worker.wait(timeout=0 if deadline is not None and deadline.abandoned else EXIT_SECONDS)
            except subprocess.TimeoutExpired:  # a runtime slow to tear down holds nothing we need
                kill(worker)
                worker.wait()
            with suppress(BrokenPipeError):  # a round it was stopped before reading
                worker.stdin.close()
            replies[name].close()
            logs[name].close()
        scratch.cleanup()
    return {name: {"ms": min(m) if m and name not in errors else None,
                   "spread": spread(m) if m and name not in errors else None,
                   "round_medians_ms": m, "stages": stages[name], "error": errors.get(name)}
            for name, m in medians.items()}


def _watchdog(deadline: Deadline | None, seconds: float, action: Callable[[], None]) -> threading.Event:
    """Call `action` once, `seconds` from now or as soon as the `deadline` is abandoned (looked at every 0.1
    s), unless the event returned is set first."""
    done, end = threading.Event(), time.monotonic() + seconds

    def watch() -> None:
        while not done.wait(max(min(0.1, end - time.monotonic()), 0.0)):
            if time.monotonic() >= end or deadline is not None and deadline.abandoned:
                action()
                return

    threading.Thread(target=watch, name="uhop-watchdog", daemon=True).start()
    return done


class Unsendable(TypeError):
    """A call that cannot be sent to a worker (it does not pickle): run it in this process."""



def stage_labels(plan: Any) -> list[str]:
    """`openvino x12` per stage of a plan: its provider and how many nodes it runs."""
    return [f"{s.label} x{len(s.nodes)}" for s in plan.stages]


@contextmanager
def saved_plan(folder: str, model: str | None, feeds: dict[str, np.ndarray],
               threads: int | None) -> Iterator[tuple[Callable[[], object], list[str]]]:
    """The plan saved in `folder`, compiled on its providers: one call of it on `feeds`, and its stages."""
    from .plan import Plan
    from .compile import compile_plan

    plan = Plan.load(folder)
    with compile_plan(plan, threads) as executor:
        yield (lambda: executor.run(None, feeds)), stage_labels(plan)


HANG_SECONDS = 0.5  # a search worker still busy this long past the deadline is stopped
CALL_GRACE_SECONDS = 30.0  # a search worker's call may run this long past its deadline before it is stopped
CALL_SECONDS = 600.0  # and this long where no deadline applies


class SearchWorker:
    """One worker process for what may crash natively while a plan is sought: the search's blocks on a provider
    whose conversion, quantization or compile may crash are lowered, compiled and timed there by a `Profiler`,
    and a provider's capability questions (a conversion, a runtime's query) are answered there (`call`). A
    crash costs the block it was building (its failure names the signal) or the question; what the runtimes
    held leaves with the process. Started at once (it imports onnx and the providers' modules while its
    coordinator loads the model) and again after a crash, or when a call outlives its deadline, or to serve
    another runtime (it imports one only when a request loads it); what it is sent is pickled into a
    temporary folder, a model once per object. Requests go to its stdin, its replies come on a pipe of their
    own (`worker_protocol.spawn`). A worker serves one runtime (a request names the one it loads): a request
    for another ends it first and starts a new one, so that what a runtime keeps after its runners are closed
    (arenas, compiled code, packed weights) never lies under another's peak. A call still running `grace`
    seconds past the `deadline` (`CALL_SECONDS` after it began, without one) is stopped with the worker
    (`grace` default: `CALL_GRACE_SECONDS`). `close` ends it."""

    def __init__(self, deadline: Deadline | None = None, grace: float | None = None) -> None:
        self.deadline, self.grace = deadline, CALL_GRACE_SECONDS if grace is None else grace
        self.scratch = temporary_folder("search")
        self.folder = Path(self.scratch.name)
        self.pickled: dict[str, str] = {}  # provider label -> its pickle
        self.models: dict[int, tuple[Any, str]] = {}  # id of a model sent -> (the model, its file)
        self.calls = self.written = 0
        self.worker: subprocess.Popen | None = None
        self.serving: str | None = None  # the runtime the worker has loaded for its requests; None: none yet
        self.replies: Any = None
        self.log: Any = None
        self._started()

    def call(self, function: Callable[..., T], *args: Any, runtime: str | None = None,
             seconds: float | None = None) -> T:
        """`function(*args)` run in the worker (a module-level function or a bound method, and arguments
        that pickle) that serves `runtime` (any, when None); what it raises is raised here, and what it logged
        at WARNING or above is logged here. It may run `seconds` (default: until `grace` past the deadline).
        `WorkerFailed` naming the signal when the worker crashed, or saying so when the call ran out of time and
        the worker was stopped (a new one answers the next call); `Unsendable` when the call does not pickle."""
        self.calls += 1
        path = self.folder / f"call{self.calls}.pickle"
        try:
            with open(path, "wb") as f:
                _ModelPickler(f, self).dump((function, args))
        except (pickle.PicklingError, AttributeError, TypeError) as error:
            os.unlink(path)
            raise Unsendable(f"{function!r} cannot be sent to a worker: {first_line(error)}") from error
        worker = self._started(runtime)
        limit = seconds if seconds is not None else CALL_SECONDS if self.deadline is None else (
            max(self.deadline.left(), 0.0) + self.grace)
        expired = threading.Event()
        watchdog = _watchdog(self.deadline, limit, lambda: (expired.set(), kill(worker)))
        try:
            worker.stdin.write(json.dumps({"call": str(path)}) + "\n")
            worker.stdin.flush()
            done = any(line.rstrip("\n") == "done" for line in self.replies)
        except BrokenPipeError:
            done = False
        finally:
            watchdog.set()
        if not done or expired.is_set():  # an answer as the time ran out counts as none: the worker is killed
            reason = self._ended()
            os.unlink(path)
            if expired.is_set() and self.abandoned:
                reason = "the worker was stopped: the search was abandoned"
            elif expired.is_set():
                reason = f"the worker did not answer within {limit:.3g} s and was stopped"
            raise WorkerFailed(reason)
        with open(f"{path}.out", "rb") as f:
            raised, value, said = pickle.load(f)  # noqa: S301 - written by this coordinator's own worker
        os.unlink(path)
        os.unlink(f"{path}.out")
        for name, level, message in said:
            logging.getLogger(name).log(level, "%s", message)
        if raised:
            raise value
        return value

    @property
    def abandoned(self) -> bool:
        """Whether the search this worker serves was abandoned: a call it stopped then has nobody waiting."""
        return self.deadline is not None and self.deadline.abandoned

    def model_file(self, model: Any) -> str:
        """The file `model` (an `onnx.ModelProto`) is saved in for the worker, once per object."""
        if id(model) not in self.models:
            from ..model.loader import saved

            self.written += 1
            path = self.folder / f"model{self.written}.onnx"
            saved(model, path)
            self.models[id(model)] = (model, str(path))  # the model kept: its id stays its own
        return self.models[id(model)][1]

    def forget(self, model: Any) -> None:
        """Let go of `model` and its file (`model_file`): it will not be sent again."""
        _, path = self.models.pop(id(model), (None, None))
        if path is not None:
            os.unlink(path)

    def measure(self, provider: Any, blocks: Mapping[str, tuple[str, str]], deadline: Deadline,
                profiler: Profiler) -> dict[str, Measurement]:
        """Per key, the figure on `provider` of the block model saved at `blocks[key][0]`, run on the inputs
        saved at `blocks[key][1]` (an `.npz`), the blocks timed together with `profiler`'s settings (on the
        worker's clock). The block a worker crashed on is a failure naming the signal, and a new worker
        measures the rest; past the `deadline` the worker is stopped, and what it had not measured is a
        failure saying so."""
        failed: dict[str, Measurement] = {}
        todo = dict(blocks)
        while todo and not deadline.passed:
            figures, building = self._ask(provider, todo, deadline, profiler)
            if figures is not None:
                return failed | figures
            reason = self._ended()
            if deadline.passed:
                break
            culprits = [building] if building is not None else list(todo)
            what = "while building and first running it" if building is not None else "while timing it"
            failed |= {k: Measurement.failed(f"{provider.label}: {reason} {what}") for k in culprits}
            todo = {k: v for k, v in todo.items() if k not in failed}
        return failed | {k: Measurement.failed(LATE) for k in todo}

    def _ask(self, provider: Any, blocks: Mapping[str, tuple[str, str]], deadline: Deadline, profiler: Profiler
             ) -> tuple[dict[str, Measurement] | None, str | None]:
        """The worker's figures of `blocks`, or None and the block it was building when it ended (None when
        it ended while timing them all)."""
        worker = self._started(provider.id)
        watchdog = _watchdog(deadline, deadline.left() + HANG_SECONDS, lambda: kill(worker))
        building = None
        try:
            settings = {f.name: getattr(profiler, f.name) for f in fields(profiler) if f.name != "clock"}
            worker.stdin.write(json.dumps({"provider": self._pickle(provider), "blocks": blocks, "profiler": settings,
                                           "seconds": deadline.left()}) + "\n")
            worker.stdin.flush()
            for line in self.replies:
                word, _, rest = line.rstrip("\n").partition(" ")
                if word == "at":
                    building = json.loads(rest)
                elif word == "rounds":
                    building = None
                elif word == "figures":
                    return {k: Measurement.from_json(m) for k, m in json.loads(rest).items()}, None
        except (BrokenPipeError, ValueError):  # it ended as it was told, or as it answered
            pass
        finally:
            watchdog.set()
        return None, building

    def _started(self, runtime: str | None = None) -> subprocess.Popen:
        """The worker that serves `runtime` (any, when None): the one running unless it served another."""
        if runtime is not None and self.serving not in (None, runtime):
            self._stop()
        if runtime is not None:
            self.serving = runtime
        if self.worker is None:
            self.log = tempfile.TemporaryFile(mode="w+")
            self.worker, self.replies = _spawn(["search", str(self.folder)], self.log)
        return self.worker

    def takes(self, provider: Any) -> bool:
        """Whether `provider` can be sent to the worker (it pickles: a class defined inside a function, say,
        does not)."""
        try:
            self._pickle(provider)
        except (pickle.PicklingError, AttributeError, TypeError):
            return False
        return True

    def _pickle(self, provider: Any) -> str:
        """The path of `provider` pickled for the worker (once per label)."""
        if provider.label not in self.pickled:
            path = self.folder / f"provider{len(self.pickled)}.pickle"
            path.write_bytes(pickle.dumps(provider))
            self.pickled[provider.label] = str(path)
        return self.pickled[provider.label]

    def _ended(self) -> str:
        """How the worker ended (`exit_reason`, with its log's last line); the next request starts another."""
        kill(self.worker)
        code = self.worker.wait()
        self.log.seek(0)
        said = last_line(self.log.read())
        self._stop()
        return f"{exit_reason(code)}{f' ({said})' if said else ''}"

    def _stop(self) -> None:
        """Kill the worker (what it holds is needed no more, and runtimes can be slow to tear down)."""
        if self.worker is not None:
            kill(self.worker)
            self.worker.wait()
            with suppress(BrokenPipeError):  # a request it was killed reading
                self.worker.stdin.close()
            self.replies.close()
            self.log.close()
            self.worker = self.serving = None

    def close(self) -> None:
        """Stop the worker and remove what was sent to it."""
        self._stop()
        self.models.clear()
        self.scratch.cleanup()

    def __enter__(self) -> SearchWorker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _ModelPickler(pickle.Pickler):
    """Pickles an `onnx.ModelProto` as the file the worker saved it in (`SearchWorker.model_file`)."""

    def __init__(self, file: Any, worker: SearchWorker):
        super().__init__(file)
        self.worker = worker

    def persistent_id(self, obj: Any) -> str | None:
        return self.worker.model_file(obj) if type(obj).__name__ == "ModelProto" else None


def _prepared() -> None:
    """A search worker's first step, while its coordinator loads the model: what every request needs (onnx, to
    read the models it is sent, and the providers' base) imported; a runtime only when a request loads it, so
    that a worker holds the runtimes its requests name and no other."""
    for module in ("onnx", "uhop_onnx.providers"):
        import_module(module)


if __name__ == "__main__":  # a worker process (`worker_protocol.spawn`)
    main(sys.argv[1:], _prepared)
