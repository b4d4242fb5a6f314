"""The measuring engine: callables timed fairly on a shared machine, in this process or each in its own.

`Profiler` times callables in this process: warm up, then alternate candidates in rounds. Each round times
every candidate once (a few calls, their median), in a fresh (seeded) order each round, so that a slow phase
of the machine, or the threads a runtime leaves spinning, hit every candidate alike. A candidate's figure is
the minimum of its round medians; `spread` is how far its round medians scattered, the noise a decision must
beat. A candidate that raises is a failure (infinitely slow, with its error), never a figure. Candidates timed
in the same rounds are compared round by round (`faster`): a machine that slows down slows both alike.

`time_candidates` does the same with every candidate in its own worker process
(`python -m uhop_onnx.measure worker REQUEST`): a saved plan folder, compiled there stage by stage, or what
an importable `uhop_onnx.` function builds (a raw runtime, for `bench`). The coordinator asks the workers for
one round each in turn, in a fresh (seeded) order every round and with a pause between them, so that no
candidate always follows one whose runtime leaves threads spinning. Calls per round follow `timing`'s one
rule.

`SearchWorker` is one worker process (`python -m uhop_onnx.measure search`) for what may crash
natively while a plan is sought: the search's blocks on a provider whose conversion, quantization or compile
may crash are lowered, compiled and timed there by a `Profiler`, and a provider's capability questions (a
conversion, a runtime's query) are answered there (`call`). A crash costs the block it was building (its
failure names the signal) or the question; what the runtimes held leaves with the process. A crashed worker
is replaced for what is still to do, and so is one whose call outlives its deadline (it is stopped).

Workers read requests on stdin and reply on a pipe of their own (its descriptor their last argument), never on
stdout, where the native runtimes they load may print anything. Each worker leads a process group of its own
(what it starts, a compiler say, joins it), is stopped with that group, and dies with it once its stdin has no
writer left unless it was told to exit: however its coordinator ends, its workers end too (`_Lifeline`). Their
temporary files, and their compilers', go to a folder of the coordinator's run folder (`files.TemporaryFolder`).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import random
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager, suppress
from dataclasses import asdict, dataclass, field, fields
from importlib import import_module
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .errors import InputError, first_line
from .files import dead_run, run_process, temporary_folder
from .timing import Clock, Deadline, calls_per_round, round_median

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


@dataclass(frozen=True)
class Measurement:
    """Milliseconds per call: the minimum of the round medians, and the relative spread of those medians;
    for a failure, infinity and the error. `medians` (ms, in round order) are kept in memory only, for
    comparing candidates timed in the same rounds."""

    ms: float
    spread: float
    rounds: int
    error: str | None = None
    medians: tuple[float, ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def failed(cls, error: BaseException | str) -> Measurement:
        return cls(math.inf, 0.0, 0, error if isinstance(error, str) else first_line(error))

    @property
    def ok(self) -> bool:
        return self.error is None and math.isfinite(self.ms)

    @property
    def interval(self) -> tuple[float, float]:
        """The lowest and highest round median (ms)."""
        return self.ms, max(self.medians, default=self.ms * (1 + self.spread))

    def to_json(self) -> dict[str, float | str | None]:
        return {"ms": self.ms, "spread": self.spread, "rounds": self.rounds, "error": self.error}

    @classmethod
    def from_json(cls, entry: Any) -> Measurement:
        """A figure as `to_json` wrote it; `TypeError` naming the field when it is not one (a cache entry)."""
        m = cls(**entry)
        for name, kinds in (("ms", (int, float)), ("spread", (int, float)), ("rounds", (int,)),
                            ("error", (str, type(None)))):
            value = getattr(m, name)
            if not isinstance(value, kinds) or isinstance(value, bool):
                raise TypeError(f"{name} is {value!r}")
        return m


@dataclass
class Profiler:
    """Measures callables in alternating rounds. `clock` returns seconds (a fake one makes tests exact)."""

    rounds: int = 5
    max_rounds: int = 9  # rounds keep coming while the spread is above `noisy`
    noisy: float = 0.25
    warmup: int = 2
    round_seconds: float = 0.02  # calls per round are chosen so a round of one candidate lasts about this long
    max_calls: int = 25
    clock: Clock = time.perf_counter

    def measure(self, candidates: Mapping[K, Callable[[], object]], deadline: Deadline | None = None
                ) -> dict[K, Measurement]:
        """A figure per candidate; one that raises (in any round) is a failure and leaves the rounds. Past
        the `deadline`, no round starts after the first."""
        failed: dict[K, Measurement] = {}
        calls: dict[K, int] = {}
        for k, call in candidates.items():
            try:
                calls[k] = calls_per_round(call, self.round_seconds, 1, self.max_calls, self.warmup, self.clock)
            except Exception as error:  # noqa: BLE001 - a runtime may fail in any way; that is its figure
                failed[k] = Measurement.failed(error)
        medians: dict[K, list[float]] = {k: [] for k in calls}
        order = random.Random(0)
        for r in range(self.max_rounds if medians else 0):
            for k in order.sample(list(medians), len(medians)):
                try:
                    medians[k].append(round_median(candidates[k], calls[k], self.clock))
                except Exception as error:  # noqa: BLE001
                    failed[k] = Measurement.failed(error)
                    del medians[k]
            if not medians or r + 1 >= self.rounds and max(_spread(m) for m in medians.values()) <= self.noisy:
                break
            if deadline is not None and deadline.passed:
                break
        measured = {k: _figure([x * 1e3 for x in m]) for k, m in medians.items()}
        return {k: measured.get(k) or failed[k] for k in candidates}


def _spread(medians: list[float]) -> float:
    low = min(medians)
    return (max(medians) - low) / low if low > 0 else 0.0


def _figure(medians_ms: list[float]) -> Measurement:
    return Measurement(min(medians_ms), _spread(medians_ms), len(medians_ms), medians=tuple(medians_ms))


def faster(a: Measurement, b: Measurement, margin: float = 0.01) -> bool:
    """Whether `a` is faster than `b` beyond the noise. Timed in the same rounds (3 or more), round by
    round: `a`'s median over `b`'s in the same round stays below 1 - `margin` in every round (one outlier
    round forgiven from 7 rounds on), so a machine that slows down for a while slows both alike. Otherwise
    the figures must differ by more than the larger spread (and `margin`)."""
    if not (a.ok and b.ok):
        return a.ok
    if len(a.medians) == len(b.medians) >= 3:
        ratios = sorted(x / y for x, y in zip(a.medians, b.medians))
        return ratios[-2 if len(ratios) >= 7 else -1] < 1 - margin
    return a.ms < b.ms * (1 - max(a.spread, b.spread, margin))


def build(jobs: Mapping[K, Callable[[], Callable[[], object]]]) -> tuple[dict[K, Callable[[], object]],
                                                                         dict[K, Measurement]]:
    """The calls that `jobs` make, and a failure for each job that could not make its call."""
    calls, failed = {}, {}
    for key, job in jobs.items():
        try:
            calls[key] = job()
        except Exception as error:  # noqa: BLE001 - a runtime may refuse to build in any way
            failed[key] = Measurement.failed(error)
    return calls, failed


# The subprocess rounds

SETTLE_SECONDS = 0.05  # between candidates: worker threads the previous one left spinning go to sleep
ROUND_SECONDS = 0.05  # a worker's round lasts about this long (3 to 50 calls)
LATE = "not timed: the budget ran out before it was ready"
EXIT_SECONDS = 0.5  # a worker told to exit is killed after this long
# (target, model, feeds, threads) -> a context manager giving (one call, its stages), releasing them on exit
Build = Callable[..., AbstractContextManager[tuple[Callable[[], object], list[str]]]]


@dataclass(frozen=True)
class Candidate:
    """What a worker runs: the plan saved in the folder `target`, or, with `build`
    (`"uhop_onnx.module:function"`), what that function builds of `target`: called as
    `build(target, model, feeds, threads)`, it is a context manager giving `(call, stages)` and releasing
    what it compiled on exit."""

    name: str
    target: str
    build: str | None = None

    def __post_init__(self) -> None:
        if self.build is not None:
            _module_and_function(self.build)


def time_plans_in_processes(plans: Mapping[str, Any] | Iterable[tuple[str, Any]], feeds: dict[str, np.ndarray],
                            threads: int | None, rounds: int = 5, deadline: Deadline | None = None
                            ) -> dict[str, Measurement]:
    """Whole plans (by name, or `(name, plan)` pairs, which may be made one at a time) timed each in its own
    process on `feeds`, in alternating rounds -> `Measurement` per name (infinite for a plan that failed),
    with its round medians for `faster`. Each plan is saved for its worker without reports, and not held
    here after. Past the `deadline`, no round starts after the third."""
    with temporary_folder("plans") as work:
        candidates = []
        for name, plan in plans.items() if isinstance(plans, Mapping) else plans:
            folder = Path(work) / f"plan{len(candidates)}"
            plan.save(folder, report=False)
            candidates.append(Candidate(name, str(folder)))
            del plan  # what its worker needs is on disk
        figures = time_candidates(candidates, None, feeds, threads, rounds, deadline=deadline) if candidates else {}
    return {name: _figure(f["round_medians_ms"]) if f["ms"] is not None else Measurement.failed(f["error"])
            for name, f in figures.items()}


def time_candidates(candidates: list[Candidate], model: str | None, feeds: dict[str, np.ndarray],
                    threads: int | None, rounds: int, calls: int | None = None,
                    deadline: Deadline | None = None, one_by_one: bool = False) -> dict[str, dict]:
    """Each candidate in its own worker process, run on `feeds`; rounds alternate between them, in a
    rotating order. At the `deadline`, a worker not yet ready is stopped (its error says so), and no round
    starts after the third. With `one_by_one`, each worker starts once the one before is ready (a candidate
    that measures while it builds, an adaptive session, then has the machine to itself). Per name: `ms` (the
    minimum of the round medians), `spread`, `round_medians_ms`, `stages` (`openvino x12` per stage) and
    `error` (one line, or None)."""
    workers, replies, logs = {}, {}, {}
    scratch = temporary_folder("candidates")  # the feeds, and the workers' temporary files
    shared = os.path.join(scratch.name, "feeds.npz")

    def spawn(c: Candidate) -> None:
        request = json.dumps({"candidate": asdict(c), "model": model, "feeds": shared, "threads": threads,
                              "calls": calls, "scratch": scratch.name})
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
                _kill(worker)

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
                _kill(worker)
            elif worker.poll() is None:
                with suppress(BrokenPipeError):  # it ended meanwhile
                    worker.stdin.write("exit\n")  # the worker's cue to release what it compiled and exit
                    worker.stdin.close()
        for name, worker in workers.items():
            try:
                worker.wait(timeout=0 if deadline is not None and deadline.abandoned else EXIT_SECONDS)
            except subprocess.TimeoutExpired:  # a runtime slow to tear down holds nothing we need
                _kill(worker)
                worker.wait()
            with suppress(BrokenPipeError):  # a round it was stopped before reading
                worker.stdin.close()
            replies[name].close()
            logs[name].close()
        scratch.cleanup()
    return {name: {"ms": min(m) if m and name not in errors else None,
                   "spread": _spread(m) if m and name not in errors else None,
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


class WorkerFailed(Exception):
    """A worker reported a failure, or exited; the message is its one-line reason."""


class Unsendable(TypeError):
    """A call that cannot be sent to a worker (it does not pickle): run it in this process."""


def _spawn(arguments: list[str], log: Any) -> tuple[subprocess.Popen, Any]:
    """A worker, `python -P -m uhop_onnx.measure ARGUMENTS... FD` (`-P`: a `uhop_onnx` folder in the working
    directory, a source checkout's, is not imported instead of the installed package), leading a process group
    of its own (`_kill` stops it): its requests on its stdin, its replies on a pipe of their own (FD), so that
    nothing a runtime prints can pass for one; its stdout is dropped, its stderr written to `log`. The process,
    and the pipe's end to read its replies from (text)."""
    reading, writing = os.pipe()
    try:
        worker = subprocess.Popen([sys.executable, "-P", "-m", "uhop_onnx.measure", *arguments, str(writing)],
                                  stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log, text=True,
                                  pass_fds=(writing,), process_group=0)
    except BaseException:
        os.close(reading)
        raise
    finally:
        os.close(writing)
    return worker, os.fdopen(reading)


def _kill(worker: subprocess.Popen) -> None:
    """Kill a worker `_spawn` started with what it started (its process group), unless it was waited for
    already (its id may then be another process's)."""
    if worker.returncode is None:
        with suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)


