"""A thread of the program's own priority, for background work that starts a runtime's threads.

A runtime's worker threads take the niceness of the thread that starts them, and Linux lets no unprivileged
process lower it again: a plan compiled on a background thread at nice 10 runs its calls on workers at nice 10.
So the one thread here is started from a caller's thread (`start`) and does that work for the background
(`call`). It lives as long as the program: OpenVINO's TBB workers, shared by the whole process, stop when the
thread that started them ends.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as Pending
from typing import Any, TypeVar

from .errors import UhopError

T = TypeVar("T")

_jobs: queue.Queue[tuple[Future, Callable[..., Any], tuple]] = queue.Queue()
_thread: threading.Thread | None = None
_starting = threading.Lock()


def start() -> None:
    """Start the thread from the calling thread, whose priority it takes, unless it runs."""
    global _thread
    with _starting:
        if _thread is None or not _thread.is_alive():
            # not a daemon: a runtime interrupted inside native code as the interpreter ends aborts the process
            _thread = threading.Thread(target=_serve, name="uhop-callers-priority")
            _thread.start()


def call(work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` on that thread: its result, or its exception. `UhopError` when the thread was never
    started or has ended (the program is ending)."""
    thread = _thread
    if thread is None or not thread.is_alive():
        raise UhopError("no thread of the callers' priority runs: the program is ending")
    done: Future = Future()
    _jobs.put((done, work, args))
    while True:
        try:
            return done.result(timeout=0.2)
        except Pending:
            if not thread.is_alive():
                raise UhopError("the thread of the callers' priority ended: the program is ending") from None


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
