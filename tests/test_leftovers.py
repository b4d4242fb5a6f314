"""Nothing outlives `uhop-onnx optimize`: ended by SIGTERM, SIGHUP or SIGKILL while its workers measure and one
of them compiles kernels, it leaves no process and no temporary file; what a killed run left is removed by
the next."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "example_mobilenet.onnx"
COMPILER_FILE = re.compile(r"cc[A-Za-z0-9]{6}\..+")  # a C compiler's temporary file: ccAbC123.s

# Runs `optimize` as a child of a subreaper (every process of its tree that loses its parent comes here, so
# none is missed), signals it once a worker compiles (or, without a C compiler, once workers measure), and
# says as JSON what ran then, how `optimize` ended, and what of its tree still ran `GRACE` seconds later.
# With `whole`, every process of the tree is killed at once instead (stopped, then killed): none can clean up.
HARNESS = r"""
import ctypes, json, os, shutil, signal, subprocess, sys, time
from pathlib import Path

ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
number, model, out, grace, whole = int(sys.argv[1]), *sys.argv[2:4], float(sys.argv[4]), sys.argv[5] == "whole"
cli = subprocess.Popen([sys.executable, "-m", "uhop_onnx.cli", "optimize", model, "-o", out, "--quiet"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

def tree():
    found, todo = [], [os.getpid()]
    while todo:
        for children in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            try:
                kids = children.read_text().split()
            except OSError:
                continue
            for kid in kids:
                try:
                    state = Path(f"/proc/{kid}/stat").read_text().rpartition(")")[2].split()[0]
                    line = Path(f"/proc/{kid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                if state not in "ZX":
                    found.append((int(kid), line.strip()))
                todo.append(int(kid))
    return found

def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return

compiler = shutil.which("cc") is not None
start, at = time.monotonic(), []
while cli.poll() is None and time.monotonic() - start < 300:
    now = tree()
    measuring = [line for _, line in now if "uhop_onnx.runtime.measure" in line]
    compiling = [line for _, line in now if line.split(" ")[0].endswith("/cc1")]
    if measuring and (compiling if compiler else len(measuring) >= 3):
        at = [line for _, line in now]
        break
    time.sleep(0.02)
def stop_all():
    stopped = set()
    while len(stopped) < len(tree()):
        for pid, _ in tree():
            os.kill(pid, signal.SIGSTOP)
            stopped.add(pid)
        time.sleep(0.05)
    return stopped

if at and whole:
    for pid in stop_all():
        os.kill(pid, signal.SIGKILL)
elif at:
    cli.send_signal(number)
sent = time.monotonic()
try:
    status = cli.wait(timeout=60)
except subprocess.TimeoutExpired:
    status = None
left = tree()
while left and time.monotonic() - sent < grace:
    time.sleep(0.05)
    reap()
    left = tree()
print(json.dumps({"at": at, "status": status, "seconds": round(time.monotonic() - sent, 3),
                  "left": [line for _, line in left], "stderr": cli.stderr.read()[-2000:] if status else ""}))
for pid, _ in left:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
"""
GRACE = 5.0  # seconds after the signal by which nothing of the tree may run


def _environment(tmp_path: Path) -> dict[str, str]:
    """This test's own temporary folder and cache (a fresh cache: the kernels are compiled again)."""
    (tmp_path / "tmp").mkdir()
    (tmp_path / "cache").mkdir()
    return {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "UHOP_CACHE_DIR": str(tmp_path / "cache")}


def _leftovers(folder: Path) -> list[str]:
    """What uhop-onnx or a C compiler it ran left in the temporary folder `folder`."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("uhop-") or COMPILER_FILE.fullmatch(p.name))


def _ended(tmp_path: Path, env: dict[str, str], number: int, whole: bool = False) -> dict:
    """What the harness says of `optimize` ended by signal `number` (of every process at once, with `whole`)."""
    done = subprocess.run([sys.executable, "-c", HARNESS, str(int(number)), str(MODEL), str(tmp_path / "out"),
                           str(GRACE), "whole" if whole else "cli"], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout.splitlines()[-1])
    assert any("uhop_onnx.runtime.measure worker" in line for line in said["at"]), said  # workers ran at the signal
    if shutil.which("cc") is not None:
        assert any(line.split(" ")[0].endswith("/cc1") for line in said["at"]), said  # and one compiled
    return said


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process tree from /proc")
@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL], ids=lambda n: n.name)
def test_optimize_ended_by_a_signal_leaves_no_process_and_no_temporary_file(tmp_path, number):
    said = _ended(tmp_path, _environment(tmp_path), number)
    assert said["left"] == [], said
    left = _leftovers(tmp_path / "tmp")
    for _ in range(50):  # what the dying processes were writing, removed once they are gone
        if not left:
            break
        time.sleep(0.1)
        left = _leftovers(tmp_path / "tmp")
    assert left == [], said
    assert said["status"] == (128 + number if number != signal.SIGKILL else -number), said  # 143, 129, -9


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process tree from /proc")
def test_a_later_run_removes_what_a_run_killed_whole_left(tmp_path):
    """Every process of a run killed at once while a worker compiles (an out-of-memory kill of its group, say):
    nothing of it could clean up. The next run removes what it left in the temporary folder (its run folder,
    with its workers' and their compiler's files inside) and in the cache (the compiler's folder), and
    leaves nothing of its own."""
    env = _environment(tmp_path)
    said = _ended(tmp_path, env, signal.SIGKILL, whole=True)
    assert _leftovers(tmp_path / "tmp"), said  # something was left
    done = subprocess.run([sys.executable, "-m", "uhop_onnx.cli", "optimize", str(MODEL), "-o", str(tmp_path / "out"),
                           "--quiet"], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    assert _leftovers(tmp_path / "tmp") == []
    kernels = tmp_path / "cache" / "kernels"
    assert [p.name for p in kernels.iterdir() if p.is_dir()] == []  # only built libraries and their digests