ORPHAN_SECONDS = 0.5  # a worker whose stdin lost its writer dies within this long if its coordinator lives on

# Run apart from a dying worker: once no live process is left in the group (argv[1]), remove the folder (argv[2]).
_JANITOR = """
import os, shutil, sys, time
group, folder, end = sys.argv[1], sys.argv[2], time.monotonic() + 10

def member(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, _, pgrp = f.read().rpartition(")")[2].split()[:3]
    except (OSError, ValueError):
        return False
    return pgrp == group and state not in "ZX"

def alive():
    try:
        return any(member(p) for p in os.listdir("/proc") if p.isdigit())
    except OSError:  # no /proc: the group as kill sees it (its zombies too)
        try:
            os.killpg(int(group), 0)
        except OSError:
            return False
        return True

while alive() and time.monotonic() < end:
    time.sleep(0.01)
shutil.rmtree(folder, ignore_errors=True)
"""


class _Lifeline:
    """In a worker `_spawn` started: its temporary files, and those of what it runs (a compiler's), go to
    `scratch`, a folder of its coordinator's run folder; a thread watches its stdin. Once no process holds that
    open (the coordinator stopped the worker or ended, however it ended) and the worker was not `told` to exit,
    the worker's process group (itself and what it started) is killed; when the coordinator is gone, a janitor
    outside that group then removes the coordinator's run folder (the outermost one whose process is gone)."""

    def __init__(self, scratch: str) -> None:
        os.environ["TMPDIR"] = scratch
        tempfile.tempdir = None
        self.scratch, self.coordinator = scratch, run_process(scratch)
        self.told = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="uhop-lifeline", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        hangup = select.poll()
        hangup.register(sys.stdin.fileno(), 0)  # no events asked: it answers when the last writer is gone
        hangup.poll()
        end = time.monotonic() + ORPHAN_SECONDS
        while not self.told.is_set() and os.getppid() == self.coordinator and time.monotonic() < end:
            time.sleep(0.005)
        if self.told.is_set():
            return
        folder = dead_run(self.scratch) if os.getppid() != self.coordinator else None
        if folder is not None:
            subprocess.Popen([sys.executable, "-I", "-S", "-c", _JANITOR, str(os.getpgrp()), str(folder)],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             process_group=0)
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os._exit(1)

    def ended(self) -> None:
        """The requests ended without a cue to exit (stdin closed): the watching thread ends the worker."""
        self.thread.join()


