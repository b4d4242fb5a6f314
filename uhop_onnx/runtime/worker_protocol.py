"""The measuring workers' processes: started, stopped, bound to their coordinator's life, spoken to; their mains."""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import pickle
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, suppress
from importlib import import_module
from typing import Any

from ..foundation.errors import InputError, first_line
from ..foundation.files import dead_run, run_process
from .profiler import Measurement, Profiler
from ..foundation.timing import Deadline, calls_per_round, round_median

ROUND_SECONDS = 0.05  # a worker's round lasts about this long (3 to 50 calls)
# (target, model, feeds, threads) -> a context manager giving (one call, its stages), releasing them on exit
Build = Callable[..., AbstractContextManager[tuple[Callable[[], object], list[str]]]]


class WorkerFailed(Exception):
    """A worker reported a failure, or exited; the message is its one-line reason."""


def spawn(arguments: list[str], log: Any) -> tuple[subprocess.Popen, Any]:
    """A worker, `python -P -m uhop_onnx.runtime.measure ARGUMENTS... FD` (whose `__main__` calls `main`; `-P`: a
    `uhop_onnx` folder in the working directory, a source checkout's, is not imported instead of the installed
    package), leading a process group
    of its own (`kill` stops it): its requests on its stdin, its replies on a pipe of their own (FD), so that
    nothing a runtime prints can pass for one; its stdout is dropped, its stderr written to `log`. The process,
    and the pipe's end to read its replies from (text)."""
    reading, writing = os.pipe()
    try:
        worker = subprocess.Popen([sys.executable, "-P", "-m", "uhop_onnx.runtime.measure", *arguments, str(writing)],
                                  stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log, text=True,
                                  pass_fds=(writing,), process_group=0)
    except BaseException:
        os.close(reading)
        raise
    finally:
        os.close(writing)
    return worker, os.fdopen(reading)


