"""The plan: stages in run order, each a standalone ONNX model and the provider that runs it.

Imports only numpy at module level (onnx, pydantic and the report when used): a bundle's stages are `Stage`s
too, on a board.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..foundation.errors import PlanError
from ..providers.base import label
from ..foundation.files import check_external_data, new_folder, read_npz
from ..foundation.dtypes import TensorSig
from ..foundation.metadata import ModelMetadata
from ..foundation.samples import shapes_text

SCHEMA = "uhop-onnx.plan/2"
PLAN_FILE = "plan.json"
CONSTANTS_FILE = "constants.npz"


IN_MEMORY = ("model", "data", "fp32")  # a stage's fields that `plan.json` does not hold
Dims = list[int | None] | None  # an output's dimensions (None where free); None when its rank is unknown


@dataclass
class Stage:
    """One subgraph on one provider. `nodes` are node names of the loaded model. A bundle's manifest stage
    is one too (`from_json`), with its own keys (artifact, runtime, reference, ...) beside `to_json()`'s."""

    provider: str
    options: dict[str, Any]
    nodes: list[str]
    inputs: list[str]
    outputs: list[str]
    file: str
    cost_ms: float | None = None  # measured: the stage's blocks on its provider
    alternatives: dict[str, float] = field(default_factory=dict)  # provider label -> measured ms, where it could run
    boundary_ms: float | None = None  # measured cost of entering this stage from another provider
    precision: str = "fp32"  # one of `precision.PRECISIONS` (an int8 stage's file is its QDQ model)
    sha256: str | None = None  # of `file`, recorded by `Plan.save` and checked when the file is read
    # Each output's name and declared dimensions, recorded when the plan is built (None in a plan saved before
    # stages recorded them: read from the stage's model when it is compiled); results are checked against it.
    declared: list[tuple[str, Dims]] | None = None
    model: Any = field(default=None, repr=False)  # onnx.ModelProto, read from `file` or `data` on demand
    # The model file's path (its external data checked), or the model's bytes as given, where the stage is a
    # model whole and unchanged on ONNX Runtime: given to it as they are (reading and serializing a large model
    # again costs as much as ONNX Runtime's own start, and one past protobuf's 2 GB cannot be serialized).
    data: bytes | str | None = field(default=None, repr=False)
    # The stage's nodes as cut from the model, before its provider lowered them to its precision (the same
    # model at fp32): kept in memory by `optimizer.build_plan`; None in a plan read from a folder.
    fp32: Any = field(default=None, repr=False)

    @property
    def label(self) -> str:
        """As the provider's label: `openvino:GPU`, `openvino[bf16]`."""
        return label(self.provider, self.options, self.precision)

    @property
    def described(self) -> str:
        """The stage as messages name it: `openvino, 12 nodes from 'conv_0'` (`ort-cpu, the model whole` where its
        nodes are not named yet)."""
        if not self.nodes:
            return f"{self.label}, the model whole"
        return f"{self.label}, {len(self.nodes)} nodes from {self.nodes[0]!r}"

    def to_json(self) -> dict[str, Any]:
        """Every field but those in memory only (`IN_MEMORY`), as `plan.json` holds it."""
        entry = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in IN_MEMORY}
        if self.declared is not None:
            entry["declared"] = [[name, None if dims is None else list(dims)] for name, dims in self.declared]
        return entry

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> Stage:
        """A stage from `to_json`'s keys in `entry`; other keys (a bundle manifest's) are left to their reader.
        A manifest stage written before stages carried a `file` names its ONNX model by `reference`."""
        known = {f.name for f in fields(cls)} - set(IN_MEMORY)
        values = {key: value for key, value in entry.items() if key in known}
        values.setdefault("file", entry.get("reference", ""))
        return cls(**values)


