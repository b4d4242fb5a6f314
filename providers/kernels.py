"""`kernels`: our own generated, verified and autotuned C kernels for Conv, Gemm, MatMul and their epilogues.

A stage holds Conv, Gemm and MatMul nodes, and Relu, Clip, bias Adds (a constant vector along the last or
the channel axis) and residual Adds (two computed tensors of one shape). `lower` turns a stage into plain data:
steps, where each Relu, Clip or bias Add that alone reads a product is fused into that product's epilogue, a
residual Add into a convolution's (the sum then takes a Relu or Clip too), and the rest run as a
bias+residual+clamp kernel. A runner is built from those steps; a bundle carries them as JSON, the constants
as `.npz` and the library built for the board's architecture with its C source, so the board needs only numpy and ctypes
(and a C compiler, for a bundle that is not signed). Schedules come from the autotuner's cache for
this device (or are tuned on first sight with the option `tune`), else from the default.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from uhop_onnx.errors import ProviderError

from .base import Absent, Artifact, Provider, Runner
from .capability import CapabilityTable, OpRule, Support

if TYPE_CHECKING:
    import onnx
    from uhop_onnx.custom_ops.library import Library
    from uhop_onnx.custom_ops.spec import Epilogue

PADS = (b"NOTSET", b"VALID")
KERNELS_TABLE = CapabilityTable(
    provider="kernels",
    rules=(
        OpRule("Conv", ranks=(4,), attributes={"auto_pad": PADS}, defaults={"auto_pad": b"NOTSET"}),
        OpRule("Gemm"),
        OpRule("MatMul"),
        OpRule("Relu"),
        OpRule("Clip", opsets=(11, 10_000)),
        OpRule("Add"),
    ),
    dtypes=frozenset({"float"}),
    domains={"": (7, 28)},
)
PRODUCTS = ("Conv", "Gemm", "MatMul")
# A board's CPU architecture -> the kernel target a bundle ships for it and the package of its compiler.
# x86-64 boards get AVX2+FMA (what the x86-64 profile promises), not whatever more this host has.
ARCH_TARGETS = {
    "x86_64": ("x86-64-avx2", "apt-get install -y gcc"),
    "aarch64": ("aarch64-neon", "apt-get install -y gcc-aarch64-linux-gnu"),
}


def host_arch() -> str:
    """This host's CPU architecture, spelled as target profiles spell it: x86_64 or aarch64."""
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def bias_axis(bias_shape: tuple[int, ...], rank: int) -> int | None:
    """The axis a constant Add operand of `bias_shape` runs along on a rank-`rank` tensor: -1 for a vector
    along the last axis (or a scalar), 1 for a channel vector of a 4-D tensor; None when it is no bias."""
    dims = list(bias_shape)
    if len(dims) > rank:
        return None
    while dims and dims[0] == 1:
        dims.pop(0)
    if len(dims) <= 1:
        return -1
    if rank == 4 and len(dims) == 3 and dims[1:] == [1, 1]:
        return 1
    return None


def _constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