def _attached(scratch: str | None) -> _Lifeline | None:
    """The lifeline of a worker `_spawn` started with a `scratch` folder (none for one started by hand)."""
    return _Lifeline(scratch) if scratch is not None else None


def _channel(fd: str | None) -> Any:
    """In a worker: the pipe its replies go to (`_spawn`), line-buffered, closed to any process it starts;
    stdout for a worker started by hand, without one."""
    if fd is None:
        sys.stdout.reconfigure(line_buffering=True)
        return sys.stdout
    os.set_inheritable(int(fd), False)
    return os.fdopen(int(fd), "w", buffering=1)


def _reply(worker: subprocess.Popen, replies: Any, word: str, log: Any) -> str:
    """The rest of the worker's next reply line, which starts with `word`, or `WorkerFailed` with its reason."""
    for line in replies:
        if line.startswith(word):
            return line[len(word):].strip()
        if line.startswith("failed "):
            raise WorkerFailed(json.loads(line[len("failed "):]))
    code = worker.wait()
    log.seek(0)
    said = last_line(log.read())
    raise WorkerFailed(f"{exit_reason(code)}{f' ({said})' if said else ''}" if code < 0 else said or exit_reason(code))


def exit_reason(code: int) -> str:
    """How a worker ended, for its candidate's error: `the worker was killed by SIGSEGV` (a native crash, or a
    kill), else its exit code."""
    if code >= 0:
        return f"the worker exited with code {code}"
    try:
        return f"the worker was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"the worker was killed by signal {-code}"


