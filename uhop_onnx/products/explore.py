"""The explorer: a process beside the program that finds the fastest plan for a session's shape buckets.

A session (`adaptation.serving.Serving`, through `adaptation.explorer.start`) hands it the model, where the
decisions are kept and, per bucket, a sample of the program's own inputs: in an anonymous memory file
(`memfd_create`), never on disk. The process runs at the lowest priority (`SCHED_IDLE`, else nice 19:
`adaptation.explorer.BOOT`), one per model and cache across a program's processes (a lock beside `decisions.json`),
and ends with the program that started it (its stdin is a pipe from it; it ends at hangup, or once it is orphaned),
after its buckets, or after its CPU budget. For each bucket it waits until the machine has a core to spare, runs the
measured search (`optimize`: each whole plan timed in its own process, in alternating rounds), checks the plan
chosen against ONNX Runtime running the model as given on the sample (the referee, `precision.own`'s rule), and
keeps the decision (`Decisions.keep`). Timings taken while the program's own work left no core idle are the
program's, not the candidates': they are thrown away and taken again once the machine is quieter.

    python -P -c "$BOOT" FD
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import resource
import select
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..adaptation.serving import Decisions
from ..foundation.errors import first_line
from ..foundation.samples import reference_outputs
from ..model.loader import load, load_as_read
from ..precision import own
from ..runtime.compile import compile_plan
from .optimizer import optimize

log = logging.getLogger("uhop_onnx.products.explore")  # its name when run as __main__ too

SPARE_CORES = 1.0  # the cores the program must leave idle, on average, while candidates are timed
IDLE_WINDOW_S = 1.0  # how long idleness is measured before a bucket's search starts
TRIES = 3  # searches per bucket before it is left undecided (each thrown away when the program was busy)
SEARCH_S = 30.0  # the longest search of one bucket


def main(fd: int) -> None:
    """Explore the buckets of the job in memory file `fd`: {source (a path, or None: the "model" array),
    providers, threads, policy, assign, folder (of the decisions), digest (the model's), budget_s (CPU
    seconds), buckets: [{key, calls}]}, each bucket's sample in arrays `K/NAME`."""
    with np.load(os.fdopen(fd, "rb"), allow_pickle=False) as job_file:
        arrays = {name: job_file[name] for name in job_file.files}
    job = json.loads(str(arrays.pop("job")))
    source = job["source"] if job["source"] is not None else arrays.pop("model").tobytes()
    folder = Path(job["folder"])
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(folder / ".explorer.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process explores this model: nothing to do here")
            return
        threading.Thread(target=_watch_program, args=(os.getppid(),), daemon=True).start()
        decisions = Decisions(folder, job["digest"])
        for k, bucket in enumerate(job["buckets"]):
            if _cpu_s() >= job["budget_s"]:
                log.info("%s: left undecided: the budget (%g s of CPU) is spent", bucket["key"], job["budget_s"])
                break
            sample = {name.partition("/")[2]: value for name, value in arrays.items()
                      if name.partition("/")[0] == str(k)}
            explore(source, job, bucket, sample, decisions)


def explore(source: Any, job: Mapping[str, Any], bucket: Mapping[str, Any], sample: dict[str, np.ndarray],
            decisions: Decisions) -> None:
    """Search the plan for one bucket at its sample, referee it, keep the decision (see the module)."""
    key = bucket["key"]
    providers = None if job["providers"] is None else [p if isinstance(p, str) else tuple(p) for p in job["providers"]]
    for attempt in range(TRIES):
        _await_spare_core()
        begun = _machine()
        try:
            plan = optimize(source, providers=providers, assign=job["assign"], threads=job["threads"],
                            policy=job["policy"], inputs=sample, **{
                                "budget": max(5.0, min(SEARCH_S, job["budget_s"] - _cpu_s())), **job["options"]})
        except Exception as error:  # noqa: BLE001 - a model the search cannot take keeps ONNX Runtime
            log.warning("%s: the search failed (%s); ONNX Runtime keeps serving", key, first_line(error))
            decisions.keep(key, "ort-cpu", None, bucket["calls"],
                           decision=f"kept ort-cpu: the search failed ({first_line(error)})")
            return
        busy = _others_busy(begun)
        if busy <= os.cpu_count() - SPARE_CORES:
            break
        log.info("%s: timed while the program kept %.1f cores busy: thrown away (try %d of %d)", key, busy,
                 attempt + 1, TRIES)
    else:
        log.info("%s: left undecided: the program never left a core idle long enough", key)
        return
    keep(source, key, bucket["calls"], plan, sample, decisions)


