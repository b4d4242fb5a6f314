"""Adaptive sessions against ONNX Runtime, side by side, on models none of our builders made.

For each model, at the shapes its users call it with:
- start: cold-cache construction plus first call, uhop-onnx against ONNX Runtime, each in a fresh process (a
  fresh cache for uhop-onnx), in alternating rounds; the minimum over rounds; imports reported apart;
- curve: one adaptive session called until it has decided (or `--settle` seconds): its latency over calls,
  in windows, with the calls and seconds it took to decide and what it decided;
- steady: ONNX Runtime and OpenVINO run directly, LiteRT alone, and the adaptive session after its warm-up
  (from the decision the curve run kept, called back to back until it has decided again, before the other
  workers start building), each in its own worker process, in alternating rounds
  (`measure.time_candidates`), `--processes` of each (fresh processes land differently on a shared VM: the
  same plan has measured 1.6x apart in two of them); per runtime the minimum of the round medians over its
  processes (each process's shown), and uhop-onnx over the fastest single runtime; then the session and that
  runtime once more, beside the same runtime in as many other processes: a uhop-onnx/runtime ratio no further
  from 1 than that runtime's ratio to itself is within the noise between processes (one sample of it).

    python benchmarks/adapt.py [--models yolov8n,ocr-det,...] [--rounds 3] [--settle 90] [--processes 3]
                               [--start-only]

A model name that is not one of the shipped ones is a corpus model (`benchmarks/corpus_models.py`, e.g.
`timm-resnet18` or `hf-bert@dynamo`: TorchScript's export unless `@exporter` says otherwise; `int8-qdq` and the
other files other tools write), measured at the first of its sizes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import corpus_models as corpus  # noqa: E402
from uhop_onnx.runtime.measure import Candidate, time_candidates  # noqa: E402


def _shipped(package: str, relative: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    path = Path(spec.origin).parent / relative if spec and spec.origin else None
    return path if path and path.is_file() else None


def _feeds(shapes: dict[str, tuple], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.random(shape, dtype=np.float32) for name, shape in shapes.items()}


# name -> (model path or None when its package is missing, the shapes its library calls it with)
MODELS = {
    "yolov8n": (_shipped("nudenet", "320n.onnx"), {"images": (1, 3, 320, 320)}),
    "ocr-det": (_shipped("rapidocr", "models/PP-OCRv6_det_small.onnx"), {"x": (1, 3, 480, 640)}),
    "ocr-rec": (_shipped("rapidocr", "models/PP-OCRv6_rec_small.onnx"), {"x": (1, 3, 48, 320)}),
    "magika": (_shipped("magika", "models/standard_v3_3/model.onnx"), None),
    "vad": (_shipped("silero_vad", "data/silero_vad.onnx"), None),
    "encoder": (ROOT / "models" / "example_encoder.onnx", None),
}


def model_feeds(name: str) -> dict[str, np.ndarray]:
    path, shapes = MODELS[name]
    if name == "magika":
        return {"bytes": np.random.default_rng(0).integers(0, 257, (1, 2048)).astype(np.int32)}
    if name == "vad":  # silero_vad's OnnxWrapper: 512 samples at 16 kHz after 64 of context, and its state
        audio = np.random.default_rng(0).standard_normal((1, 576)).astype(np.float32) * 0.1
        return {"input": audio, "state": np.zeros((2, 1, 128), np.float32), "sr": np.array(16000, np.int64)}
    if name == "encoder":
        return {"input_ids": np.random.default_rng(0).integers(0, 64, (1, 128)).astype(np.int64)}
    return _feeds(shapes)


def start(mode: str, model: str, feeds_path: str) -> dict:
    """In this (fresh) process: imports, then construction and first call."""
    begin = time.perf_counter()
    import onnxruntime

    if mode == "uhop":
        import uhop_onnx.products.session  # noqa: F401 - its import counted apart, as ONNX Runtime's
    imported = time.perf_counter()
    feeds = dict(np.load(feeds_path))
    if mode == "uhop":
        import uhop_onnx

        session = uhop_onnx.InferenceSession(model)
    else:
        session = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    built = time.perf_counter()
    session.run(None, feeds)
    done = time.perf_counter()
    return {"import_s": imported - begin, "construct_s": built - imported, "first_call_s": done - built}


def curve(model: str, feeds_path: str, settle: float) -> dict:
    """One adaptive session called until every bucket has decided: latency per call and what it decided."""
    import uhop_onnx

    feeds = dict(np.load(feeds_path))
    session = uhop_onnx.InferenceSession(model)
    times, begin = [], time.perf_counter()
    while time.perf_counter() - begin < settle:
        start_call = time.perf_counter()
        session.run(None, feeds)
        times.append((time.perf_counter() - start_call) * 1e3)
        if _decided(session):
            break
    seconds = time.perf_counter() - begin
    result = {"calls": len(times), "seconds": seconds, "decided": _decided(session), "ms": times,
              "adaptation": session.adaptation, "providers": session.get_providers()}
    session.close()
    return result


def _decided(session) -> bool:
    buckets = session.adaptation.values()
    return bool(buckets) and all(b["decision"] for b in buckets)


# Both sides import compiled bytecode, as an installed package does (pip compiles it): a source checkout run
# with PYTHONDONTWRITEBYTECODE would otherwise compile uhop-onnx's modules again in every fresh process.
PYCACHE = Path(tempfile.mkdtemp(prefix="uhop-adapt-bench-pycache-"))


def _in_process(command: list[str], env: dict | None = None) -> dict:
    env = {k: v for k, v in (env or os.environ).items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(PYCACHE)
    done = subprocess.run([sys.executable, __file__, *command], capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(name: str, rounds: int, settle: float, start_only: bool, processes: int) -> None:
    path, feeds = corpus.case(name) if name not in MODELS else (MODELS[name][0], None)
    if path is None:
        print(f"{name}: skipped (its package is not installed)")
        return
    feeds = model_feeds(name) if feeds is None else feeds
    work = Path(tempfile.mkdtemp(prefix="uhop-adapt-bench-"))
    feeds_path = work / "feeds.npz"
    np.savez(feeds_path, **feeds)
    shapes = ", ".join(f"{k}: {'x'.join(map(str, v.shape))}" for k, v in feeds.items())
    print(f"\n== {name} ({path.name}) at {shapes}")
    starts: dict[str, list[dict]] = {"ort": [], "uhop": []}
    _in_process(["start", "uhop", str(path), str(feeds_path)], {**os.environ, "UHOP_CACHE_DIR": str(work / "warm")})
    for r in range(rounds):
        for mode in ("ort", "uhop") if r % 2 == 0 else ("uhop", "ort"):
            env = {**os.environ, "UHOP_CACHE_DIR": str(work / f"cold-{r}")}
            starts[mode].append(_in_process(["start", mode, str(path), str(feeds_path)], env))
    best = {m: min((s for s in runs if "error" not in s), key=lambda s: s["construct_s"] + s["first_call_s"],
                   default=None) for m, runs in starts.items()}
    for mode, b in best.items():
        if b is None:
            print(f"  start {mode}: failed: {starts[mode][0]['error']}")
    if all(best.values()):
        o, u = (best[m]["construct_s"] + best[m]["first_call_s"] for m in ("ort", "uhop"))
        print(f"  start (construction + first call, cold cache, min of {rounds}): ort {o * 1e3:.0f} ms, "
              f"uhop {u * 1e3:.0f} ms, ratio {u / o:.2f}; imports ort {best['ort']['import_s']:.2f} s, "
              f"uhop {best['uhop']['import_s']:.2f} s")
    if start_only:
        return
    env = {**os.environ, "UHOP_CACHE_DIR": str(work / "kept")}
    c = _in_process(["curve", str(path), str(feeds_path), str(settle)], env)
    if "error" in c:
        print(f"  curve: failed: {c['error']}")
    else:
        ms = np.array(c["ms"])
        windows = np.array_split(ms, min(10, len(ms)))
        print(f"  curve: decided={c['decided']} after {c['calls']} calls in {c['seconds']:.1f} s; "
              f"now on {', '.join(c['providers'])}")
        print("    median ms per tenth of the calls: " + " ".join(f"{np.median(w):.2f}" for w in windows))
        for bucket in c["adaptation"].values():
            tried = ", ".join(f"{t['label']} {t['state']}" for t in bucket["candidates"])
            print(f"    {bucket['bucket']}: {bucket['decision']} [{tried}]")
    os.environ["UHOP_CACHE_DIR"] = str(work / "kept")  # the steady session starts on what the curve kept
    # the session warms up (and re-checks what the curve kept) first, alone: the others build after it
    runtimes = [("uhop adaptive", str(settle), "uhop_onnx.products.bench:adapted"),
                ("onnxruntime", "onnxruntime", "uhop_onnx.products.bench:raw_runtime"),
                ("openvino", "openvino", "uhop_onnx.products.bench:raw_runtime"),
                ("litert", "litert", "uhop_onnx.products.bench:provider_alone")]
    steady = _steady(runtimes, path, feeds, rounds, processes)
    singles = {n: f["ms"] for n, f in steady.items() if n != "uhop adaptive" and f["ms"] is not None}
    for n, f in steady.items():
        print(f"  steady {n:14s} {_figure(f)}  (per process: {f['each']})  {' > '.join(f['stages'])}")
    uhop = steady["uhop adaptive"]["ms"]
    if uhop is None or not singles:
        return
    fastest = min(singles, key=singles.get)
    print(f"  steady: uhop / fastest single runtime ({fastest}) = {uhop / singles[fastest]:.3f}")
    # the noise between processes: the session and the fastest runtime again, beside that runtime measured twice
    spec = next(r for r in runtimes if r[0] == fastest)
    duel = _steady([runtimes[0], spec, (f"{fastest} again", *spec[1:])], path, feeds, rounds, processes)
    for n, f in duel.items():
        print(f"  again  {n:14s} {_figure(f)}  (per process: {f['each']})")
    ms = [f["ms"] for f in duel.values()]
    if None not in ms:
        print(f"  steady, measured again: uhop / {fastest} = {ms[0] / ms[1]:.3f}; {fastest} / {fastest} in other "
              f"processes (the noise between processes) = {ms[2] / ms[1]:.3f}")


def _steady(runtimes: list[tuple[str, str, str]], path: Path, feeds: dict, rounds: int, processes: int) -> dict:
    """Per runtime (name, spec, builder), its figure over `processes` worker processes of it, all measured in
    alternating rounds; each worker is ready before the next starts building (an adaptive session warms up
    alone)."""
    candidates = [Candidate(f"{name} #{k + 1}", spec, build)
                  for k in range(processes) for name, spec, build in runtimes]
    figures = time_candidates(candidates, str(path), feeds, None, rounds=max(5, rounds), one_by_one=True)
    return {name: _over_processes([figures[f"{name} #{k + 1}"] for k in range(processes)]) for name, *_ in runtimes}


def _figure(f: dict) -> str:
    return f"{f['ms']:.3f} ms" if f["ms"] is not None else f"failed: {f['error']}"


def _over_processes(figures: list[dict]) -> dict:
    """One runtime's figure over its processes: the least of their minimums of round medians (a failed
    process counts for nothing: every one failing is a failure), each process's figure, the fastest's stages."""
    done = [f for f in figures if f["ms"] is not None]
    each = " ".join(f"{f['ms']:.3f}" if f["ms"] is not None else "failed" for f in figures)
    if not done:
        return {"ms": None, "error": figures[0]["error"], "each": each, "stages": []}
    best = min(done, key=lambda f: f["ms"])
    return {"ms": best["ms"], "error": None, "each": each, "stages": best["stages"]}


def main() -> None:
    if sys.argv[1:2] == ["start"]:
        print(json.dumps(start(*sys.argv[2:5])))
        return
    if sys.argv[1:2] == ["curve"]:
        print(json.dumps(curve(sys.argv[2], sys.argv[3], float(sys.argv[4]))))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle", type=float, default=90.0, help="seconds a session may take to decide")
    parser.add_argument("--processes", type=int, default=3, help="steady: worker processes per runtime")
    parser.add_argument("--start-only", action="store_true", help="measure the start only (no curve, no steady)")
    args = parser.parse_args()
    print(f"cpu: {_cpu()}; load average {os.getloadavg()[0]:.1f}")
    for name in args.models.split(","):
        compare(name, args.rounds, args.settle, args.start_only, args.processes)


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
