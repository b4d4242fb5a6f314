"""A light guest: what an adapting uhop session costs a real program's process, against the same program on ONNX
Runtime alone, measured side by side in one run.

    python benchmarks/guest.py [--programs yolov8n,ocr-det,magika_files,...] [--modes stock,stock2,uhop]
                               [--rounds 3] [--seconds 120] [--idle-share 0] [--busy] [--cold | --cache DIR]
                               [--json out.json]

Programs: the real clients of tests/clients/ (the library's object built, then its public call cycled over the
client's inputs), and `yolov8n` (nudenet's shipped 320n.onnx) and `ocr-det` (rapidocr's shipped PP-OCRv6
detector) called directly, `InferenceSession(path, providers=["CPUExecutionProvider"]).run` on a fixed random
float32 input (1x3x320x320, 1x3x480x640), and, when named, `hf-bert` (a transformers BertModel from
benchmarks/corpus_models.py, TorchScript export) called on its corpus inputs. With `--idle-share F` the program
sleeps F/(1-F) times each call's duration after it, leaving that share of a core idle (a program with work of its
own between calls).

Modes: `stock` and `stock2` (ONNX Runtime alone, twice: stock2/stock is the A/A noise floor), `uhop` (the plain
swap `onnxruntime.InferenceSession = uhop_onnx.InferenceSession` before the library is imported; one cache folder
for the whole run, so round 1 is a program's first process and is reported apart, or with `--cold` an empty one
per process), `openvino` (yolov8n, ocr-det and hf-bert only: the model compiled by OpenVINO alone at f32, as
uhop serves it, the serving runtime alone when uhop decides on it), `litert` (corpus programs only: the model
converted to `.tflite` at its inputs' shapes by uhop's LiteRT converter, as uhop serves it, run by the LiteRT
interpreter alone). `/alone` is a process's peak over the openvino or litert process of its round. Each program runs every mode in a fresh
process per round, in a fresh shuffled order per round; `--busy` runs one busy-looping process beside them for
the whole run.

Each process measures itself: start_s (from the parent's spawn to the first result, imports included), calls in
`--seconds` and per 10 s window from the first call's end, its own peak RSS (VmHWM, children excluded), its
threads (at the end, and the most seen once a second), and what it changed process-wide (niceness of the process
and its threads, fd 2, logging's lastResort filters and root handlers, SIGINT/SIGTERM/SIGCHLD handlers). The
parent adds exit_s (the child's last statement to wait() returning) and leftovers: 3 s after a process ended, its
descendants still alive (the parent is a child subreaper, so orphans stay its own), counted (those whose command
line holds `uhop_onnx` apart), then killed. Ratios are to the stock process of the same round, window by window
for the worst 10 s window; the table shows the median over rounds, and `min/stock` the fastest start of a mode
over the rounds against stock's fastest (the floor under this VM's noise; `--seconds 1 --rounds 10` measures
starts alone).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "clients"))
import run as clients  # noqa: E402 -- tests/clients/run.py: the clients' registry and loader

# Model program -> (package, file inside it, the input shape where the model leaves a dimension free).
MODELS = {"yolov8n": ("nudenet", "320n.onnx", (1, 3, 320, 320)),
          "ocr-det": ("rapidocr", "models/PP-OCRv6_det_small.onnx", (1, 3, 480, 640))}
# Corpus models (`benchmarks/corpus_models.py`, their TorchScript export) called directly on their own inputs:
# `hf-bert`, a transformers BertModel, is one where another runtime is clearly faster than ONNX Runtime here.
CORPUS = ("hf-bert", "timm-resnet18")
MODES = ("stock", "stock2", "uhop", "openvino", "litert")
ALONE = ("openvino", "litert")  # a runtime uhop may serve, run alone
PACKAGE_DIRS = ("uhop_onnx", "partitioner", "providers", "custom_ops", "models")  # what installs as uhop_onnx
WINDOW_S = 10


def model_path(name: str) -> Path | None:
    """The shipped ONNX file of model program `name`, or None when its package is missing."""
    import importlib.util

    package, relative, _ = MODELS[name]
    spec = importlib.util.find_spec(package)
    path = Path(spec.origin).parent / relative if spec and spec.origin else None
    return path if path and path.is_file() else None


# ---------------------------------------------------------------- the child: one program in one mode


def handler_name(h) -> str:
    """A signal handler, as comparable text."""
    return h.name if isinstance(h, signal.Handlers) else repr(h)


def process_state() -> dict:
    """What a guest must leave as it found it, process-wide."""
    tids = os.listdir("/proc/self/task")
    nice = {}
    for tid in tids:
        try:
            nice[tid] = os.getpriority(os.PRIO_PROCESS, int(tid))
        except OSError:  # the thread ended meanwhile
            pass
    fd2 = os.fstat(2)
    return {"nice_process": os.getpriority(os.PRIO_PROCESS, 0), "nice_threads": sorted(set(nice.values())),
            "fd2": [fd2.st_dev, fd2.st_ino], "lastresort_filters": len(logging.lastResort.filters),
            "root_handlers": len(logging.getLogger().handlers),
            **{f"signal_{s.name}": handler_name(signal.getsignal(s))
               for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)}}


def changes(start: dict, end: dict) -> list[str]:
    """The entries of `end` that differ from `start` (threads at another niceness than the process began at)."""
    found = [f"{k}: {start[k]} -> {end[k]}" for k in start if k != "nice_threads" and start[k] != end[k]]
    if end["nice_threads"] != [start["nice_process"]]:
        found.append(f"nice_threads: {end['nice_threads']} (process began at {start['nice_process']})")
    return found


def make_program(program: str, mode: str):
    """(call, inputs, sessions): one call of `program` on an input, the inputs to cycle, its sessions described."""
    import onnxruntime  # every program imports it, the openvino one too

    if mode == "uhop":
        import uhop_onnx

        onnxruntime.InferenceSession = uhop_onnx.InferenceSession
    if program in CORPUS:  # the parent exported it and saved its inputs (`corpus_case`)
        import numpy as np

        path, feeds = os.environ["GUEST_MODEL"], dict(np.load(os.environ["GUEST_FEEDS"]))
        if mode == "openvino":
            import openvino

            compiled = openvino.Core().compile_model(path, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
            return (lambda x: compiled(x)), [feeds], lambda: {"model": {"module": "openvino", "providers": ["CPU"]}}
        if mode == "litert":
            return litert_program(os.environ["GUEST_TFLITE"], feeds)
        sess = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        return (lambda x: sess.run(None, x)), [feeds], lambda: described({"model": sess})
    if program not in MODELS:
        client = clients.load(program)
        app = client.build()
        return (lambda x: client.call(app, x)), client.inputs(), lambda: described(client.sessions(app))
    import numpy as np

    path, default = str(model_path(program)), MODELS[program][2]
    rng = np.random.default_rng(0)
    if mode == "openvino":
        import openvino

        # f32, as uhop serves it: OpenVINO's default on a host with AVX-512 BF16 computes in bf16, outside fp32's
        # tolerance of ONNX Runtime
        compiled = openvino.Core().compile_model(path, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        shape = [d.get_length() if d.is_static else s for d, s in zip(compiled.input(0).partial_shape, default)]
        x = rng.random(shape, dtype=np.float32)
        return (lambda x: compiled({0: x})), [x], lambda: {"model": {"module": "openvino", "providers": ["CPU"]}}
    sess = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    first = sess.get_inputs()[0]
    shape = [d if isinstance(d, int) else s for d, s in zip(first.shape, default)]
    x = rng.random(shape, dtype=np.float32)
    return (lambda x: sess.run(None, {first.name: x})), [x], lambda: described({"model": sess})


def described(sessions: dict) -> dict:
    """Per session: its class's module, the providers it reports and, for an adapting one, each bucket's
    decision."""
    found = clients.describe(sessions)
    for name, session in sessions.items():
        buckets = getattr(session, "adaptation", None) or {}
        found[name]["decisions"] = {key: bucket["decision"] for key, bucket in buckets.items()}
    return found


def child(program: str, mode: str, out: str, spawned: float, seconds: float, idle_share: float) -> None:
    """Runs `program` in `mode` for `seconds` after its first result and writes what it measured to `out`, then
    the instant of its last statement to `out`.end. Between calls it sleeps `idle_share / (1 - idle_share)` times
    the median of its latest calls (one slow call, a switch, does not stretch the pause after it), never past
    the end."""
    start = process_state()
    call, inputs, sessions = make_program(program, mode)
    pause = idle_share / (1 - idle_share)
    began = time.monotonic()
    call(inputs[0])
    first_end = time.monotonic()
    time.sleep(pause * (first_end - began))
    windows, calls, i, latest = [0] * int(seconds // WINDOW_S), 0, 1, collections.deque([first_end - began], 32)
    threads_max, next_sample = len(os.listdir("/proc/self/task")), first_end + 1
    while (now := time.monotonic()) - first_end < seconds:
        call(inputs[i % len(inputs)])
        i, done = i + 1, time.monotonic()
        if done - first_end < seconds:
            calls += 1
            if int((done - first_end) // WINDOW_S) < len(windows):
                windows[int((done - first_end) // WINDOW_S)] += 1
        if done >= next_sample:
            threads_max, next_sample = max(threads_max, len(os.listdir("/proc/self/task"))), done + 1
        latest.append(done - now)
        time.sleep(max(0.0, min(pause * statistics.median(latest), seconds - (time.monotonic() - first_end))))
    try:
        described = sessions()
    except Exception as e:  # a session that cannot say what it is is a finding, not a crash
        described = {"error": f"{type(e).__name__}: {e}"}
    threads_end = len(os.listdir("/proc/self/task"))
    end = process_state()
    hwm = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM"))
    Path(out).write_text(json.dumps({
        "start_s": first_end - spawned, "first_call_s": first_end - began, "calls": calls, "windows": windows,
        "peak_mib": int(hwm.split()[1]) / 1024, "threads_end": threads_end,
        "threads_max": max(threads_max, threads_end),
        "idle_share": idle_share, "state_start": start, "state_end": end, "changes": changes(start, end),
        "sessions": described}))
    Path(out + ".end").write_text(repr(time.monotonic()))


# ---------------------------------------------------------------- the parent


def descendants(root: int) -> dict[int, tuple[str, str]]:
    """Live processes below `root`: pid -> (state, command line)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
            table[int(entry)] = (int(ppid), state, cmd.strip())
    below = {}
    for pid, (ppid, state, cmd) in table.items():
        up = ppid
        while up > 1 and up != root and up in table:
            up = table[up][0]
        if up == root:
            below[pid] = (state, cmd)
    return below


