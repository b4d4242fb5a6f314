"""The schema of `plan.json`, checked with pydantic when a plan folder is read.

Every field has its type; a stage's options must be options its provider declares, of the types it declares
(`Provider.option_types`); a stage file is a plain `.onnx` name inside the folder with the sha256 `Plan.save`
recorded; a LiteRT delegate is a known name or a path the user allowed (never a path taken from the file
alone); `threads` more than this host's cores is taken as its cores, with a warning. Any violation is a
`PlanError` naming the field; a file nested too deep to read is one too.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from ..foundation.errors import PlanError
from ..foundation.host import bounded_threads
from ..foundation.metadata import ModelMetadata
from ..precision.values import PRECISIONS

SHA256 = r"^[0-9a-f]{64}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ModelRef(_Strict):
    name: str
    sha256: str
    metadata: ModelMetadata = ModelMetadata()  # validated field by field, as strictly as the rest


class Fallback(_Strict):
    """How often a session re-ran a stage on another provider after it failed."""

    provider: str
    count: int = Field(ge=0)
    last_error: str


class Signature(_Strict):
    name: str
    type: str
    shape: list[int | str | None] | None


class ProviderEntry(_Strict):
    id: str
    options: dict[str, Any]
    version: str | None = None


class Replaced(_Strict):
    """A node a provider's build check refused, so it was placed elsewhere."""

    node: str
    provider: str
    reason: str


class Trial(_Strict):
    """A candidate an adapting session tried at one shape bucket (`adapt.Trial.to_json`)."""

    label: str
    state: str
    calls: int = Field(ge=0)
    ms: float | None = None
    interval: list[float] | None = None  # of its time over the serving plan's
    error: str | None = None  # why it was refused
    tolerance: str | None = None  # what it was held to against ONNX Runtime, in words
    max_abs_error: float | None = None  # its largest error against ONNX Runtime on the bucket's sample
    why: str | None = None  # why it was not tried


class Adaptation(_Strict):
    """What an adapting session did at one shape bucket: its calls, the plan serving, what was tried, the decision."""

    bucket: str
    calls: int = Field(ge=0)
    serving: str
    candidates: list[Trial] = []
    decision: str | None = None