def kill(worker: subprocess.Popen) -> None:
    """Kill a worker `spawn` started with what it started (its process group), unless it was waited for
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
    """In a worker `spawn` started: its temporary files, and those of what it runs (a compiler's), go to
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
    """The lifeline of a worker `spawn` started with a `scratch` folder (none for one started by hand)."""
    return _Lifeline(scratch) if scratch is not None else None


def _channel(fd: str | None) -> Any:
    """In a worker: the pipe its replies go to (`spawn`), line-buffered, closed to any process it starts;
    stdout for a worker started by hand, without one."""
    if fd is None:
        sys.stdout.reconfigure(line_buffering=True)
        return sys.stdout
    os.set_inheritable(int(fd), False)
    return os.fdopen(int(fd), "w", buffering=1)


def reply(worker: subprocess.Popen, replies: Any, word: str, log: Any) -> str:
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

def module_and_function(spec: str) -> tuple[str, str]:
    """`("uhop_onnx.module", "function")` of a builder's name; `InputError` for one outside `uhop_onnx.`."""
    module, _, function = spec.partition(":")
    if not module.startswith("uhop_onnx.") or not function.isidentifier():
        raise InputError(f"candidate builder {spec!r} must be 'uhop_onnx.<module>:<function>'")
    return module, function


def _builder(spec: str | None) -> Build:
    """The function a candidate's builder name (`"uhop_onnx.module:function"`) names."""
    if spec is None:
        raise InputError("the candidate names no builder; name one as 'uhop_onnx.<module>:<function>'")
    module, function = module_and_function(spec)
    return getattr(import_module(module), function)


class _ModelUnpickler(pickle.Unpickler):
    """Reads what the coordinator's pickler wrote (`measure.SearchWorker.call`), each model file loaded once."""

    def __init__(self, file: Any, models: dict[str, Any]):
        super().__init__(file)
        self.models = models

    def persistent_load(self, pid: str) -> Any:
        if pid not in self.models:
            import onnx

            self.models[pid] = onnx.load(pid)
        return self.models[pid]


def _search(replies: Any, lifeline: _Lifeline | None, prepare: Callable[[], object]) -> None:
    """Answer each line on stdin, saying what it says on `replies`. `{"call": PICKLE}`: run the pickled
    `(function, args)`, write `(raised, result or exception)` to `PICKLE.out`, say `done`. `{"provider": PICKLE,
    "blocks": {KEY: [MODEL, FEEDS]}, "profiler": SETTINGS, "seconds": S}`: say `at KEY` before lowering,
    compiling and first running each block, `rounds` before timing them together (with a `Profiler` of those
    settings, for at most S seconds), then `figures {KEY: figure}`; the runners are closed before the next
    line, and after each answer the heap freed is returned (`_returned_freed`). `prepare()` runs first (what
    every request needs imported, while the coordinator loads the model)."""
    prepare()
    providers: dict[str, Any] = {}
    models: dict[str, Any] = {}
    for line in sys.stdin:
        ask = json.loads(line)
        if "call" in ask:
            _answer(ask["call"], models)
            print("done", file=replies)
            _returned_freed()
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
        _returned_freed()
    if lifeline is not None:
        lifeline.ended()


def _returned_freed() -> None:
    """What the request left in reference cycles collected (a converter's and a runtime's objects: tens of MiB),
    and the heap freed handed back to the system (glibc keeps it for reuse, so a worker would hold every
    request's peak under the next one's); no trim where the C library has no `malloc_trim`."""
    gc.collect()
    with suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _answer(path: str, models: dict[str, Any]) -> None:
    """Run the call pickled at `path`; its result, or what it raised, pickled at `path.out` with what uhop-onnx
    logged meanwhile at WARNING or above (`(logger, level, message)`, logged again by the coordinator). An
    exception that does not pickle, or would not unpickle there, goes as a `RuntimeError` of its first line."""
    with open(path, "rb") as f:
        function, args = _ModelUnpickler(f, models).load()  # noqa: S301 - written by this worker's coordinator
    said = _Said()
    logging.getLogger("uhop_onnx").addHandler(said)
    try:
        answer = (False, function(*args))
    except Exception as error:  # noqa: BLE001 - raised again in the coordinator
        answer = (True, error)
    finally:
        logging.getLogger("uhop_onnx").removeHandler(said)
    with open(f"{path}.out", "wb") as f:
        try:
            if answer[0]:
                pickle.loads(pickle.dumps(answer[1]))  # noqa: S301 - its own bytes: does it come back whole?
            pickle.dump((*answer, said.records), f)
        except Exception as error:  # noqa: BLE001 - an exception that does not pickle is told in one line
            f.seek(0)
            f.truncate()
            pickle.dump((True, RuntimeError(first_line(answer[1] if answer[0] else error)), said.records), f)


class _Said(logging.Handler):
    """The records uhop-onnx logs at WARNING or above during a call, as `(logger, level, message)`."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name, record.levelno, record.getMessage()))


def _block_call(provider: Any, model: str, feeds: str, runners: ExitStack) -> Callable[[], object]:
    """One run of the block model saved at `model` on `provider`, lowered to its precision and compiled
    (closed with `runners`), on the inputs saved at `feeds`; run once first."""
    import onnx

    from ..foundation.inputs import read_inputs

    runner = runners.enter_context(provider.compile(provider.lower(onnx.load(model)), exclusive=False))
    data = read_inputs(feeds)
    runner.run(data)
    return lambda: runner.run(data)


def _named(label: str, m: Measurement) -> Measurement:
    """A failure's error prefixed with the provider that raised it, as the search names them."""
    if m.error is None or m.error.startswith(f"{label}:"):
        return m
    return Measurement.failed(f"{label}: {m.error}")


def _worker(request: dict, replies: Any, lifeline: _Lifeline | None) -> None:
    """Build the candidate with the builder it names (`Build`), say `ready STAGES` on `replies`, then answer
    each `round` line with `median MS` until another line (`exit`); any failure is one `failed "REASON"`
    line."""
    from ..foundation.inputs import read_inputs

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


def main(arguments: list[str], prepare: Callable[[], object]) -> None:
    """A worker process, as `spawn` starts it: `search [SCRATCH FD]` (`prepare()` first) or `worker REQUEST
    [FD]`, where FD is the pipe its replies go to (stdout without one) and SCRATCH, or the request's `scratch`,
    its coordinator's folder for its temporary files (a worker started by hand has neither)."""
    if arguments[0] == "search":
        scratch, fd = arguments[1:3] if len(arguments) > 2 else (None, None)
        _search(_channel(fd), _attached(scratch), prepare)
    elif arguments[0] == "worker":
        request = json.loads(arguments[1])
        _worker(request, _channel(arguments[2] if len(arguments) > 2 else None), _attached(request.get("scratch")))