class KernelsProvider(Provider):
    """Kernels generated for this host's ISA, built with its C compiler, verified against numpy."""

    id = "kernels"
    install = "apt-get install -y gcc  (any C11 compiler reachable as `cc`)"
    table = KERNELS_TABLE
    # arch: the board's, for bundles; emulate: run the board's build under qemu (to verify its stages here)
    option_types = {"tune": bool, "arch": str, "emulate": bool}

    def probe(self) -> tuple[str, str]:
        from uhop_onnx.custom_ops.build import BuildError, compiler_version
        from uhop_onnx.custom_ops.spec import host_target

        if shutil.which("cc") is None:
            raise Absent("no C compiler: `cc` is not on PATH")
        try:
            version = compiler_version("cc")
        except BuildError as error:
            raise Absent(str(error)) from None
        return version, host_target()

    def query(self, model: onnx.ModelProto) -> dict[str, Support]:
        """Refuse Adds that are not a bias, Clips without constant bounds and MatMuls of vectors."""
        from uhop_onnx.graph import Graph

        graph = Graph.from_model(model)
        constants = _constants(model)
        verdicts = {}
        for node in graph.nodes:
            reason = _refusal(node, graph, constants)
            if reason:
                verdicts[node.name] = Support(False, reason, "runtime")
        return verdicts

    def compile(self, model: onnx.ModelProto, *, exclusive: bool = True) -> Runner:
        """A runner over the host's verified library. The library's worker threads spin briefly between
        kernel calls; sharing the process with other stages (`exclusive=False`), the runner sends them to
        sleep at the end of each run, so they take no core from the next stage."""
        from uhop_onnx.custom_ops.build import BuildError
        from uhop_onnx.custom_ops.verify import VerificationError, host_library

        self.require()
        try:
            lib = self._emulated() if self.options.get("emulate") else host_library()
        except (VerificationError, BuildError) as error:
            raise ProviderError(f"kernels: no library built and passed verification on this host: {error}") from None
        threads = self.threads or len(os.sched_getaffinity(0))
        return KernelsRunner(*lower(model), lib, threads, bool(self.options.get("tune", False)), exclusive)

    def _emulated(self):
        """The board's (option `arch`) kernels under qemu; only aarch64 has an emulator here."""
        from uhop_onnx.custom_ops import cross
        from uhop_onnx.custom_ops.spec import LibrarySpec

        arch = self.options.get("arch", host_arch())
        if arch != "aarch64":
            raise ProviderError(f"kernels: emulate runs aarch64 kernels under qemu; arch is {arch!r}")
        missing = cross.missing_tools()
        if missing:
            raise ProviderError(f"kernels: emulating aarch64 needs {', '.join(missing)}; install: {cross.INSTALL}")
        return cross.Emulated(LibrarySpec(ARCH_TARGETS[arch][0]))

    def export_blocker(self) -> str | None:
        """None when this host can build the library for the option `arch` (the host's by default)."""
        from uhop_onnx.custom_ops.spec import TARGETS

        arch = self.options.get("arch", host_arch())
        if arch not in ARCH_TARGETS:
            return f"kernels: unknown arch {arch!r}; valid: {', '.join(ARCH_TARGETS)}"
        target, install = ARCH_TARGETS[arch]
        compiler = TARGETS[target].compiler
        if compiler == "cc" and arch != host_arch():
            return f"kernels for {arch} are built with this host's `cc`, and this host is {host_arch()}"
        if shutil.which(compiler) is None:
            return f"kernels for {arch} need the C compiler {compiler}, which is not on PATH; install: {install}"
        return None

    def export(self, model: onnx.ModelProto, folder: Path, stem: str) -> Artifact:
        """The stage's steps as `stem.json`, its constants as `stem.npz`, and for the board's architecture the
        library `kernels_<target>.so` (verified here when this host runs its ISA) and its C source
        `kernels_<target>.c`, from which a board builds its own when the bundle is not signed."""
        from uhop_onnx.custom_ops import codegen
        from uhop_onnx.custom_ops.spec import LibrarySpec

        blocker = self.export_blocker()
        if blocker:
            raise ProviderError(blocker)
        target = ARCH_TARGETS[self.options.get("arch", host_arch())][0]
        program, constants = lower(model)
        used = sorted({name for s in program["steps"] for name in (*s["inputs"], s["bias"]) if name in constants})
        library, source = f"kernels_{target}.so", f"kernels_{target}.c"  # one copy, shared by the kernels stages
        if not (folder / library).exists():
            shutil.copyfile(_library(target), folder / library)
            (folder / source).write_text(codegen.generate(LibrarySpec(target)))
        (folder / f"{stem}.json").write_text(json.dumps({**program, "constants": used}, indent=1) + "\n")
        np.savez(folder / f"{stem}.npz", *[constants[name] for name in used])
        return Artifact("kernels", [f"{stem}.json", f"{stem}.npz", library, source],
                        {"target": target, "tune": bool(self.options.get("tune", False))})


