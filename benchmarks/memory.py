"""Peak memory of `uhop-onnx optimize` beside ONNX Runtime's running the same model, each in a fresh process.

    python benchmarks/memory.py [--models default|all|NAME[:EXPORTER],...] [--budget 30] [--json out.json]

Per model, three processes, each its own peak resident set (`VmHWM`, read as it exits):
- ONNX Runtime: imports `onnxruntime`, builds an `InferenceSession` of the model on `CPUExecutionProvider`
  and runs it at the measured shapes, once and (in another process) `CALLS` times, as a program's loop does:
  ONNX Runtime's second call takes more than its first (its memory pattern, planned on the first, is allocated
  as one block), and the processes `optimize` times plans in run each many times;
- `uhop-onnx optimize MODEL --shape ... -o OUT --budget B` with a cache folder of its own (`UHOP_CACHE_DIR`,
  holding a copy of this host's kernels library, built once per host); its worker processes are reported
  apart (the largest of them, looked at every 50 ms);
- the import floor: a process that imports what `optimize` imports (the CLI and the optimizer) and lists the
  providers present (`providers.resolve`, which imports neither OpenVINO nor LiteRT for it), and nothing else;
- the runtimes' floor: a process that imports every runtime present (onnxruntime, openvino, LiteRT's
  interpreter) and builds nothing: what a process measuring them all pays before it holds a model.
The ratio is optimize's peak over ONNX Runtime's after `CALLS` calls (in the JSON, `ratio` and `tree_over_bar`
are against one call, as before `CALLS` was measured; `ratio_ort_calls` and `tree_over_bar_ort_calls` against
`CALLS` calls); the tree's peak (the largest of optimize and
its workers, what `/usr/bin/time` reports for the tree) is held against 2x ONNX Runtime's peak plus the runtimes'
floor, with ONNX Runtime's peak after `CALLS` calls and, beside it, after one.
Models: the corpus (`benchmarks/corpus_models.py`; a name alone is its TorchScript export, `NAME:dynamo` the dynamo
one, a file of another tool `NAME:file`), the shipped `models/*.onnx`, and the models PyPI packages ship that
`benchmarks/adapt.py` names with their shapes (`yolov8n`, `ocr-det`, `ocr-rec`); `default` is the set the
README's table lists.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import typer

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ("timm-resnet18:dynamo,timm-mobilenetv3,hf-bert,hf-bert:dynamo,hf-gpt2-past,torch-lstm-gru-speech,"
           "paddle-dims:file,if-loop:file,external-data:file,example_mobilenet,example_encoder")
CALLS = 10  # ONNX Runtime's calls of the model in its process (a program's loop), beside one call
SHIPPED = {"example_mobilenet": {}, "example_encoder": {"input_ids": (1, 128)}}  # model stem -> measured shapes

# Each child writes its own peak, and the largest of its descendants' (optimize's workers, looked at every
# 50 ms), in KiB to $UHOP_MEMORY_REPORT. VmHWM, not ru_maxrss: a child's ru_maxrss starts from its parent's
# size when it was forked.
REPORT = """
import atexit, json, os, threading, time
def _hwm(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return 0
def _descendants(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        return []
    return children + [d for c in children for d in _descendants(c)]
_workers = [0]
def _watch():
    while True:
        _workers[0] = max([_workers[0], *map(_hwm, _descendants(os.getpid()))])
        time.sleep(0.05)
threading.Thread(target=_watch, daemon=True).start()
def _report():
    with open(os.environ["UHOP_MEMORY_REPORT"], "w") as f:
        json.dump([_hwm(os.getpid()), _workers[0]], f)
atexit.register(_report)
"""
ORT = REPORT + """
import sys, json
import numpy as np
import onnxruntime as ort
path, shapes = sys.argv[1], json.loads(sys.argv[2])
session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
types = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
         "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8, "tensor(uint8)": np.uint8,
         "tensor(bool)": np.bool_}
feeds = {i.name: np.ones(shapes.get(i.name) or [d if isinstance(d, int) and d > 0 else 1 for d in i.shape],
                         types[i.type]) for i in session.get_inputs()}
for _ in range(int(sys.argv[3]) if len(sys.argv) > 3 else 1):
    session.run(None, feeds)
"""
OPTIMIZE = REPORT + """
from uhop_onnx.cli import main
main()
"""
FLOOR = REPORT + """
import uhop_onnx.cli, uhop_onnx.products.optimizer
from uhop_onnx.providers import resolve
resolve(None)
"""
RUNTIMES = REPORT + """
import importlib
import onnxruntime
for name in ("openvino", "ai_edge_litert.interpreter"):
    try:
        importlib.import_module(name)
    except ImportError:
        pass
"""


def model_and_shapes(name: str) -> tuple[Path, dict[str, tuple[int, ...]]]:
    """A corpus model's file (exported or written, cached) and the shapes it is measured at, or a shipped
    model's."""
    if name in SHIPPED:
        return ROOT / "models" / f"{name}.onnx", SHIPPED[name]
    sys.path.insert(0, str(ROOT))
    from benchmarks.adapt import MODELS as PACKAGED

    if name in PACKAGED and PACKAGED[name][1]:  # a model a PyPI package ships, at its library's shapes
        if PACKAGED[name][0] is None:
            raise FileNotFoundError(f"{name}: the package that ships it is not installed")
        return PACKAGED[name][0], PACKAGED[name][1]
    from benchmarks import corpus_models as corpus

    base, _, exporter = name.partition(":")
    if exporter == "file":
        f = corpus.file_spec(base)
        return corpus.written(f), f.inputs_spec.shapes(0)
    corpus.import_torchvision()
    s = corpus.spec(base)
    return corpus.exported(s, exporter or "torchscript"), s.shapes(0)


def peak(script: str, args: list[str], env: dict[str, str] | None = None) -> tuple[int, int]:
    """The peak RSS (MiB) of a fresh `python -c script args` and of the largest of its children; `SystemExit`
    with its output when it fails."""
    with tempfile.TemporaryDirectory(prefix="uhop-memory-") as work:
        report = Path(work, "report.json")
        done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                              env={**os.environ, **(env or {}), "UHOP_MEMORY_REPORT": str(report)})
        if done.returncode or not report.is_file():
            raise SystemExit(f"{args[:2]} failed ({done.returncode}): {(done.stderr or done.stdout).strip()[-2000:]}")
        own, children = json.loads(report.read_text())
    return own // 1024, children // 1024


