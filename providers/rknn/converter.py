"""ONNX stages to `.rknn`, and the simulator, through rknn-toolkit2 running in its own virtual environment.

`Toolkit` starts `worker.py` under the toolkit's Python on first use and keeps it for later requests
(the toolkit takes seconds to import). Each `Toolkit` holds at most one model in the simulator;
`SimulatorRunner` runs a stage there.
"""

from __future__ import annotations

import json
import re
import select
import subprocess
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from uhop_onnx.foundation.errors import ProviderError, logger

from ..base import output_dtypes
from ..runner import Runner
from .runner import named_outputs
from .setup import is_ready, venv_path, venv_python
from .table import DTYPES, RKNN_TABLE, TARGETS

if TYPE_CHECKING:
    import onnx

log = logger(__name__)

PROTOCOL = 1
WORKER = Path(__file__).with_name("worker.py")
TIMEOUT = 600.0  # seconds for one request
IR_VERSION = 10  # the newest IR version the toolkit's onnx reads
# A build that fails in one of the toolkit's graph-fusion rules names the rule to disable in its log; the build
# is tried again without it (at most this many rules), and the simulator checks what it then makes.
ADVICE = re.compile(r"disable_rules=\['(\w+)'\]")
MOST_RULES = 3


class Toolkit:
    """A worker process of rknn-toolkit2 in the venv at `venv` (default: `setup.venv_path()`). It holds one
    conversation at a time: requests from several threads take turns."""

    def __init__(self, venv: Path | None = None):
        self.venv = Path(venv) if venv else venv_path()
        self.folder = tempfile.TemporaryDirectory(prefix="uhop-rknn-")
        self._process: subprocess.Popen | None = None
        self._log = None
        self._turn = threading.RLock()

    def require(self) -> None:
        if not is_ready(self.venv):
            raise ProviderError(f"rknn-toolkit2 environment not found at {self.venv}; create it with: "
                                "uhop-onnx setup rknn")

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and return the reply; a failure raises `ProviderError` with the toolkit's reason."""
        with self._turn:
            process = self._started()
            process.stdin.write(json.dumps({"protocol": PROTOCOL, "op": op, **fields}) + "\n")
            process.stdin.flush()
            ready, _, _ = select.select([process.stdout], [], [], TIMEOUT)
            line = process.stdout.readline() if ready else ""
            if not line:
                self.close()
                raise ProviderError(f"rknn-toolkit2 worker gave no answer to {op!r}: {self._log_tail()}")
            reply = json.loads(line)
            if not reply.pop("ok"):
                raise ProviderError(f"rknn-toolkit2 {op} failed: {reply['error']}; {self._log_tail()}")
            return reply

    def build(self, model: onnx.ModelProto, target: str = "rk3588", dtype: str = "fp16",
              samples: Sequence[Mapping[str, np.ndarray]] = (), rknn: Path | None = None,
              simulate: bool = False) -> float:
        """Convert `model` for `target`; int8 calibrates on `samples` (feeds of the model's inputs).
        Returns the build time in seconds."""
        if target not in TARGETS:
            raise ProviderError(f"rknn: unknown target {target!r}; valid targets: {', '.join(TARGETS)}")
        if dtype not in DTYPES:
            raise ProviderError(f"rknn: unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
        folder = Path(tempfile.mkdtemp(dir=self.folder.name))
        path = folder / "stage.onnx"
        path.write_bytes(_for_toolkit(model).SerializeToString())
        dataset = self._dataset(model, samples, folder) if dtype == "int8" else None
        disabled: list[str] = []
        while True:
            start = self._log_size()
            try:
                reply = self.request("build", onnx=str(path), target=target, dtype=dtype, dataset=dataset,
                                     rknn=str(rknn) if rknn else None, simulate=simulate, disable_rules=disabled)
                return reply["seconds"]
            except ProviderError:
                rule = suggested_rule(self._log_since(start))
                if rule is None or rule in disabled or len(disabled) >= MOST_RULES:
                    raise
                log.info("rknn-toolkit2 failed in its fusion rule %s; building again without it, as it advises",
                         rule)
                disabled.append(rule)

    def run(self, order: Sequence[str], feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Run the model last built with `simulate=True` on the simulator; outputs in the model's order."""
        inputs, outputs = Path(self.folder.name) / "inputs.npz", Path(self.folder.name) / "outputs.npz"
        with self._turn:  # the files are the worker's, one request's at a time
            np.savez(inputs, **{name: np.ascontiguousarray(feeds[name]) for name in order})
            self.request("run", inputs=str(inputs), order=list(order), outputs=str(outputs))
            with np.load(outputs) as results:
                return [results[f"arr_{i}"] for i in range(len(results.files))]

    def close(self) -> None:
        if self._process is not None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
            self._process = None

    def _started(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            self.require()
            self._log = open(Path(self.folder.name) / "toolkit.log", "w+")  # noqa: SIM115 - lives with the worker
            self._process = subprocess.Popen([str(venv_python(self.venv)), str(WORKER)], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, stderr=self._log, text=True)
        return self._process

    def _log_size(self) -> int:
        if self._log is None:
            return 0
        self._log.flush()
        return self._log.seek(0, 2)

    def _log_since(self, start: int) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(start)
        return self._log.read()

    def _log_tail(self, lines: int = 5) -> str:
        if self._log is None:
            return "no log"
        self._log.flush()
        self._log.seek(0)
        tail = [line.strip() for line in self._log.read().splitlines() if line.strip()][-lines:]
        return "toolkit log: " + " | ".join(tail) if tail else "the toolkit logged nothing"

    @staticmethod
    def _dataset(model: onnx.ModelProto, samples: Sequence[Mapping[str, np.ndarray]], folder: Path) -> str:
        """The toolkit's calibration list: one line per sample, the `.npy` of each input in input order."""
        names = model_inputs(model)
        if not samples:
            raise ProviderError("rknn: int8 needs calibration samples (feeds of the stage's inputs "
                                f"{', '.join(names)}); give them, or use dtype fp16")
        lines = []
        for k, sample in enumerate(samples):
            missing = [n for n in names if n not in sample]
            if missing:
                raise ProviderError(f"rknn: calibration sample {k} lacks input(s) {', '.join(missing)}")
            files = []
            for i, name in enumerate(names):
                files.append(folder / f"sample{k}_{i}.npy")
                np.save(files[-1], np.asarray(sample[name]))
            lines.append(" ".join(map(str, files)))
        listing = folder / "dataset.txt"
        listing.write_text("\n".join(lines) + "\n")
        return str(listing)


def suggested_rule(text: str) -> str | None:
    """The fusion rule a failed build's log advises disabling (`disable_rules=['name']`), if it names one."""
    found = ADVICE.search(text)
    return found.group(1) if found else None


def _for_toolkit(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model as the toolkit reads it: an IR version its onnx (<= 1.18) reads; its ai.onnx opset moved into
    Rockchip's range by onnx's version converter (`simplify.within_opsets`; a node the converter cannot move
    raises `ProviderError` with its reason); and every output left out before a named one (an LSTM's unused
    `Y`, as onnx-ir writes it) named, since the toolkit's ONNX Runtime cannot plan an unnamed one."""
    import onnx

    from uhop_onnx.model.simplify import within_opsets

    low, high = RKNN_TABLE.domains[""]
    converted, failed = within_opsets(model, low, high)
    if failed:
        raise ProviderError("rknn: " + "; ".join(f"node {name!r}: {why}" for name, why in failed.items()))
    gaps = [(k, i) for k, node in enumerate(converted.graph.node) for i, name in enumerate(node.output)
            if not name and any(node.output[i + 1:])]
    if converted.ir_version <= IR_VERSION and not gaps:
        return converted
    copy = onnx.ModelProto()
    copy.CopyFrom(converted)
    copy.ir_version = min(copy.ir_version, IR_VERSION)
    for k, i in gaps:
        node = copy.graph.node[k]
        node.output[i] = f"{node.name or k}.unused_output_{i}"
    return copy


def model_inputs(model: onnx.ModelProto) -> list[str]:
    """The graph inputs that are not initializers, in order."""
    initializers = {i.name for i in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in initializers]


def convert(model: onnx.ModelProto, out: Path, target: str = "rk3588", dtype: str = "fp16",
            samples: Sequence[Mapping[str, np.ndarray]] = (), venv: Path | None = None) -> float:
    """Write `model` as an `.rknn` file for `target`; returns the build time in seconds."""
    toolkit = Toolkit(venv)
    try:
        return toolkit.build(model, target, dtype, samples, rknn=Path(out).resolve())
    finally:
        toolkit.close()


class SimulatorRunner(Runner):
    """A stage converted for `target` and run in the toolkit's simulator on this host: for accuracy
    checks, not for timing. The simulator runs only a model built in the same toolkit session, so each
    runner keeps its own worker process."""

    def __init__(self, model: onnx.ModelProto, target: str, dtype: str,
                 samples: Sequence[Mapping[str, np.ndarray]] = (), venv: Path | None = None):
        self.inputs = model_inputs(model)
        self.outputs = [o.name for o in model.graph.output]
        self.dtypes = output_dtypes(model)
        self.toolkit = Toolkit(venv)
        self.build_seconds = self.toolkit.build(model, target, dtype, samples, simulate=True)

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        return named_outputs(self.toolkit.run(self.inputs, feeds), self.outputs, self.dtypes)

    def close(self) -> None:
        self.toolkit.close()