def _library(target: str) -> Path:
    """The built library for `target`: loaded and verified when this host runs that ISA, else built only."""
    from uhop_onnx.custom_ops import build, codegen
    from uhop_onnx.custom_ops.spec import LibrarySpec, host_targets
    from uhop_onnx.custom_ops.verify import VerificationError, load

    spec = LibrarySpec(target)
    try:
        return load(spec).path if target in host_targets() else build.build(codegen.generate(spec), target)
    except (VerificationError, build.BuildError) as error:
        raise ProviderError(f"kernels: the {target} library for the bundle failed: {error}") from None


def load_stage(folder: Path, artifact: Mapping[str, Any], threads: int | None, exclusive: bool,
               trusted: bool = False) -> KernelsRunner:
    """A bundle's kernels stage: its steps and constants over a library that passed its self-test.

    The library the bundle carries is loaded only when `trusted` (a signature the loader checked covers it);
    otherwise this host builds its own from the C source the bundle ships, which must be the source this
    version generates for the target, so that no code from the bundle runs."""
    from uhop_onnx.custom_ops.spec import LibrarySpec, host_targets
    from uhop_onnx.custom_ops.verify import VerificationError, load, tested

    files = {Path(name).suffix: Path(folder) / name for name in artifact["files"]}
    options = artifact["options"]
    if options["target"] not in host_targets():
        raise ProviderError(f"the stage's kernels are built for {options['target']}; this host runs "
                            f"{', '.join(host_targets())}")
    program = json.loads(files[".json"].read_text())
    with np.load(files[".npz"], allow_pickle=False) as stored:
        constants = {name: stored[f"arr_{i}"] for i, name in enumerate(program["constants"])}
    spec = LibrarySpec(options["target"])
    try:
        lib = tested(files[".so"], spec) if trusted else load(spec, _own_source(files.get(".c"), spec))
    except VerificationError as error:
        raise ProviderError(f"kernels: the stage's library failed its self-test: {error}") from None
    return KernelsRunner(program, constants, lib, threads or len(os.sched_getaffinity(0)), bool(options.get("tune")),
                         exclusive)


def _own_source(shipped: Path | None, spec) -> str:
    """The C source to build an unsigned bundle's kernels from: the bundle's, when it is what this version
    generates for the target and this host has the compiler."""
    from uhop_onnx.custom_ops import codegen
    from uhop_onnx.custom_ops.spec import TARGETS

    unsigned = "the bundle is not signed, so the library it carries is not loaded"
    source = codegen.generate(spec)
    if shipped is None or shipped.read_text() != source:
        raise ProviderError(f"kernels: {unsigned}, and its C source is missing or not what this uhop-onnx "
                            f"generates for {spec.target}; load a signed bundle with its key "
                            "(load_bundle(path, key=...)), or export it again with this version")
    compiler = TARGETS[spec.target].compiler
    if shutil.which(compiler) is None:
        raise ProviderError(f"kernels: {unsigned}, and building it here from the bundle's C source needs {compiler}; "
                            f"install: {KernelsProvider.install}; or load a signed bundle with its key")
    return source


def _rank(graph, name: str) -> int | None:
    info = graph.tensors.get(name)
    return None if info is None or info.shape is None else len(info.shape)


def _shape(graph, name: str) -> tuple | None:
    """The tensor's shape when every dimension is known (a number or a symbol), else None."""
    info = graph.tensors.get(name)
    return None if info is None or info.shape is None or None in info.shape else tuple(info.shape)