class Candidate(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    ms: float | None
    spread: float
    stages: str


class Profile(BaseModel):
    """The measured placement's report; the fields `explain` and the report read are typed."""

    model_config = ConfigDict(extra="allow", strict=True)

    chosen: str
    candidates: dict[str, Candidate]
    measured: int
    cached: int
    seconds: float


class StageEntry(_Strict):
    provider: str
    options: dict[str, Any]
    nodes: list[str] = Field(min_length=1)
    inputs: list[str]
    outputs: list[str]
    file: str
    sha256: str = Field(pattern=SHA256)
    cost_ms: float | None = None
    alternatives: dict[str, float] = {}
    boundary_ms: float | None = None
    precision: Literal[PRECISIONS] = "fp32"  # type: ignore[valid-type]
    declared: list[list[str | list[int | None] | None]] | None = None  # [output name, dims or null] each

    @field_validator("declared")
    @classmethod
    def _pairs(cls, declared: list[list[Any]] | None) -> list[list[Any]] | None:
        for pair in declared or []:
            if len(pair) != 2 or not isinstance(pair[0], str) or isinstance(pair[1], str):
                raise ValueError("each entry must be [output name, its dimensions or null]")
        return declared

    @field_validator("file")
    @classmethod
    def _plain_name(cls, file: str) -> str:
        if not file.endswith(".onnx") or file.startswith(".") or any(c in file for c in "/\\\0"):
            raise ValueError(f"{file!r} must be a plain .onnx file name inside the plan folder")
        return file

    @field_validator("options")
    @classmethod
    def _declared(cls, options: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        from ..providers import REGISTRY

        provider = info.data.get("provider")
        if provider not in REGISTRY:
            return options  # no such provider here: compiling the stage names it
        declared = REGISTRY[provider].option_types
        for name, value in options.items():
            if name not in declared:
                valid = ", ".join(sorted(declared)) or "none"
                raise ValueError(f"{provider} has no option {name!r}; its options: {valid}")
            try:
                TypeAdapter(declared[name]).validate_python(value, strict=True)
            except ValidationError:
                raise ValueError(f"{provider} option {name!r} must be {_type_name(declared[name])}, "
                                 f"got {type(value).__name__} {value!r:.60}") from None
        if provider == "litert" and "delegate" in options:
            from ..providers.litert import delegates

            why = delegates.refusal(options["delegate"], (info.context or {}).get("allowed_delegates", ()))
            if why:
                raise ValueError(f"delegate {why}")
        return options


class OutputAccuracy(_Strict):
    """The worst error an output of a reduced-precision plan showed against ONNX Runtime fp32."""

    max_abs_error: float | None = None
    max_rel_error: float | None = None
    cosine: float | None = None
    top1_agrees: bool | None = None
    error: str | None = None


class PlanFile(_Strict):
    schema_: str = Field(alias="schema")
    model: ModelRef
    inputs: list[Signature]
    outputs: list[Signature]
    providers: list[ProviderEntry]
    placement: str = "first-supported"
    profile: Profile | None = None
    threads: int | None = Field(default=None, ge=1)
    constants: list[str] = []
    constants_sha256: str | None = Field(default=None, pattern=SHA256)
    fallbacks: dict[Annotated[str, Field(pattern=r"^[0-9]+$")], Fallback] = {}  # stage index -> counts
    replaced: list[Replaced] = []
    shapes: dict[str, list[Annotated[int, Field(ge=0)]]] | None = None  # input -> the shape it was placed at
    tolerance: float | None = Field(default=None, gt=0)  # what a reduced-precision plan was gated with
    accuracy: dict[str, OutputAccuracy] | None = None
    adaptation: dict[str, Adaptation] | None = None  # shape bucket -> how an adapting session chose this plan
    stages: list[StageEntry]  # none where every output is an input or a constant (a graph of no nodes)

    @field_validator("threads")
    @classmethod
    def _within_cores(cls, threads: int | None) -> int | None:
        return bounded_threads(threads, "plan.json's threads")

    @model_validator(mode="after")
    def _outputs_given(self) -> PlanFile:
        given = {name for stage in self.stages for name in stage.outputs} | set(self.constants)
        missing = [o.name for o in self.outputs if o.name not in given | {i.name for i in self.inputs}]
        if missing:
            raise ValueError(f"no stage, constant or input gives output(s) {', '.join(map(repr, missing))}")
        return self


def _type_name(kind: Any) -> str:
    return getattr(kind, "__name__", None) or str(kind).replace("typing.", "")


def parse(text: str | bytes, where: object, schema: str, allowed_delegates: Iterable[str] = ()) -> PlanFile:
    """`plan.json`'s content, validated; its schema must be `schema`; the first violation is a `PlanError`
    naming its field."""
    try:
        data = json.loads(text)
    except ValueError as error:
        raise PlanError(f"{where}: not a valid plan: not JSON ({error}); re-run `uhop-onnx optimize`") from None
    except RecursionError:
        raise PlanError(f"{where}: not a valid plan: its JSON is nested too deep to read; re-run "
                        "`uhop-onnx optimize`") from None
    found = data.get("schema") if isinstance(data, dict) else None
    if found != schema:
        raise PlanError(f"{where}: schema {found!r} is not {schema!r}; re-run `uhop-onnx optimize`")
    try:
        return PlanFile.model_validate_json(text, context={"allowed_delegates": list(allowed_delegates)})
    except ValidationError as error:
        first = error.errors()[0]
        field = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"]).lstrip(".")
        message = first["msg"].removeprefix("Value error, ")
        more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
        raise PlanError(f"{where}: field {field or 'plan'}: {message}{more}; re-run `uhop-onnx optimize`") from None