def last_line(text: str) -> str:
    """The last line of a log that says something: a traceback's own `Error: message` line."""
    return next((line.strip()[:400] for line in reversed(text.splitlines()) if line.strip()), "")


def stage_labels(plan: Any) -> list[str]:
    """`openvino x12` per stage of a plan: its provider and how many nodes it runs."""
    return [f"{s.label} x{len(s.nodes)}" for s in plan.stages]


@contextmanager
def saved_plan(folder: str, model: str | None, feeds: dict[str, np.ndarray],
               threads: int | None) -> Iterator[tuple[Callable[[], object], list[str]]]:
    """The plan saved in `folder`, compiled on its providers: one call of it on `feeds`, and its stages."""
    from .plan import Plan
    from .runtime import compile_plan

    plan = Plan.load(folder)
    with compile_plan(plan, threads) as executor:
        yield (lambda: executor.run(None, feeds)), stage_labels(plan)


def _module_and_function(spec: str) -> tuple[str, str]:
    """`("uhop_onnx.module", "function")` of a builder's name; `InputError` for one outside `uhop_onnx.`."""
    module, _, function = spec.partition(":")
    if not module.startswith("uhop_onnx.") or not function.isidentifier():
        raise InputError(f"candidate builder {spec!r} must be 'uhop_onnx.<module>:<function>'")
    return module, function