def sweep(known: set[int]) -> list[str]:
    """Kills (and reaps) this process's descendants other than `known`; the command lines of the live ones."""
    left = []
    for pid, (state, cmd) in descendants(os.getpid()).items():
        if pid in known:
            continue
        if state != "Z":
            left.append(cmd)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(pid, 0)  # an orphan that came to us as subreaper; others' children are reaped by them
        except ChildProcessError:
            pass
    return left


def corpus_case(program: str, work: Path, mode: str) -> dict[str, str]:
    """A corpus program's model file and its inputs saved in `work` (and for `litert`, the model converted at
    their shapes), as the environment its processes read."""
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from benchmarks.corpus_models import case

    path, feeds = case(program)
    np.savez(work / f"{program}.npz", **feeds)
    tflite = work / f"{program}.tflite"
    if mode == "litert" and not tflite.exists():
        from uhop_onnx.model.loader import load
        from uhop_onnx.model.simplify import at_fixed_shapes
        from uhop_onnx.providers.litert.converter import convert

        tflite.write_bytes(convert(at_fixed_shapes(load(path), {k: v.shape for k, v in feeds.items()})))
    return {"GUEST_MODEL": str(path), "GUEST_FEEDS": str(work / f"{program}.npz"), "GUEST_TFLITE": str(tflite)}


