"""Real programs: the libraries of tests/clients/ (they call onnxruntime themselves and ship their models), stock
and under uhop, side by side.

    python benchmarks/clients.py [--rounds 3] [--clients rapidocr_pages,...] [--json out.json]

Each library runs in a process of its own per mode, the modes alternating within each round: `stock` (ONNX
Runtime), `uhop` (the plain swap `onnxruntime.InferenceSession = uhop_onnx.InferenceSession`, on an empty cache:
a program's first start) and `kept` (the same swap, on the cache a first process left after calling the library
until its sessions decided, at most `--learn` seconds: a program's later starts). Each process reports its import time (the library, and uhop with it), its init time (the
library's object made and its first call, where the library makes its sessions), and its steady per-call latency
(the median of the calls after the first half, so that an adapting session has had its warm-up); the figure of a
mode is the minimum over rounds. Ratios are uhop / stock, between figures of the same run; the per-call ratio of
each round is shown too, since the rounds of a shared machine differ more than the modes may.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "clients"))
import run as clients  # noqa: E402 -- tests/clients/run.py: the clients' registry and driver

MODES = ("stock", "uhop", "kept")
# Calls timed per process after the first (which is part of init): a few seconds of calls each.
CALLS = {"rapidocr_pages": 2, "magika_files": 6, "silero_speech": 8, "nudenet_pictures": 30}
WHAT = {"rapidocr_pages": "OCR of a page (det, cls, rec)", "magika_files": "types of 25 files",
        "silero_speech": "VAD of 11 s of speech (339 runs)", "nudenet_pictures": "one picture (YOLOv8n)"}


def worker(name: str, mode: str) -> None:
    """One process's figures for client `name` in `mode`, printed as JSON on the last line."""
    start = time.perf_counter()
    if mode != "stock":
        clients.swap_in_uhop()
    else:
        import onnxruntime  # noqa: F401 -- timed as uhop's import is
    client = clients.load(name)
    imported = time.perf_counter()
    x = client.inputs()[0]
    made = time.perf_counter()
    app = client.build()
    client.call(app, x)
    ready = time.perf_counter()
    calls = []
    for _ in range(CALLS[name]):
        t = time.perf_counter()
        client.call(app, x)
        calls.append(time.perf_counter() - t)
    sessions = client.sessions(app)
    print(json.dumps({"import_s": imported - start, "init_s": ready - made,
                      "call_ms": 1e3 * statistics.median(calls[len(calls) // 2:]),
                      "providers": {k: describe(s) for k, s in sessions.items()}}))


def learn(name: str, seconds: float) -> None:
    """Client `name` called under uhop until each of its sessions has decided, or for `seconds`: the cache it
    leaves is what `kept` starts from."""
    clients.swap_in_uhop()
    client = clients.load(name)
    app = client.build()
    x = client.inputs()[0]
    begin, calls = time.perf_counter(), 0
    while time.perf_counter() - begin < seconds and not (calls and decided(client.sessions(app))):
        client.call(app, x)
        calls += 1
    sessions = client.sessions(app)
    print(json.dumps({"calls": calls, "seconds": time.perf_counter() - begin, "decided": decided(sessions),
                      "providers": {k: describe(s) for k, s in sessions.items()},
                      "decisions": {k: [b["decision"] for b in s.adaptation.values()] for k, s in sessions.items()}}))


def decided(sessions: dict) -> bool:
    """Whether every shape bucket of every session has its decision."""
    buckets = [b for s in sessions.values() for b in (getattr(s, "adaptation", None) or {}).values()]
    return bool(buckets) and all(b["decision"] for b in buckets)


def describe(session) -> str:
    """The providers a session runs on (its number of stages where it has several), and for an adapting
    session the candidates it has tried and where each stands: `ort-cpu [openvino compiling]`."""
    providers = "+".join(dict.fromkeys(p.removesuffix("ExecutionProvider") for p in session.get_providers()))
    plan = getattr(session, "plan", None)
    if plan is not None and len(plan.stages) > 1:
        providers += f" ({len(plan.stages)} stages)"
    tried = [f"{c['label']} {c['state']}" for bucket in (getattr(session, "adaptation", None) or {}).values()
             for c in bucket["candidates"]]
    return providers + (f" [{', '.join(tried)}]" if tried else "")


def measure(name: str, mode: str, kept: Path) -> dict:
    """Runs the worker for `name` in `mode` in a fresh process, on an empty cache (`kept`: on a copy of `kept`)."""
    with tempfile.TemporaryDirectory(prefix="uhop-clients-") as cache:
        if mode == "kept":
            shutil.copytree(kept, cache, dirs_exist_ok=True)
        return _in_process(["--worker", name, mode], cache)


def _in_process(command: list[str], cache: str) -> dict:
    done = subprocess.run([sys.executable, __file__, *command], capture_output=True, text=True,
                          env={**os.environ, "UHOP_CACHE_DIR": cache}, timeout=900)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["exit status %d" % done.returncode])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(rounds: int = 3, clients_: str = typer.Option(",".join(CALLS), "--clients"),
         learn_s: float = typer.Option(120.0, "--learn", help="Seconds a first process may call a library for."),
         json_out: Path | None = typer.Option(None, "--json")) -> None:
    console = Console(width=200)
    names = [n for n in clients_.split(",") if not clients.missing(n)]
    for n in set(clients_.split(",")) - set(names):
        console.print(f"[yellow]{n} skipped: {clients.missing(n)}")
    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="uhop-clients-kept-"))
    learned = {}
    for n in names:
        learned[n] = _in_process(["--learn", n, str(learn_s)], str(work / n))
        console.print(f"learning {n}: {learned[n]}")
    runs = {n: {m: [] for m in MODES} for n in names}
    for r in range(rounds):
        for n in names:
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                runs[n][mode].append(measure(n, mode, work / n))
                console.print(f"round {r + 1}/{rounds} {n} {mode}: {runs[n][mode][-1]}")
    best = {n: {m: best_of(runs[n][m]) for m in MODES} for n in names}
    table = Table("library", "one call", "import s stock / uhop", "init s stock / uhop", "init ratio",
                  "per call ms stock / uhop / kept", "per call ratio uhop, kept", "each round's (uhop; kept)",
                  "uhop's providers", "kept's providers (decided after)",
                  title=f"{rounds} alternating rounds, each library and mode in its own process, uhop on an empty "
                        "cache, kept on the cache a first run left; minimum over rounds",
                  caption=f"{cpu_model()}, {os.cpu_count()} cores; load average {load_before:.1f} before, "
                          f"{os.getloadavg()[0]:.1f} after")
    for n in names:
        s, u, k = best[n]["stock"], best[n]["uhop"], best[n]["kept"]
        failed = next((f["error"] for f in (s, u, k, learned[n]) if "error" in f), None)
        if failed:
            table.add_row(n, WHAT[n], "", "", "", "", "", "", "", failed[:120])
            continue
        table.add_row(n, WHAT[n], f"{s['import_s']:.2f} / {u['import_s']:.2f}",
                      f"{s['init_s']:.2f} / {u['init_s']:.2f}", f"{u['init_s'] / s['init_s']:.2f}",
                      f"{s['call_ms']:.1f} / {u['call_ms']:.1f} / {k['call_ms']:.1f}",
                      f"{u['call_ms'] / s['call_ms']:.3f}, {k['call_ms'] / s['call_ms']:.3f}",
                      f"{round_ratios(runs[n], 'uhop')}; {round_ratios(runs[n], 'kept')}",
                      "; ".join(f"{key}: {v}" for key, v in u["providers"].items()),
                      "; ".join(f"{key}: {v}" for key, v in k["providers"].items())
                      + f" ({learned[n]['calls']} calls, {learned[n]['seconds']:.0f} s)")
    console.print(table)
    if json_out:
        json_out.write_text(json.dumps({"runs": runs, "best": best}, indent=1))


def best_of(figures: list[dict]) -> dict:
    """Per figure, the minimum over the rounds that ran; the first error where none ran."""
    ok = [f for f in figures if "error" not in f]
    if not ok:
        return figures[0]
    return {"import_s": min(f["import_s"] for f in ok), "init_s": min(f["init_s"] for f in ok),
            "call_ms": min(f["call_ms"] for f in ok), "providers": ok[-1]["providers"]}


def round_ratios(runs: dict, mode: str) -> str:
    """`mode` / stock per call in each round where both ran: how far apart the rounds are."""
    return " ".join(f"{u['call_ms'] / s['call_ms']:.2f}" for s, u in zip(runs["stock"], runs[mode])
                    if "error" not in s and "error" not in u)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:])
    elif sys.argv[1:2] == ["--learn"]:
        learn(sys.argv[2], float(sys.argv[3]))
    else:
        typer.run(main)