def optimize_peak(model: Path, shapes: dict[str, tuple[int, ...]], budget: float, work: Path,
                  options: list[str] = ()) -> tuple[int, int]:
    """`peak` of `uhop-onnx optimize` (with more `options`) with a cache folder of its own under `work`."""
    from uhop_onnx.foundation.cache import cache_dir

    cache = work / "cache"
    if (cache_dir() / "kernels").is_dir():
        shutil.copytree(cache_dir() / "kernels", cache / "kernels")
    shaped = [a for name, dims in shapes.items() for a in ("--shape", f"{name}:{'x'.join(map(str, dims))}")]
    return peak(OPTIMIZE, ["optimize", str(model), "-o", str(work / "plan"), "--budget", str(budget), "--quiet",
                           *shaped, *options], {"UHOP_CACHE_DIR": str(cache)})


def main(models: str = typer.Option("default", help="default, all, or NAME[:EXPORTER],... (see the docstring)"),
         budget: float = 30.0, json_out: Path | None = typer.Option(None, "--json")) -> None:
    names = DEFAULT.split(",") if models == "default" else _all() if models == "all" else models.split(",")
    floor, _ = peak(FLOOR, [])
    runtimes, _ = peak(RUNTIMES, [])
    print(f"import floor (uhop-onnx's imports, the providers present listed): {floor} MiB; the runtimes' floor "
          f"(every runtime present imported): {runtimes} MiB", flush=True)
    print(f"{'model':34} {'ORT MiB, 1 call':>16} {f'{CALLS} calls':>9} {'optimize MiB':>13} {'workers MiB':>12} "
          f"{'ratio':>6} {'tree / (2 ORT + runtimes)':>26} {'(ORT 1 call)':>13}", flush=True)
    rows = {}
    for name in names:
        try:
            model, shapes = model_and_shapes(name)
        except Exception as error:  # noqa: BLE001 - an exporter's limit (ExportFailed) or a missing package
            print(f"{name:34} not measured: {str(error).splitlines()[0][:80]}", flush=True)
            continue
        once, _ = peak(ORT, [str(model), json.dumps(shapes)])
        ort, _ = peak(ORT, [str(model), json.dumps(shapes), str(CALLS)])
        with tempfile.TemporaryDirectory(prefix="uhop-memory-") as work:
            own, workers = optimize_peak(model, shapes, budget, Path(work))
        bar, bar_once = (round(max(own, workers) / (2 * o + runtimes), 2) for o in (ort, once))
        rows[name] = {"ort_mib": once, "ort_calls_mib": ort, "optimize_mib": own, "workers_mib": workers,
                      "ratio": round(own / once, 2), "ratio_ort_calls": round(own / ort, 2),
                      "tree_over_bar": bar_once, "tree_over_bar_ort_calls": bar}
        print(f"{name:34} {once:16d} {ort:9d} {own:13d} {workers:12d} {own / ort:6.2f} {bar:26.2f} {bar_once:13.2f}",
              flush=True)
    if json_out:
        json_out.write_text(json.dumps({"floor_mib": floor, "runtimes_floor_mib": runtimes, "budget_s": budget,
                                        "models": rows}, indent=2) + "\n")


def _all() -> list[str]:
    """Every corpus model (both exporters), every file of another tool, and the shipped models."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import corpus_models as corpus

    return ([f"{s.name}:{e}" for s in corpus.TORCH_MODELS for e in corpus.EXPORTERS]
            + [f"{f.name}:file" for f in corpus.FILES] + list(SHIPPED))


if __name__ == "__main__":
    typer.run(main)
