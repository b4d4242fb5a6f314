"""A thread of the callers' priority, for background work that starts a runtime's threads.

A runtime's worker threads take the niceness of the thread that starts them, and Linux lets no unprivileged
process lower it again: a plan compiled on a background thread at nice 10 runs its calls on workers at nice 10.
So the one thread here is started from a caller's thread (`start`: it takes that caller's niceness, `below`
says whether it beats the background's) and does that work for the background (`call`). It runs until the
main thread ends: OpenVINO's TBB workers, shared by the whole process, stop when the thread that started them
ends.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as Pending
from typing import Any, TypeVar

from ..foundation.errors import UhopError, quietly

T = TypeVar("T")

_jobs: queue.Queue[tuple[Future, Callable[..., Any], tuple]] = queue.Queue()
_thread: threading.Thread | None = None
_niceness: int | None = None
_starting = threading.Lock()


def start() -> None:
    """Start the thread from the calling thread, whose niceness it takes, unless it runs."""
    global _thread, _niceness
    with _starting:
        if _thread is None or not _thread.is_alive():
            # not a daemon: a runtime interrupted inside native code as the interpreter ends aborts the process
            _thread = threading.Thread(target=_serve, name="uhop-callers-priority")
            try:
                _niceness = os.getpriority(os.PRIO_PROCESS, 0)
            except (AttributeError, OSError):  # no niceness here
                _niceness = None
            _thread.start()


def below(nice: int) -> bool:
    """Whether the thread runs, at a niceness below `nice`."""
    return _thread is not None and _thread.is_alive() and _niceness is not None and _niceness < nice


def call(work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` on that thread: its result, or its exception. `UhopError` when the thread does not run
    (never started, or the main thread has ended)."""
    thread = _thread
    if thread is None or not thread.is_alive():
        raise UhopError("no thread of the callers' priority runs (start it from a caller's thread)")
    if threading.current_thread() is thread:
        return work(*args)
    done: Future = Future()
    _jobs.put((done, work, args))
    while True:
        try:
            return done.result(timeout=0.2)
        except Pending:
            if not thread.is_alive():
                raise UhopError("the thread of the callers' priority ended: the program is ending") from None


@quietly()  # work for the background, whose warnings are said at INFO
def _serve() -> None:
    while threading.main_thread().is_alive():
        try:
            done, work, args = _jobs.get(timeout=0.2)
        except queue.Empty:
            continue
        try:
            done.set_result(work(*args))
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            done.set_exception(error)


def _forked() -> None:
    """In a child process: the parent's thread and its queue are not there."""
    global _jobs, _thread, _niceness, _starting
    _jobs, _thread, _niceness, _starting = queue.Queue(), None, None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)