def litert_program(path: str, feeds: dict):
    """(call, inputs, sessions) of a `.tflite` model on the LiteRT interpreter alone, on every core, fed and read
    by the ONNX names its inputs and outputs carry."""
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=path, num_threads=os.cpu_count())
    interpreter.allocate_tensors()
    ins = [(d["name"], d["index"], d["dtype"]) for d in interpreter.get_input_details()]
    outs = [d["index"] for d in interpreter.get_output_details()]

    def call(x):
        for name, index, dtype in ins:
            interpreter.set_tensor(index, x[name].astype(dtype))
        interpreter.invoke()
        return [interpreter.get_tensor(index) for index in outs]

    return call, [feeds], lambda: {"model": {"module": "ai_edge_litert", "providers": ["CPU"]}}


def run_one(program: str, mode: str, seconds: float, idle_share: float, cache: str, work: Path,
            known: set[int]) -> dict:
    """One program in one mode in a fresh process: what it measured, with exit_s and its leftovers."""
    out = str(work / f"{program}-{mode}-{len(os.listdir(work))}.json")
    env = {**os.environ, **(corpus_case(program, work, mode) if program in CORPUS else {})}
    if mode == "uhop":
        env["UHOP_CACHE_DIR"] = cache
    with open(out + ".log", "w") as log:
        spawned = time.monotonic()
        child_ = subprocess.Popen([sys.executable, __file__, "--child", program, mode, out, repr(spawned),
                                   str(seconds), str(idle_share)], env=env, stdout=log, stderr=log)
        try:
            rc = child_.wait(timeout=seconds + 900)
        except subprocess.TimeoutExpired:
            child_.kill()
            rc = child_.wait()
        waited = time.monotonic()
    time.sleep(3)
    left = sweep(known | {child_.pid})
    found = {"program": program, "mode": mode, "rc": rc, "leftovers": sum("uhop_onnx" in c for c in left),
             "leftover_cmdlines": left}
    try:
        found.update(json.loads(Path(out).read_text()))
        found["exit_s"] = waited - float(Path(out + ".end").read_text())
    except (OSError, ValueError):
        tail = Path(out + ".log").read_text(errors="replace").strip().splitlines()[-3:]
        found["error"] = f"rc {rc}: " + " | ".join(tail)
    return found