@dataclass(frozen=True)
class Plan:
    """Where each part of a model runs. Built by `uhop_onnx.optimize`, whole, and not changed after (a
    decision made later is a new plan: `dataclasses.replace`); run by `uhop_onnx.InferenceSession`. Only
    `fallbacks` changes, as a session counts them; a stage's `model` is read from `folder` when needed, and
    a stage of a plan saved before stages recorded their `declared` outputs gets them when compiled."""

    model_name: str
    model_hash: str
    inputs: list[TensorSig]
    outputs: list[TensorSig]
    providers: list[dict[str, Any]]  # {"id", "options", "version"}, in preference order
    stages: list[Stage]
    placement: str = "first-supported"
    profile: dict[str, Any] | None = None  # the measured placement's report
    constants: dict[str, np.ndarray] = field(default_factory=dict, repr=False)  # outputs no stage computes
    threads: int | None = None
    metadata: ModelMetadata = field(default_factory=ModelMetadata, repr=False)
    # Stage index -> {"provider", "count", "last_error"}: how often a session with `fallback=True` re-ran that
    # stage on another provider after it failed. Kept in memory; written only by `save`.
    fallbacks: dict[int, dict[str, Any]] = field(default_factory=dict)
    # {"node", "provider", "reason"}: nodes a provider's build check refused, so they were placed elsewhere
    replaced: list[dict[str, str]] = field(default_factory=list)
    shapes: dict[str, list[int]] | None = None  # the input shapes it was placed and measured at
    # With reduced precision: the tolerance the plan was gated with, and per output the worst error measured
    # against ONNX Runtime fp32 over the gate's samples ({"max_abs_error", "max_rel_error", "cosine", ...}).
    tolerance: float | None = None
    accuracy: dict[str, dict[str, Any]] | None = None
    # Shape bucket -> what an adapting session tried there and decided (`InferenceSession.adaptation`'s
    # entries), for the buckets that decided on this plan.
    adaptation: dict[str, dict[str, Any]] | None = None
    folder: Path | None = field(default=None, repr=False)
    constants_hash: str | None = field(default=None, repr=False)  # of `constants.npz`, recorded by `save`

    def get_providers(self) -> list[str]:
        return list(dict.fromkeys(s.provider for s in self.stages))

    def summary(self) -> str:
        """A few lines: the model, the placement, and the stages by provider with their node counts."""
        nodes: dict[str, int] = {}
        for s in self.stages:
            nodes[s.label] = nodes.get(s.label, 0) + len(s.nodes)
        where = ", ".join(f"{label} {count} nodes" for label, count in nodes.items())
        lines = [f"{self.model_name} ({self.model_hash[:12]}): {len(self.stages)} stage(s), placement {self.placement}"
                 f"{f', threads {self.threads}' if self.threads else ''}", f"  {where}"]
        if self.shapes is not None:
            lines.append(f"  placed at {shapes_text(self.shapes)}")
        if self.profile and self.profile.get("chosen") in self.profile.get("candidates", {}):
            from .report import ms_text

            chosen = self.profile["candidates"][self.profile["chosen"]]
            lines.append(f"  measured {ms_text(chosen['ms'])} ms end to end ({self.profile['chosen']})")
        lines += [f"  stage {k}{self.fell_back(k)}" for k in sorted(self.fallbacks)]
        return "\n".join(lines)

    def __repr__(self) -> str:
        labels = " > ".join(f"{s.label} x{len(s.nodes)}" for s in self.stages[:6])
        more = f" > ... ({len(self.stages)} stages)" if len(self.stages) > 6 else ""
        return f"<Plan {self.model_name!r} {self.placement}: {labels}{more}>"

    def _repr_html_(self) -> str:
        """The stage table and the placement picture (`placement.svg`), for notebooks."""
        from html import escape

        from .report import ms_text, placement_svg

        rows = "".join(f"<tr><td>{k}</td><td>{escape(s.label)}</td><td>{len(s.nodes)}</td><td><code>"
                       f"{escape(s.nodes[0])}</code></td><td>{ms_text(s.cost_ms)}</td></tr>"
                       for k, s in enumerate(self.stages))
        head = escape(self.summary().splitlines()[0])
        return (f"<p><b>{head}</b></p><table><tr><th>stage</th><th>provider</th><th>nodes</th><th>first node</th>"
                f"<th>ms</th></tr>{rows}</table>{placement_svg(self)}")

    def on(self, provider: str, options: dict[str, Any] | None = None) -> Plan:
        """The same stages, every one on `provider` (a reference to compare this plan with)."""
        stages = [replace(s, provider=provider, options=dict(options or {}), model=s.model, cost_ms=None,
                          alternatives={}, boundary_ms=None) for s in self.stages]
        return replace(self, stages=stages, placement=f"every stage on {provider}", profile=None, fallbacks={},
                       tolerance=None, accuracy=None)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "model": {"name": self.model_name, "sha256": self.model_hash, "metadata": asdict(self.metadata)},
            "inputs": [asdict(t) for t in self.inputs],
            "outputs": [asdict(t) for t in self.outputs],
            "providers": self.providers,
            "placement": self.placement,
            "profile": self.profile,
            "threads": self.threads,
            "shapes": self.shapes,
            "constants": sorted(self.constants),
            "constants_sha256": self.constants_hash,
            "fallbacks": {str(k): v for k, v in sorted(self.fallbacks.items())},
            "replaced": self.replaced,
            **({"tolerance": self.tolerance, "accuracy": self.accuracy} if self.tolerance is not None else {}),
            **({"adaptation": self.adaptation} if self.adaptation is not None else {}),
            "stages": [s.to_json() for s in self.stages],
        }

    def stage_model(self, stage: Stage):
        """The stage's ONNX model: parsed from the bytes or the file it was read from (a model whole, as read)
        or read from the plan folder when not in memory, once its bytes match the sha256 the plan recorded and
        any data it keeps in other files lies in the plan folder (then read into it: no runtime resolves those
        paths, against the working directory, itself)."""
        if stage.model is None and stage.data is not None:
            from ..model.loader import load

            stage.model = load(stage.data, check=False)
        if stage.model is None:
            import onnx

            from ..model.loader import read_external_data

            if self.folder is None:
                raise PlanError(f"stage {stage.file!r} has no model in memory and the plan has no folder")
            path = self.folder / stage.file
            data = _read(path)
            if hashlib.sha256(data).hexdigest() != stage.sha256:
                raise PlanError(f"{path}: refused: the stage file does not match its sha256 in {PLAN_FILE} "
                                "(replaced or changed since the plan was saved); re-run `uhop-onnx optimize`")
            external = check_external_data(data, self.folder, path, PlanError)
            try:
                model = onnx.load_from_string(data)
            except Exception as error:  # noqa: BLE001 - not a protobuf
                raise PlanError(f"{path}: cannot read stage model ({error})") from None
            if external:
                read_external_data(model, self.folder, path, PlanError)
            stage.model = model
        return stage.model

    def fell_back(self, index: int) -> str:
        """The note shown for a stage that failed and was re-run, ' (fell back to ort-cpu 3 times)'; else ''."""
        entry = self.fallbacks.get(index)
        if not entry:
            return ""
        times = "once" if entry["count"] == 1 else f"{entry['count']} times"
        return f" (fell back to {entry['provider']} {times})"

    def save(self, folder: str | os.PathLike, report: bool = True) -> Path:
        """Write `plan.json` (with each file's sha256), the stage models, constants and (with `report`) the
        report into `folder`, which must be absent or empty; it appears whole or not at all. This plan is
        left as it was (`Plan.load(folder)` reads the saved one)."""
        from ..model.loader import saved as saved_model

        target = Path(folder)
        with new_folder(target, PlanError) as staging:
            stages = []
            for stage in self.stages:
                digest = saved_model(self.stage_model(stage), staging / stage.file)  # piece by piece
                stages.append(replace(stage, sha256=digest))
            constants_hash = None
            if self.constants:
                np.savez(staging / CONSTANTS_FILE, **self.constants)
                constants_hash = hashlib.sha256((staging / CONSTANTS_FILE).read_bytes()).hexdigest()
            saved = replace(self, stages=stages, constants_hash=constants_hash, folder=target)
            (staging / PLAN_FILE).write_text(json.dumps(saved.to_json(), indent=2) + "\n")
            if report:
                from .report import write_report

                write_report(saved, staging)
        return target

    @classmethod
    def load(cls, folder: str | os.PathLike, allowed_delegates: Iterable[str | os.PathLike] = ()) -> Plan:
        """Read a plan folder written by `save`, checked against the schema (`plan_schema`); stage models are
        read, and checked against their sha256, when first needed. `allowed_delegates`: LiteRT delegate
        paths the plan may name besides known delegates and `UHOP_ALLOWED_DELEGATES`."""
        from .plan_schema import parse

        folder = Path(folder)
        path = folder / PLAN_FILE
        if not path.is_file():
            raise PlanError(f"{folder}: not a plan folder (no {PLAN_FILE}); create one with `uhop-onnx optimize`")
        data = parse(_read(path), path, SCHEMA, [os.fspath(p) for p in allowed_delegates])
        for stage in data.stages:
            _regular(folder / stage.file)
        constants = {}
        if data.constants:
            stored = _read(folder / CONSTANTS_FILE)
            if hashlib.sha256(stored).hexdigest() != data.constants_sha256:
                raise PlanError(f"{folder / CONSTANTS_FILE}: refused: does not match constants_sha256 in {PLAN_FILE}")
            arrays = read_npz(io.BytesIO(stored), PlanError, folder / CONSTANTS_FILE)
            missing = sorted(set(data.constants) - set(arrays))
            if missing:
                raise PlanError(f"{folder / CONSTANTS_FILE}: has no array {', '.join(missing)}")
            constants = {name: arrays[name] for name in data.constants}
        return cls(
            model_name=data.model.name,
            model_hash=data.model.sha256,
            inputs=[TensorSig(**t.model_dump()) for t in data.inputs],
            outputs=[TensorSig(**t.model_dump()) for t in data.outputs],
            providers=[p.model_dump() for p in data.providers],
            stages=[Stage.from_json(s.model_dump()) for s in data.stages],
            placement=data.placement,
            profile=data.profile.model_dump() if data.profile else None,
            constants=constants,
            threads=data.threads,
            metadata=data.model.metadata,
            fallbacks={int(k): v.model_dump() for k, v in data.fallbacks.items()},
            replaced=[r.model_dump() for r in data.replaced],
            shapes=data.shapes,
            tolerance=data.tolerance,
            accuracy={name: a.model_dump(exclude_none=True) for name, a in data.accuracy.items()}
            if data.accuracy is not None else None,
            adaptation={k: a.model_dump() for k, a in data.adaptation.items()} if data.adaptation is not None else None,
            folder=folder,
            constants_hash=data.constants_sha256,
        )


def _regular(path: Path) -> None:
    """Refuse a plan folder's file that is missing or a symbolic link."""
    if path.is_symlink():
        raise PlanError(f"{path}: refused: a symbolic link (a plan's files must lie in its folder)")
    if not path.is_file():
        raise PlanError(f"{path}: missing from the plan folder; re-run `uhop-onnx optimize`")


def _read(path: Path) -> bytes:
    """The bytes of a regular file in a plan folder."""
    _regular(path)
    try:
        return path.read_bytes()
    except OSError as error:
        raise PlanError(f"{path}: cannot read ({error.strerror or error})") from None