def _refusal(node, graph, constants: Mapping[str, np.ndarray]) -> str:
    """Why this provider cannot run `node`, or "" when it can."""
    if node.op_type == "Add":
        const = [name for name in node.inputs if name in constants]
        other = [name for name in node.inputs if name not in constants]
        if not const:
            shapes = [_shape(graph, name) for name in other]
            if shapes[0] is None or shapes[0] != shapes[1]:
                return (f"Add of computed tensors of shapes {shapes} runs on kernels only as a residual sum: "
                        "both shapes known and equal")
            return ""
        if len(const) != 1 or len(other) != 1:
            return "Add runs on kernels as a bias (a constant and a computed operand) or a residual sum"
        rank, shape = _rank(graph, other[0]), constants[const[0]].shape
        if rank is None or bias_axis(shape, rank) is None:
            return (f"Add of a constant of shape {list(shape)} to a rank-{rank} tensor is no bias; kernels take "
                    "a vector along the last axis or a channel vector [C,1,1]")
    if node.op_type == "Clip":
        for name in node.inputs[1:]:
            if name and (name not in constants or constants[name].size != 1):
                return f"Clip bound {name!r} must be a constant scalar"
    if node.op_type == "MatMul":
        ranks = [_rank(graph, name) for name in node.inputs]
        if any(r is None or r < 2 for r in ranks):
            return f"MatMul operands of ranks {ranks}; kernels need known ranks of at least 2"
    return ""