def keep(source: Any, key: str, calls: int, plan: Any, sample: dict[str, np.ndarray], decisions: Decisions) -> None:
    """Keep `plan` as the bucket's decision once it agrees with ONNX Runtime on `sample` (None: ONNX Runtime
    serves on, for a plan of ONNX Runtime alone, or one that disagrees, which is refused)."""
    profile = plan.profile or {}
    label = profile.get("chosen") or "search"
    found = candidates(profile)
    if set(plan.get_providers()) <= {"ort-cpu"} or profile.get("unmeasured"):  # an untimed plan never wins
        untimed = profile.get("unmeasured")
        why = f"the search timed no plan ({untimed})" if untimed else _said(found, label)
        decisions.keep(key, "ort-cpu", None, calls, candidates=found, decision=f"kept ort-cpu: {why}")
        return
    structure = load_as_read(source)[0]
    rules = own.tolerances(structure, lambda: load(source, check=False))
    want = reference_outputs(source, sample)
    try:
        with compile_plan(plan) as executor:
            got = executor.run(None, sample)
            why, rule, worst = own.judged(executor.outputs, got, [want[n] for n in executor.outputs], rules)
    except Exception as error:  # noqa: BLE001 - a plan that cannot run here is refused
        why, rule, worst = f"it failed: {first_line(error)}", "", 0.0
    if why:
        log.warning("%s: %s refused: %s", key, label, why)
        decisions.keep(key, "ort-cpu", None, calls, refused={label: f"{why}; held to {rule}"}, candidates=found,
                       decision=f"refused {label}: {why}; ort-cpu serves")
        return
    log.info("%s: %s chosen (max abs error %.3g against ONNX Runtime, held to %s)", key, label, worst, rule)
    decisions.keep(key, label, plan, calls, candidates=found, decision=f"{label}: {_said(found, label)}")


def candidates(profile: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The search's whole plans as a session reports candidates: `serving` (the one chosen), and each other
    against it: `faster` or `slower` (their intervals apart), `within noise`, `refused` (by the precision gate)
    or `untried` (not timed)."""
    plans, chosen = profile.get("candidates", {}), profile.get("chosen")
    low, high = (plans.get(chosen, {}).get("interval") or [0.0, math.inf])
    found = []
    for name, c in plans.items():
        interval = c.get("interval")
        state = ("serving" if name == chosen else "refused" if c.get("rejected")
                 else "untried" if c.get("ms") is None or not interval
                 else "faster" if interval[1] < low else "slower" if interval[0] > high else "within noise")
        entry = {"label": name, "state": state, "ms": c.get("ms"), "interval": interval, "stages": c.get("stages")}
        if state == "refused":
            entry["error"] = f"outside the tolerance: {json.dumps(c.get('accuracy'))[:300]}"
        if state == "untried":
            entry["why"] = c.get("error") or "not timed"
        found.append(entry)
    return found


def _said(found: list[dict[str, Any]], chosen: str) -> str:
    """The search's figures in words."""
    return "; ".join(f"{c['label']} {c['state']}" + (f" ({c['ms']:.3g} ms)" if c["ms"] is not None else "")
                     for c in found) or f"{chosen} (no figure)"


def _watch_program(program: int) -> None:
    """End this process (and what it started: each worker watches its own stdin) once the program that
    started it is gone: its pipe hung up, or this process was orphaned."""
    hangup = select.poll()
    hangup.register(sys.stdin.fileno(), 0)
    while not hangup.poll(500) and os.getppid() == program:
        pass
    os._exit(0)


def _cpu_s() -> float:
    """CPU seconds of this process and the workers it waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _machine() -> tuple[float, float, float]:
    """(now, the machine's busy CPU seconds, this process tree's CPU seconds)."""
    with open("/proc/stat") as stat:
        ticks = [int(x) for x in stat.readline().split()[1:]]
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    return time.monotonic(), busy, _cpu_s()


def _others_busy(since: tuple[float, float, float]) -> float:
    """The cores that other processes kept busy on average since `since` (`_machine`)."""
    now = _machine()
    wall = max(now[0] - since[0], 1e-3)
    return max(0.0, (now[1] - since[1]) - (now[2] - since[2])) / wall


def _await_spare_core() -> None:
    """Wait until other processes leave `SPARE_CORES` idle over `IDLE_WINDOW_S`."""
    said = False
    while True:
        begun = _machine()
        time.sleep(IDLE_WINDOW_S)
        busy = _others_busy(begun)
        if busy <= os.cpu_count() - SPARE_CORES:
            return
        if not said:
            log.info("waiting for a core to spare: other processes keep %.1f of %d busy", busy, os.cpu_count())
            said = True


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("uhop_onnx").setLevel(logging.INFO)
    main(int(sys.argv[1]))