def host() -> dict:
    """CPU model, AVX-512 flags, cores."""
    info = Path("/proc/cpuinfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    avx512 = sorted({w for ln in info.splitlines() if ln.startswith("flags") for w in ln.split()
                     if w.startswith("avx512")})
    return {"cpu": model, "avx512": avx512, "cores": os.cpu_count()}


def ratio(a, b):
    """a / b, or None where either is missing (or b is 0)."""
    return a / b if a is not None and b else None


def compare(run: dict, stock: dict, alone: dict | None) -> dict:
    """One process's figures, and its ratios to the stock process (and the openvino or litert one) of its round."""
    worst = min((w / s for w, s in zip(run["windows"], stock["windows"]) if s), default=None)
    return {"calls": run["calls"], "calls_ratio": ratio(run["calls"], stock["calls"]), "worst_window_ratio": worst,
            "start_s": run["start_s"], "start_ratio": ratio(run["start_s"], stock["start_s"]),
            "exit_s": run["exit_s"], "exit_minus_stock_s": run["exit_s"] - stock["exit_s"],
            "peak_mib": run["peak_mib"], "peak_ratio": ratio(run["peak_mib"], stock["peak_mib"]),
            "peak_ratio_alone": ratio(run["peak_mib"], alone["peak_mib"]) if alone else None,
            "threads_end": run["threads_end"], "threads_max": run["threads_max"], "leftovers": run["leftovers"]}