def lower(model: onnx.ModelProto) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The stage as plain data, and its constants. Data: `outputs`, and `steps` of `op`, `inputs`, `output`,
    `attrs`, the clamp `lo`/`hi` (None when unbounded), `bias` (a fused bias Add's constant, or None) and
    `residual` (the other operand of a fused residual Add, added before the clamp, or None)."""
    from onnx import helper

    unknown = sorted({n.op_type for n in model.graph.node} - {r.op for r in KERNELS_TABLE.rules})
    if unknown:
        raise ProviderError(f"kernels cannot run {', '.join(unknown)}; "
                            f"it runs {', '.join(r.op for r in KERNELS_TABLE.rules)}")
    constants = _constants(model)
    outputs = [o.name for o in model.graph.output]
    readers: dict[str, int] = {}
    for n in model.graph.node:
        for name in n.input:
            readers[name] = readers.get(name, 0) + 1
    steps: list[dict[str, Any]] = []
    by_output: dict[str, dict[str, Any]] = {}

    def fusable(name: str) -> dict[str, Any] | None:
        """The step producing `name` when this node alone reads it, so its epilogue can take the node."""
        step = by_output.get(name)
        return step if step and readers.get(name) == 1 and name not in outputs else None

    for n in model.graph.node:
        computed = [name for name in n.input if name not in constants]
        if n.op_type in PRODUCTS:
            attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
            steps.append({"op": n.op_type, "inputs": list(n.input), "output": n.output[0],
                          "attrs": _attributes(n.op_type, attrs), "lo": None, "hi": None, "bias": None,
                          "residual": None})
        elif n.op_type == "Add" and len(computed) == 2:  # a residual sum
            candidates = [(steps.index(step), step, other) for name, other in (computed, computed[::-1])
                          if (step := fusable(name)) and step["op"] == "Conv" and _fuse_residual(step)]
            if candidates:  # into the later producer, so the other operand exists when it runs
                _, step, other = max(candidates, key=lambda c: c[0])
                step["residual"] = other
                _rename(by_output, step, n.output[0])
                continue
            steps.append({"op": "Add", "inputs": [computed[0]], "output": n.output[0], "attrs": {}, "lo": None,
                          "hi": None, "bias": None, "residual": computed[1]})
        else:
            producer = fusable(computed[0] if computed else n.input[0])
            if producer and _fuse(producer, n, constants):
                _rename(by_output, producer, n.output[0])
                continue
            lo, hi = (None, None) if n.op_type == "Add" else _bounds(n, constants)
            bias = _bias_name(n, constants) if n.op_type == "Add" else None
            steps.append({"op": n.op_type, "inputs": [computed[0] if computed else n.input[0]],
                          "output": n.output[0], "attrs": {}, "lo": lo, "hi": hi, "bias": bias, "residual": None})
        by_output[steps[-1]["output"]] = steps[-1]
    return {"steps": steps, "outputs": outputs}, constants


def _rename(by_output: dict[str, dict[str, Any]], step: dict[str, Any], output: str) -> None:
    """The step now produces `output` (its old output was read only by the node fused into it)."""
    del by_output[step["output"]]
    step["output"] = output
    by_output[output] = step


def _fuse_residual(step: dict[str, Any]) -> bool:
    """Whether a residual can join the step's epilogue: before any clamp, and only one."""
    return step["lo"] is None and step["hi"] is None and step["residual"] is None


def _attributes(op: str, attrs: Mapping[str, Any]) -> dict[str, Any]:
    """A product's attributes with defaults applied, as JSON values."""
    if op == "Conv":
        explicit = attrs.get("auto_pad", b"NOTSET") == b"NOTSET"
        return {"strides": list(attrs.get("strides", (1, 1))), "dilations": list(attrs.get("dilations", (1, 1))),
                "pads": list(attrs.get("pads", (0, 0, 0, 0))) if explicit else [0] * 4,
                "group": int(attrs.get("group", 1))}
    if op == "Gemm":
        return {"transA": int(attrs.get("transA", 0)), "transB": int(attrs.get("transB", 0)),
                "alpha": float(attrs.get("alpha", 1.0)), "beta": float(attrs.get("beta", 1.0))}
    return {}


def _fuse(step: dict[str, Any], node, constants: Mapping[str, np.ndarray]) -> bool:
    """Fold a Relu, Clip or bias Add into a product's epilogue (a bias only before any clamp), or a Relu or Clip
    into a residual sum's."""
    if step["lo"] is not None or step["hi"] is not None:
        return False
    if node.op_type in ("Relu", "Clip") and (step["op"] in PRODUCTS or step["residual"] is not None):
        step["lo"], step["hi"] = _bounds(node, constants)
        return True
    if step["op"] not in PRODUCTS or node.op_type != "Add":
        return False
    name = _bias_name(node, constants)
    bias = constants[name]
    axis = bias_axis(bias.shape, 4 if step["op"] == "Conv" else bias.ndim)
    if step["bias"] is not None or bias.size != 1 and axis != (1 if step["op"] == "Conv" else -1):
        return False
    step["bias"] = name
    return True


def _bounds(node, constants: Mapping[str, np.ndarray]) -> tuple[float | None, float | None]:
    """Relu's lower bound; Clip's two, an absent one being the float limit, as ONNX Runtime takes it (so Clip
    maps an infinity to the largest finite float, where Relu keeps it)."""
    if node.op_type == "Relu":
        return 0.0, None
    limit = float(np.finfo(np.float32).max)
    names = [*node.input[1:], "", ""]
    return tuple(float(constants[name]) if name else default for name, default in zip(names[:2], (-limit, limit)))


def _bias_name(node, constants: Mapping[str, np.ndarray]) -> str:
    return next(name for name in node.input if name in constants)


@dataclass
class Step:
    """One kernel call: computes `output` from `values`, with a fused epilogue, bias and residual."""

    kind: str  # the op type that produces the value: Conv, Gemm, MatMul, or Relu/Clip/Add on their own
    output: str
    fn: Callable[[dict[str, Any], Epilogue, np.ndarray | None, Residual | None], np.ndarray]
    epilogue: Epilogue
    bias: np.ndarray | None = None  # a fused bias Add's constant
    residual: str | None = None  # the value a residual Add sums with the product
    donate: bool = False  # whether the residual's array may be overwritten (a value of this stage read last here)

    def __call__(self, values: dict[str, Any]) -> np.ndarray:
        residual = None if self.residual is None else Residual(values[self.residual], self.donate)
        return self.fn(values, self.epilogue, self.bias, residual)


@dataclass(frozen=True)
class Residual:
    """A value to add before the clamp, and whether the kernel may write its result over it."""

    value: np.ndarray
    donated: bool


class KernelsRunner(Runner):
    """Runs a stage's steps (from `lower`) as fused kernel calls; needs only numpy and the library."""

    def __init__(self, program: Mapping[str, Any], constants: Mapping[str, np.ndarray], lib: Library, threads: int,
                 tune: bool, exclusive: bool = True):
        from uhop_onnx.custom_ops.spec import Epilogue

        self.lib, self.threads, self.tune, self.exclusive = lib, threads, tune, exclusive
        self.constants = dict(constants)
        self.outputs = list(program["outputs"])
        self.schedules: dict[tuple[str, int], Any] = {}  # (op key, threads) -> Schedule
        self._choosing = threading.Lock()
        self.steps: list[Step] = []
        last_read = {name: k for k, s in enumerate(program["steps"]) for name in (*s["inputs"], s.get("residual"))}
        produced = {s["output"] for s in program["steps"]}
        for k, s in enumerate(program["steps"]):
            lo, hi = (float(d if v is None else v) for v, d in ((s["lo"], "-inf"), (s["hi"], "inf")))
            epilogue = Epilogue(lo, hi)
            bias = None if s["bias"] is None else self.constants[s["bias"]].astype(np.float32)
            if s["op"] in PRODUCTS:
                fn = getattr(self, f"_{s['op'].lower()}")(s["inputs"], s["attrs"])
            else:
                fn = self._elementwise(s["inputs"][0])
            residual = s.get("residual")
            donate = (residual in produced and last_read[residual] == k and residual not in s["inputs"]
                      and residual not in self.outputs)
            self.steps.append(Step(s["op"], s["output"], fn, epilogue, bias, residual, donate))

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        values = {**self.constants, **{k: np.asarray(v) for k, v in feeds.items()}}
        for step in self.steps:
            values[step.output] = step(values)
        if not self.exclusive:
            self.lib.rest()
        return {name: values[name] for name in self.outputs}

    # -- kernels -------------------------------------------------------------------------------------------

    def _schedule(self, op):
        key = (op.key, self.threads)
        if key not in self.schedules:
            from uhop_onnx.custom_ops.autotune import schedule_for

            with self._choosing:  # one search at a time: concurrent ones would time each other
                if key not in self.schedules:
                    self.schedules[key] = schedule_for(self.lib, op, self.threads, self.tune)
        return self.schedules[key]

    def _conv(self, inputs, attrs):
        from uhop_onnx.custom_ops.spec import OpSpec

        x_name, w_name, *rest = inputs
        b_name = rest[0] if rest else ""
        strides, pads, dilations = (tuple(attrs[key]) for key in ("strides", "pads", "dilations"))
        group = attrs["group"]

        plans = {}  # (input shape, weight shape) -> schedule, and the constant weights packed for it

        def conv(values, epilogue, fused, residual):
            x, w = values[x_name], values[w_name]
            key = (x.shape, w.shape)
            if key not in plans:
                schedule = self._schedule(OpSpec("conv2d", (*x.shape, w.shape[0], *w.shape[2:], *strides, *pads,
                                                            *dilations, group), epilogue))
                constant = schedule.packs_weights and w_name in self.constants
                plans[key] = schedule, self.lib.pack(w.reshape(w.shape[0], -1), schedule, group) if constant else None
            schedule, packed = plans[key]
            bias = _sum_bias(values[b_name] if b_name else None, fused, w.shape[0])
            return self.lib.conv2d(x, w, schedule, bias=bias, strides=strides, pads=pads, dilations=dilations,
                                   group=group, epilogue=epilogue, packed=packed,
                                   residual=None if residual is None else residual.value,
                                   out=residual.value if residual and residual.donated else None)
        return conv

    def _gemm(self, inputs, attrs):
        from uhop_onnx.custom_ops.spec import OpSpec

        a_name, b_name, *rest = inputs
        c_name = rest[0] if rest else ""
        trans_a, trans_b, alpha, beta = (attrs[key] for key in ("transA", "transB", "alpha", "beta"))
        packs = self._right_packs(b_name, bool(trans_b))

        def gemm(values, epilogue, fused, _residual):
            a = values[a_name].T if trans_a else values[a_name]
            b = values[b_name].T if trans_b else values[b_name]
            bias = None if not c_name or beta == 0.0 else np.float32(beta) * values[c_name]
            bias = fused if bias is None else (bias if fused is None else bias + fused)
            schedule = self._schedule(OpSpec("gemm", (a.shape[0], b.shape[1], a.shape[1], trans_a, trans_b),
                                             epilogue))
            return self.lib.gemm(a, b, schedule, alpha=alpha, bias=bias, epilogue=epilogue,
                                 packed_b=packs(schedule))
        return gemm

    def _right_packs(self, b_name: str, transposed: bool) -> Callable[[Any], Any]:
        """Per schedule, a constant right operand packed once (None for a computed one)."""
        if b_name not in self.constants or self.constants[b_name].ndim != 2:
            return lambda _schedule: None
        b = self.constants[b_name]
        packs: dict[int, Any] = {}  # micro-kernel -> packed

        def packed(schedule):
            if schedule.micro not in packs:
                packs[schedule.micro] = self.lib.pack(b if transposed else b.T, schedule, side=1)
            return packs[schedule.micro]
        return packed

    def _matmul(self, inputs, _attrs):
        from uhop_onnx.custom_ops.spec import OpSpec

        a_name, b_name = inputs
        packs = self._right_packs(b_name, False)

        def matmul(values, epilogue, fused, _residual):
            a, b = values[a_name], values[b_name]
            m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
            bias = None if fused is None else np.broadcast_to(fused.reshape(-1), (n,))
            if b.ndim == 2:  # fold a's batch into its rows
                schedule = self._schedule(OpSpec("gemm", (int(np.prod(a.shape[:-1])), n, k, 0, 0), epilogue))
                out = self.lib.gemm(a.reshape(-1, k), b, schedule, bias=bias, epilogue=epilogue,
                                    packed_b=packs(schedule))
                return out.reshape(*a.shape[:-1], n)
            batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
            a, b = np.broadcast_to(a, (*batch, m, k)), np.broadcast_to(b, (*batch, k, n))
            out = np.empty((*batch, m, n), np.float32)
            schedule = self._schedule(OpSpec("gemm", (m, n, k, 0, 0), epilogue))
            for index in np.ndindex(*batch):
                self.lib.gemm(a[index], b[index], schedule, bias=bias, epilogue=epilogue, out=out[index])
            return out
        return matmul

    def _elementwise(self, x_name: str):
        """A Relu, Clip, bias Add or residual sum on its own, as one bias+residual+clamp pass."""

        def elementwise(values, epilogue, bias, residual):
            x = values[x_name]
            other = None if residual is None else residual.value
            out = other if residual and residual.donated else None
            if bias is None:
                return self.lib.bias_act(x, epilogue=epilogue, residual=other, out=out)
            axis = bias_axis(bias.shape, x.ndim)
            vector = np.full(x.shape[-1], bias.item(), np.float32) if bias.size == 1 else bias.reshape(-1)
            return self.lib.bias_act(x, bias=vector, axis=axis, epilogue=epilogue, residual=other, out=out)
        return elementwise

def _sum_bias(own: np.ndarray | None, fused: np.ndarray | None, channels: int) -> np.ndarray | None:
    """A Conv's bias plus a fused channel-bias Add, as one vector of `channels` values."""
    parts = [np.broadcast_to(np.asarray(p, np.float32).reshape(-1), (channels,)) for p in (own, fused) if p is not None]
    return None if not parts else parts[0] if len(parts) == 1 else parts[0] + parts[1]
