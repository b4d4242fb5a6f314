"""Starting the explorer: the process beside the program that finds the fastest plan for a session's shape
buckets (`uhop_onnx.products.explore`). A session hands it the model and, per bucket, a sample of the
program's own inputs, in an anonymous memory file (`memfd_create`), never on disk; the explorer's stdin is a
pipe the program holds, its lifeline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

SAMPLE_CAP = 64 * 1024**2  # the most bytes of a bucket's sample handed to the explorer
LOG = "explorer.log"  # beside `decisions.json`: what the last explorer did (figures only, never inputs)
# The explorer's process: at the lowest priority (`SCHED_IDLE`, else nice 19) before anything in it starts a thread
# (numpy's BLAS pool as it is imported, the runtimes' pools later), so that every thread and process it starts
# inherits it; then `uhop_onnx.products.explore` as its main.
BOOT = """
import os, runpy
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError):
    pass
try:
    os.setpriority(os.PRIO_PROCESS, 0, 19)
except OSError:
    pass
runpy.run_module("uhop_onnx.products.explore", run_name="__main__", alter_sys=True)
"""


def start(job: Mapping[str, Any], samples: Sequence[Mapping[str, np.ndarray]], model: bytes | None,
          log_to: Path) -> subprocess.Popen:
    """The explorer process for `job` (see `uhop_onnx.products.explore.main`): `samples` (one per `job["buckets"]`
    entry) and `model` (its bytes, when the session was not given a file) written to a memory file it reads; its
    stdin, a pipe this process holds, is its lifeline; its stderr goes to `log_to`."""
    arrays = {f"{k}/{name}": value for k, sample in enumerate(samples) for name, value in sample.items()}
    if model is not None:
        arrays["model"] = np.frombuffer(model, np.uint8)
    fd = os.memfd_create("uhop-explorer", 0)
    try:
        with os.fdopen(os.dup(fd), "wb") as out:
            np.savez(out, job=np.array(json.dumps(dict(job))), **arrays)
        os.lseek(fd, 0, os.SEEK_SET)
        with open(log_to, "wb") as said:
            return subprocess.Popen([sys.executable, "-P", "-c", BOOT, str(fd)], stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, stderr=said, pass_fds=(fd,), process_group=0)
    finally:
        os.close(fd)