def summarize(runs: list[dict], modes: list[str], shared_cache: bool) -> dict:
    """Rows of one program: per mode the median over rounds of `compare` (uhop's round 1 apart with a shared
    cache), with every process-wide change seen and every error."""
    rounds = sorted({r["round"] for r in runs})
    by = {(r["round"], r["mode"]): r for r in runs}
    rows = {}
    for mode in modes:
        groups = [(mode, rounds)]
        if mode == "uhop" and shared_cache:
            groups = [("uhop, first process", rounds[:1])] + ([("uhop, later", rounds[1:])] if len(rounds) > 1 else [])
        for label, rs in groups:
            mine = [by[(r, mode)] for r in rs if (r, mode) in by]
            good = [(by[(r, mode)], by.get((r, "stock")), next((by[(r, m)] for m in ALONE if (r, m) in by), None))
                    for r in rs if (r, mode) in by]
            good = [(m, s, o if o and "error" not in o else None) for m, s, o in good
                    if "error" not in m and s and "error" not in s]
            per = [compare(m, s, o) for m, s, o in good]
            row = {k: statistics.median(v) if (v := [p[k] for p in per if p[k] is not None]) else None
                   for k in (per[0] if per else {})}
            row["start_min_s"] = min((p["start_s"] for p in per), default=None)  # the floor under the noise
            row["leftovers"] = max((p["leftovers"] for p in per), default=None)
            row["changes"] = sorted({c for m in mine for c in m.get("changes", [])})
            row["left_behind"] = sorted({c[:160] for m in mine for c in m["leftover_cmdlines"]})
            row["errors"] = [m["error"] for m in mine if "error" in m]
            row["rounds"] = len(per)
            rows[label] = row
    return rows


def fmt(v, spec: str) -> str:
    """`v` formatted by `spec`, or a dash as wide."""
    return format(v, spec) if v is not None else "-".rjust(len(format(0, spec)))


def print_table(program: str, rows: dict) -> None:
    print(f"\n{program}  (ratios to the stock process of the same round, median over rounds; min start: the "
          "fastest start over the rounds, over stock's)")
    print(f"  {'mode':<20} {'calls':>6} {'/stock':>6} {'worst10s':>8} {'start s':>7} {'/stock':>6} {'min/stock':>9} "
          f"{'exit s':>6} {'-stock':>6} {'peak MiB':>8} {'/stock':>6} {'/alone':>6} {'thr end/max':>11} {'left':>4}")
    floor = rows.get("stock", {}).get("start_min_s")
    for label, r in rows.items():
        if r["rounds"]:
            print(f"  {label:<20} {fmt(r['calls'], '6.0f')} {fmt(r['calls_ratio'], '6.2f')} "
                  f"{fmt(r['worst_window_ratio'], '8.2f')} {fmt(r['start_s'], '7.2f')} {fmt(r['start_ratio'], '6.2f')} "
                  f"{fmt(ratio(r['start_min_s'], floor), '9.2f')} "
                  f"{fmt(r['exit_s'], '6.2f')} {fmt(r['exit_minus_stock_s'], '+6.2f')} {fmt(r['peak_mib'], '8.0f')} "
                  f"{fmt(r['peak_ratio'], '6.2f')} {fmt(r['peak_ratio_alone'], '6.2f')} "
                  f"{fmt(r['threads_end'], '.0f'):>5}/{fmt(r['threads_max'], '<5.0f')} {fmt(r['leftovers'], '4d')}")
        for c in r["changes"]:
            print(f"  {'':<20} changed: {c}")
        for c in r["left_behind"]:
            print(f"  {'':<20} left behind: {c}")
        for e in r["errors"]:
            print(f"  {label:<20} error: {e[-300:]}")