def _builder(spec: str | None) -> Build:
    if spec is None:
        return saved_plan
    module, function = _module_and_function(spec)
    return getattr(import_module(module), function)


HANG_SECONDS = 0.5  # a search worker still busy this long past the deadline is stopped
CALL_GRACE_SECONDS = 30.0  # a search worker's call may run this long past its deadline before it is stopped
CALL_SECONDS = 600.0  # and this long where no deadline applies


class SearchWorker:
    """One worker process that times blocks and answers calls, started at once (it imports the runtimes
    while its coordinator loads the model) and again after a crash; what it is sent is pickled into a
    temporary folder, a model once per object. Requests go to its stdin, its replies come on a pipe of their
    own (`_spawn`). A call still running `grace` seconds past the `deadline` (`CALL_SECONDS` after it began,
    without one) is stopped with the worker (`grace` default: `CALL_GRACE_SECONDS`). `close` ends it."""

    def __init__(self, deadline: Deadline | None = None, grace: float | None = None) -> None:
        self.deadline, self.grace = deadline, CALL_GRACE_SECONDS if grace is None else grace
        self.scratch = temporary_folder("search")
        self.folder = Path(self.scratch.name)
        self.pickled: dict[str, str] = {}  # provider label -> its pickle
        self.models: dict[int, tuple[Any, str]] = {}  # id of a model sent -> (the model, its file)
        self.calls = self.written = 0
        self.worker: subprocess.Popen | None = None
        self.replies: Any = None
        self.log: Any = None
        self._started()

    def call(self, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` run in the worker (a module-level function or a bound method, and arguments
        that pickle); what it raises is raised here. `WorkerFailed` naming the signal when the worker
        crashed, or saying so when the call ran out of time and the worker was stopped (a new one answers
        the next call); `Unsendable` when the call does not pickle."""
        self.calls += 1
        path = self.folder / f"call{self.calls}.pickle"
        try:
            with open(path, "wb") as f:
                _ModelPickler(f, self).dump((function, args))
        except (pickle.PicklingError, AttributeError, TypeError) as error:
            os.unlink(path)
            raise Unsendable(f"{function!r} cannot be sent to a worker: {first_line(error)}") from error
        worker = self._started()
        limit = CALL_SECONDS if self.deadline is None else max(self.deadline.left(), 0.0) + self.grace
        expired = threading.Event()
        watchdog = _watchdog(self.deadline, limit, lambda: (expired.set(), _kill(worker)))
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
            if expired.is_set() and self.deadline is not None and self.deadline.abandoned:
                reason = "the worker was stopped: the search was abandoned"
            elif expired.is_set():
                reason = f"the worker did not answer within {limit:.3g} s and was stopped"
            raise WorkerFailed(reason)
        with open(f"{path}.out", "rb") as f:
            raised, value = pickle.load(f)  # noqa: S301 - written by this coordinator's own worker
        os.unlink(path)
        os.unlink(f"{path}.out")
        if raised:
            raise value
        return value

    def model_file(self, model: Any) -> str:
        """The file `model` (an `onnx.ModelProto`) is saved in for the worker, once per object."""
        if id(model) not in self.models:
            from .loader import saved

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
        worker = self._started()
        watchdog = _watchdog(deadline, deadline.left() + HANG_SECONDS, lambda: _kill(worker))
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

    def _started(self) -> subprocess.Popen:
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
        _kill(self.worker)
        code = self.worker.wait()
        self.log.seek(0)
        said = last_line(self.log.read())
        self._stop()
        return f"{exit_reason(code)}{f' ({said})' if said else ''}"

    def _stop(self) -> None:
        """Kill the worker (what it holds is needed no more, and runtimes can be slow to tear down)."""
        if self.worker is not None:
            _kill(self.worker)
            self.worker.wait()
            with suppress(BrokenPipeError):  # a request it was killed reading
                self.worker.stdin.close()
            self.replies.close()
            self.log.close()
            self.worker = None

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


class _ModelUnpickler(pickle.Unpickler):
    """Reads what `_ModelPickler` wrote, each model file loaded once."""

    def __init__(self, file: Any, models: dict[str, Any]):
        super().__init__(file)
        self.models = models

    def persistent_load(self, pid: str) -> Any:
        if pid not in self.models:
            import onnx

            self.models[pid] = onnx.load(pid)
        return self.models[pid]


def _search_worker(replies: Any, lifeline: _Lifeline | None = None) -> None:
    """Answer each line on stdin, saying what it says on `replies`. `{"call": PICKLE}`: run the pickled
    `(function, args)`, write `(raised, result or exception)` to `PICKLE.out`, say `done`. `{"provider": PICKLE, "blocks": {KEY: [MODEL, FEEDS]},
    "profiler": SETTINGS, "seconds": S}`: say `at KEY` before lowering, compiling and first running each block,
    `rounds` before timing them together (with a `Profiler` of those settings, for at most S seconds), then
    `figures {KEY: figure}`; the runners are closed before the next line."""
    from .providers import resolve

    resolve(None)  # the runtimes present imported, before the first request
    providers: dict[str, Any] = {}
    models: dict[str, Any] = {}
    for line in sys.stdin:
        ask = json.loads(line)
        if "call" in ask:
            _answer(ask["call"], models)
            print("done", file=replies)
            continue
        if ask["provider"] not in providers:
            with open(ask["provider"], "rb") as f:
                providers[ask["provider"]] = pickle.load(f)  # noqa: S301 - written by this worker's coordinator
        provider = providers[ask["provider"]]
        with ExitStack() as runners:
            calls, failed = {}, {}
            for key, (model, feeds) in ask["blocks"].items():
                print("at", json.dumps(key), file=replies)
                try:
                    calls[key] = _block_call(provider, model, feeds, runners)
                except Exception as error:  # noqa: BLE001 - a runtime may refuse a block in any way
                    failed[key] = Measurement.failed(error)
            print("rounds", file=replies)
            figures = Profiler(**ask["profiler"]).measure(calls, Deadline.after(ask["seconds"])) | failed
        print("figures", json.dumps({k: _named(provider.label, m).to_json() for k, m in figures.items()}), file=replies)
    if lifeline is not None:
        lifeline.ended()


def _answer(path: str, models: dict[str, Any]) -> None:
    """Run the call pickled at `path`; its result, or what it raised, pickled at `path.out`."""
    with open(path, "rb") as f:
        function, args = _ModelUnpickler(f, models).load()  # noqa: S301 - written by this worker's coordinator
    try:
        answer = (False, function(*args))
    except Exception as error:  # noqa: BLE001 - raised again in the coordinator
        answer = (True, error)
    with open(f"{path}.out", "wb") as f:
        try:
            pickle.dump(answer, f)
        except Exception as error:  # noqa: BLE001 - an exception that does not pickle is told in one line
            f.seek(0)
            f.truncate()
            pickle.dump((True, RuntimeError(first_line(answer[1] if answer[0] else error))), f)


def _block_call(provider: Any, model: str, feeds: str, runners: ExitStack) -> Callable[[], object]:
    """One run of the block model saved at `model` on `provider`, lowered to its precision and compiled
    (closed with `runners`), on the inputs saved at `feeds`; run once first."""
    import onnx

    from .inputs import read_inputs

    runner = runners.enter_context(provider.compile(provider.lower(onnx.load(model)), exclusive=False))
    data = read_inputs(feeds)
    runner.run(data)
    return lambda: runner.run(data)


def _named(label: str, m: Measurement) -> Measurement:
    """A failure's error prefixed with the provider that raised it, as the search names them."""
    if m.error is None or m.error.startswith(f"{label}:"):
        return m
    return Measurement.failed(f"{label}: {m.error}")


def _worker(request: dict, replies: Any, lifeline: _Lifeline | None = None) -> None:
    """Build the candidate, say `ready STAGES` on `replies`, then answer each `round` line with `median MS`
    until another line (`exit`); any failure is one `failed "REASON"` line."""
    from .inputs import read_inputs

    candidate = request["candidate"]
    try:
        build, feeds = _builder(candidate["build"]), read_inputs(request["feeds"])
        with build(candidate["target"], request["model"], feeds, request["threads"]) as built:
            call, stages = built
            calls = request["calls"] or calls_per_round(call, ROUND_SECONDS, 3, 50, warmup=3)
            print("ready", json.dumps(stages), file=replies)
            for line in sys.stdin:
                if line.strip() != "round":
                    if lifeline is not None:
                        lifeline.told.set()
                    break
                print("median", round_median(call, calls) * 1e3, file=replies)
            else:
                if lifeline is not None:
                    lifeline.ended()
    except Exception as error:  # noqa: BLE001 - any failure is this candidate's result, told in one line
        print("failed", json.dumps(first_line(error)), file=replies)


if __name__ == "__main__":
    if sys.argv[1] == "search":  # search [SCRATCH FD]
        scratch, fd = sys.argv[2:4] if len(sys.argv) > 3 else (None, None)
        _search_worker(_channel(fd), _attached(scratch))
    elif sys.argv[1] == "worker":  # worker REQUEST [FD]
        ask = json.loads(sys.argv[2])
        _worker(ask, _channel(sys.argv[3] if len(sys.argv) > 3 else None), _attached(ask.get("scratch")))
