"""Worker processes for work that holds the GIL too long to run beside the event loop.

Each worker is a fresh interpreter (`python -m uhop_onnx.serve.workers`) that runs one job at a time: a
pickled `(function, args)` on its stdin, the pickled result (or the exception raised) on its stdout. Unlike
multiprocessing's spawn and forkserver, it never runs the server's own main script again (a script that
starts a server without an `if __name__ == "__main__"` guard would start a second one), and unlike fork it
copies none of the runtimes' threads.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO, Any

_LENGTH = struct.Struct("<Q")


class Workers:
    """At most `count` worker processes, started when first needed; `call` blocks until one is free."""

    def __init__(self, count: int):
        self._free = threading.BoundedSemaphore(count)
        self._idle: list[_Worker] = []
        self._started: list[_Worker] = []
        self._closed = False

    def call(self, function: Callable[..., Any], *args: Any) -> Any:
        """`function(*args)` in a worker; what it raised is raised here. A worker that dies mid-job (or whose
        job cannot be sent) is closed and never reused."""
        with self._free:
            worker = self._take()
            try:
                failed, value = worker.call(function, args)
            except BaseException:
                worker.close()
                raise
            self._idle.append(worker)
        if failed:
            raise value
        return value

    def close(self) -> None:
        """Close every worker (each exits once its job under way, if any, is done)."""
        self._closed = True
        for worker in self._started:
            worker.close()

    def _take(self) -> _Worker:
        if self._closed:
            raise RuntimeError("the worker processes were closed")
        if self._idle:
            return self._idle.pop()
        worker = _Worker()
        self._started.append(worker)
        return worker


class _Worker:
    def __init__(self):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # what this process imports
        self.process = subprocess.Popen([sys.executable, "-P", "-m", __name__], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env)

    def call(self, function: Callable[..., Any], args: tuple) -> tuple[bool, Any]:
        _send(self.process.stdin, (function, args))
        return _receive(self.process.stdout)

    def close(self) -> None:
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()


def _send(stream: IO[bytes], value: Any) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)))
    stream.write(data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError("the worker process exited")
    (length,) = _LENGTH.unpack(head)
    data = stream.read(length)
    if len(data) < length:
        raise EOFError("the worker process exited midway through its answer")
    return pickle.loads(data)


def _serve() -> None:
    """A worker's loop: jobs from stdin until it closes, answers on what was stdout (anything else printed
    goes to stderr, so it cannot corrupt an answer)."""
    jobs, answers = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    while True:
        try:
            function, args = _receive(jobs)
        except EOFError:
            return
        try:
            answer = (False, function(*args))
        except Exception as error:  # noqa: BLE001 - handed back to the caller, who raises it
            answer = (True, error)
        try:
            _send(answers, answer)  # pickled whole before a byte is written
        except (pickle.PicklingError, TypeError, AttributeError) as error:
            _send(answers, (True, RuntimeError(f"the worker's answer cannot be pickled: {error}")))


if __name__ == "__main__":
    _serve()