def programs_here(asked: list[str]) -> list[str]:
    """The programs of `asked` that can run here, with a line for each that cannot."""
    kept = []
    for name in asked:
        why = (None if model_path(name) else f"{MODELS[name][0]} not installed") if name in MODELS else None if (
            name in CORPUS) else (
            clients.missing(name) if name in clients.CLIENTS else "unknown program")
        if why:
            print(f"skipped {name}: {why}")
        else:
            kept.append(name)
    return kept


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", default=",".join([*MODELS, *clients.CLIENTS]))
    parser.add_argument("--modes", default="stock,stock2,uhop")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--idle-share", type=float, default=0.0)
    parser.add_argument("--busy", action="store_true", help="a busy-looping process beside every measured one")
    parser.add_argument("--cold", action="store_true", help="an empty uhop cache folder for every uhop process")
    parser.add_argument("--cache", type=Path, help="this uhop cache folder for the run, as it is (the decisions an "
                        "earlier run kept): every uhop process is a later one")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if "stock" not in modes or set(modes) - set(MODES) or not 0 <= args.idle_share < 1:
        parser.error(f"--modes must include stock and name only {', '.join(MODES)}; --idle-share is in [0, 1)")
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans stay ours to count
    facts = {**host(), "load_start": os.getloadavg()}
    print(f"host: {facts['cpu']}, {facts['cores']} cores, avx512: {' '.join(facts['avx512']) or 'none'}, "
          f"load at start {' '.join(f'{x:.2f}' for x in facts['load_start'])}")
    print(f"{args.rounds} rounds x {args.seconds:g} s, idle share {args.idle_share:g}, busy neighbour: {args.busy}, "
          f"uhop cache: {'empty per process' if args.cold else args.cache or 'one for the run'}")
    # uhop-onnx's modules compiled beside their sources, as installing it compiles them: a source checkout run with
    # PYTHONDONTWRITEBYTECODE would compile them again in every uhop process and count that in its start
    subprocess.run([sys.executable, "-m", "compileall", "-q", *(str(ROOT / d) for d in PACKAGE_DIRS)], check=True)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    known = {busy.pid} if busy else set()
    runs, summary = [], {}
    try:
        with tempfile.TemporaryDirectory(prefix="guest-") as tmp:
            work, shared = Path(tmp), str(args.cache or tempfile.mkdtemp(prefix="cache-", dir=tmp))
            for program in programs_here(args.programs.split(",")):
                here = [m for m in modes if m == "openvino" and program in (*MODELS, *CORPUS)
                        or m == "litert" and program in CORPUS or m not in ALONE]
                mine = []
                for r in range(1, args.rounds + 1):
                    order = random.sample(here, len(here))
                    for mode in order:
                        cache = tempfile.mkdtemp(prefix="cache-", dir=tmp) if args.cold else shared
                        found = run_one(program, mode, args.seconds, args.idle_share, cache, work, known)
                        mine.append({"round": r, "order": order, **found})
                        said = found.get("error") or (f"{found['calls']} calls, start {found['start_s']:.2f} s, "
                                                      f"peak {found['peak_mib']:.0f} MiB")
                        print(f"  {program} round {r} {mode}: {said}", flush=True)
                summary[program] = summarize(mine, here, not args.cold and not args.cache)
                print_table(program, summary[program])
                runs += mine
    finally:
        if busy:
            busy.kill()
            busy.wait()
    facts["load_end"] = os.getloadavg()
    print(f"\nload at end {' '.join(f'{x:.2f}' for x in facts['load_end'])}")
    if args.json:
        args.json.write_text(json.dumps({"host": facts, "options": {k: str(v) if isinstance(v, Path) else v
                                                                     for k, v in vars(args).items()},
                                         "summary": summary, "runs": runs}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        program, mode, out, spawned, seconds, idle = sys.argv[2:8]
        child(program, mode, out, float(spawned), float(seconds), float(idle))
    else:
        main(sys.argv[1:])
