"""What every provider is: presence, a capability table plus the runtime's own query, and compilation, and what
it declares as data: the device kind its stages compute on, its precisions (`Lowering`s) and its bundle format
(`ArtifactFormat`).

A provider is a loader (`compile`) of runners (`runner.Runner`).
"""

from __future__ import annotations

import copy
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from uhop_onnx.foundation.errors import BundleError, ProviderError, first_line, logger
from uhop_onnx.foundation.host import bounded_threads

from .capability import CapabilityTable, Support
from .runner import PerShapeRunner, Runner

log = logger(__name__)

if TYPE_CHECKING:
    import onnx


@dataclass(frozen=True)
class Availability:
    """Whether a provider can run on this host, and if not, why and how to install it."""

    id: str
    present: bool
    version: str | None = None
    device: str | None = None
    reason: str = ""
    install: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Artifact:
    """A stage written in its runtime's own format, as a bundle records it. `files` are relative to the
    bundle; `options` is what the provider's `load_artifact` needs besides them (EP, delegate, core mask...)."""

    format: str  # "onnx", "openvino-ir", "tflite", "rknn", "kernels"
    files: list[str]
    options: dict[str, Any] = field(default_factory=dict)
    tolerance: dict[str, float] | None = None  # {"rtol", "atol"} where looser than fp32

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Absent(Exception):
    """Raised by `Provider.probe` with the reason a provider cannot run here, and what would fix it
    when that is not the provider's own `install` command."""

    def __init__(self, reason: str, install: str | None = None):
        super().__init__(reason)
        self.install = install


def installed(package: str, distribution: str, *patterns: str) -> str | None:
    """The version of `distribution` where the package `package` is on the path, found without importing it,
    with a file matching each glob of `patterns` in its folder; None otherwise. The version is read from the
    metadata beside the package found (another copy's, left earlier on the path, would name another version),
    else from the first on the path (an editable install keeps its metadata apart)."""
    from importlib.metadata import PackageNotFoundError, distributions, version
    from importlib.util import find_spec

    spec = find_spec(package)
    folders = [Path(f) for f in (spec.submodule_search_locations or [])] if spec is not None else []
    found = [f for f in folders if all(next(f.glob(p), None) for p in patterns)]
    if not found:
        return None
    beside = next(distributions(name=distribution, path=[str(found[0].parent)]), None)
    try:
        return beside.version if beside is not None else version(distribution)
    except PackageNotFoundError:
        return None


def probe_model() -> bytes:
    """Relu over four floats, serialized: the smallest model that proves a runtime reads and computes."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="probe")], "probe", [x], [y])
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


# Where a provider's stages compute: this host's (or board's) CPU cores, a GPU, an NPU, or the device an external
# delegate drives.
DEVICE_KINDS = ("cpu", "gpu", "npu", "delegate")


@dataclass(frozen=True)
class Lowering:
    """How a provider builds a stage at one precision. `model(provider, stage)` makes the stage model it compiles
    (None: the stage itself, the runtime being told the precision); `options` are what a variant at this
    precision sets in its options (a None value removes that option); `methods` the ways an int8 stage is made
    (`providers.quantize.quantize_int8`'s, the default first); `offered(provider)` whether this host offers the
    precision (None: always)."""

    model: Callable[[Provider, onnx.ModelProto], onnx.ModelProto] | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    methods: tuple[str, ...] = ()
    offered: Callable[[Provider], bool] | None = None


def quantized(provider: Provider, model: onnx.ModelProto) -> onnx.ModelProto:
    """The int8 stage a QDQ quantizer makes on the provider's calibration: the method its `quantization` option
    names, else its default one."""
    from .quantize import quantize_int8

    return quantize_int8(model, provider.calibration, provider.options.get("quantization") or provider.quantizations()[0])


FP32 = Lowering()  # the stage as it is


class ArtifactFormat(ABC):
    """A provider's stages written in its runtime's own format for a bundle, as one object: its `name`
    (`Artifact.format`), why this host cannot write it (`blocker`), `export` a stage, `load` one back as a
    runner, and the `simulator` that runs its stages where the runtime is absent (named `simulator_name`)."""

    name: ClassVar[str]
    simulator_name: ClassVar[str] = ""

    def blocker(self, provider: Provider) -> str | None:
        """Why this host cannot write `provider`'s stages; None when it can."""
        return None

    @abstractmethod
    def export(self, provider: Provider, model: onnx.ModelProto, folder: Path, stem: str) -> Artifact:
        """Write a stage of `provider` into `folder` (files named `stem.*`)."""

    @abstractmethod
    def load(self, folder: Path, artifact: Mapping[str, Any], threads: int | None, exclusive: bool, trusted: bool,
             allowed_delegates: Iterable[str | os.PathLike]) -> Runner:
        """The runner of a stage `export` wrote (see `Provider.load_artifact`)."""

    def simulator(self, provider: Provider) -> Provider | None:
        """The provider that runs `provider`'s stages here when its runtime is absent; None when there is none."""
        return None


class Provider(ABC):
    """One way to run ONNX nodes: a runtime on a device.

    What a provider is, it declares as data: `kind` (the device its stages compute on), `lowerings` (its
    precisions, each with how a stage is built at it: `precisions`, `variants`, `lower` and `bundle_precisions`
    follow), `format` (its bundle format: `artifact_format`, `export_blocker`, `export`, `load_artifact` and
    `simulator` follow) and `static_shapes` (`compile` builds such a stage once per shape it runs at). Beside
    them it defines `probe` and `build`, and optionally `locate`, `query` and `check`.
    """

    id: ClassVar[str]
    install: ClassVar[str]  # the command that makes this provider present
    table: ClassVar[CapabilityTable]
    kind: ClassVar[str] = "cpu"  # the device its stages compute on (`DEVICE_KINDS`), unless its options say another
    npu_resource: ClassVar[str] = "npu"  # the custom resource a Ray node advertises for this provider's NPU
    # precision -> how a stage is built at it, fp32 (its default) first
    lowerings: ClassVar[Mapping[str, Lowering]] = {"fp32": FP32}
    format: ClassVar[ArtifactFormat | None] = None  # its stages in a bundle; None: it writes none
    # Derived from the above: the format's name (`Artifact.format`: "onnx", "openvino-ir"...), the precisions its
    # `export` writes a stage at (fp32: its default one), whatever this host computes, and what `simulator()`
    # runs its stages in, as reports name it.
    artifact_format: ClassVar[str | None] = None
    bundle_precisions: ClassVar[tuple[str, ...]] = ("fp32",)
    simulator_name: ClassVar[str] = ""
    # option -> the type its value must have (as pydantic reads a type), checked when a plan file is read
    option_types: ClassVar[dict[str, Any]] = {}
    option_names: ClassVar[frozenset[str]] = frozenset()  # the keys of `option_types`
    # Options that would set a precision (`fp16`): refused, since a precision is asked for as one (`precision`,
    # `at_precision`), which labels the stage and checks it at that precision's tolerance.
    precision_options: ClassVar[frozenset[str]] = frozenset()
    appended: bool = False  # the last resort `resolve` added to a list that did not name it: it runs only the rest
    # A runtime that builds for fixed shapes: its capability is asked of the model at the measured shapes, its
    # shape arithmetic folded, and a stage is built once per shape and shape value it is run at (`PerShapeRunner`).
    static_shapes: ClassVar[bool] = False
    # A runtime whose stages are converted, checked and kept on this machine (a later build of the same stage at the
    # same shapes loads the conversion): the search converts a plan's stages on it before the plan is timed in its
    # own process (`measure.time_plans_in_processes`), so that process holds no converter.
    keeps_conversions: ClassVar[bool] = False
    # The precision this instance builds stages at (`precisions` lists those it offers), and for int8 the
    # calibration (`providers.quantize.Calibration`) its stages are quantized on.
    precision: str = "fp32"
    calibration: Any = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "option_types" in cls.__dict__:
            cls.option_names = frozenset(cls.option_types)
        if "lowerings" in cls.__dict__:
            cls.bundle_precisions = tuple(dict.fromkeys(("fp32", *cls.lowerings)))
        if "format" in cls.__dict__:
            cls.artifact_format = cls.format and cls.format.name
            cls.simulator_name = cls.format.simulator_name if cls.format else ""

    @classmethod
    def device_kind(cls, options: Mapping[str, Any]) -> str:
        """The device kind (`DEVICE_KINDS`) a stage with `options` computes on: `kind`, unless an option names
        another device."""
        return cls.kind

    def __init__(self, options: Mapping[str, Any] | None = None, threads: int | None = None):
        options = dict(options or {})
        named = [name for name in sorted(self.precision_options) if options.pop(name, False)]
        if named:
            raise ProviderError(f"{self.id}: the {named[0]!r} option would build {named[0]} stages labelled and "
                                f"checked as fp32; ask for precision {named[0]} instead (precision={named[0]!r}, "
                                f"--precision {named[0]})")
        unknown = sorted(set(options) - self.option_names)
        if unknown:
            valid = ", ".join(sorted(self.option_names)) or "none"
            raise ProviderError(f"{self.id}: unknown option(s) {', '.join(unknown)}; valid options: {valid}")
        if threads is not None and threads < 1:
            raise ProviderError(f"threads must be a positive integer, got {threads}")
        self.options = options
        self.threads = bounded_threads(threads)

    @property
    def label(self) -> str:
        """The id, with the device when one is set and a reduced precision: `openvino:GPU`, `openvino[bf16]`."""
        return label(self.id, self.options, self.precision)

    def precisions(self) -> list[str]:
        """The precisions this provider builds stages at on this host (those of `lowerings` it offers), fp32
        first."""
        return [p for p, lowering in self.lowerings.items() if lowering.offered is None or lowering.offered(self)]

    def at_precision(self, precision: str, calibration: Any = None) -> Provider:
        """This provider building its stages at `precision` (int8 quantized on `calibration`), with the options
        its lowering sets."""
        variant = copy.copy(self)
        variant.precision, variant.calibration = precision, calibration
        lowering = self.lowerings.get(precision, FP32)
        if lowering.options:
            merged = {**self.options, **lowering.options}
            variant.options = {k: v for k, v in merged.items() if v is not None}
        return variant

    def quantizations(self) -> tuple[str, ...]:
        """How this provider makes an int8 stage (its int8 lowering's methods that this host can run), the
        default first; the others are named by a `quantization` option, which the label shows."""
        from .quantize import usable

        methods = self.lowerings["int8"].methods if "int8" in self.lowerings else ()
        return usable(methods, self.id) or ("static",)

    def variants(self, precision: str, calibration: Any = None) -> list[Provider]:
        """The ways this provider builds stages at `precision`, each a candidate of its own with its own
        label: at int8 one per quantization (`ort-cpu[int8]`, `ort-cpu[int8-dynamic]`) unless a
        `quantization` option names one; otherwise `at_precision`."""
        if precision != "int8" or "quantization" in self.options:
            return [self.at_precision(precision, calibration)]
        default, *others = self.quantizations()
        named = [self.at_precision(precision, calibration) for _ in others]
        for variant, method in zip(named, others):
            variant.options = {**variant.options, "quantization": method}
        return [self.at_precision(precision, calibration), *named]

    def lower(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """The stage model this instance compiles, as its precision's lowering makes it: int8 as the model its
        quantization makes on its calibration; the model itself where the runtime is told the precision when
        it compiles."""
        lowering = self.lowerings.get(self.precision)
        return lowering.model(self, model) if lowering is not None and lowering.model is not None else model

    def __repr__(self) -> str:
        return f"{type(self).__name__}(options={self.options!r}, threads={self.threads!r})"

    @cached_property
    def availability(self) -> Availability:
        """Present, or absent with the reason, as far as listing it needs: read from the installed files where
        `locate` can tell (so that listing every provider present, and its version, imports no runtime), else
        `probed`. Whether it runs here is `present`."""
        try:
            located = self.locate()
        except Exception as error:  # noqa: BLE001 - an odd installation is for the probe to judge
            log.info("%s: locating it raised %s: %s", self.id, type(error).__name__, first_line(error))
            located = None
        if located is None:
            return self.probed
        version, device = located
        return Availability(self.id, True, version=version, device=device)

    def locate(self) -> tuple[str, str] | None:
        """(runtime version, device) from the installed package's files alone, without importing it, where they
        tell as much as `probe` whether it runs here; None (the default) leaves it to `probe`."""
        return None

    @cached_property
    def probed(self) -> Availability:
        """Present, or absent with the reason, as `probe` finds it. Any exception while importing or probing the
        runtime (a protobuf clash raises `TypeError` on import) makes the provider absent, with it as the
        reason, and leaves every other provider working."""
        try:
            version, device = self.probe()
        except Absent as absent:
            return Availability(self.id, False, reason=str(absent), install=absent.install or self.install,
                                device=self.options.get("device"))
        except Exception as error:  # noqa: BLE001 - a broken runtime fails in any way; it is only absent
            log.info("%s is absent: probing it raised %s: %s", self.id, type(error).__name__, first_line(error))
            return Availability(self.id, False, reason=f"probing {self.id} raised {type(error).__name__}: "
                                f"{first_line(error)}", install=self.install, device=self.options.get("device"))
        return Availability(self.id, True, version=version, device=device)

    @property
    def present(self) -> bool:
        """Whether it runs here, as its probe finds it (the runtime imported, its device found)."""
        return self.probed.present

    def require(self) -> None:
        """Raise a `ProviderError` naming the reason and the install command when not `present`."""
        if not self.present:
            a = self.probed
            hint = f"; to install: {a.install}" if a.install else ""
            raise ProviderError(f"provider {self.id!r} is not available: {a.reason}{hint}")

    @classmethod
    def known_options(cls) -> list[dict[str, Any]]:
        """One options dict per device this provider knows, for `devices`."""
        return [{}]

    @abstractmethod
    def probe(self) -> tuple[str, str]:
        """Return (runtime version, device) or raise `Absent` with the reason."""

    def query(self, model: onnx.ModelProto) -> dict[str, Support]:
        """The runtime's own answer for nodes the table accepted, by node name; nodes absent from the
        answer are taken as supported. The default has no runtime query."""
        return {}

    def check(self, model: onnx.ModelProto) -> None:
        """The build-time check `compile` makes, if it makes one, on `model` (nothing is kept): raises
        `CheckError` where what it builds would differ from ONNX Runtime. The default has no check."""

    def export_blocker(self) -> str | None:
        """Why this host cannot write this provider's stages into a bundle; None when it can."""
        if self.format is None:
            return f"{self.id} cannot write its stages into a bundle yet"
        return self.format.blocker(self)

    def export(self, model: onnx.ModelProto, folder: Path, stem: str) -> Artifact:
        """Write a stage in this runtime's own format into `folder` (files named `stem.*`), for a bundle."""
        if self.format is None:
            raise ProviderError(f"{self.id} cannot write its stages into a bundle yet")
        return self.format.export(self, model, folder, stem)

    @classmethod
    def load_artifact(cls, folder: str | os.PathLike, artifact: Mapping[str, Any], threads: int | None = None,
                      exclusive: bool = True, *, trusted: bool = False,
                      allowed_delegates: Iterable[str | os.PathLike] = ()) -> Runner:
        """The runner of a bundle's stage from what `export` wrote (`Artifact.to_json()`, files relative to
        `folder`). `trusted`: a signature the loader checked covers the files, so native code they name (a
        library, a delegate, an EP plugin) may be loaded; `allowed_delegates`: delegate paths the caller
        allowed. A missing runtime raises `ImportError`; an artifact missing what it needs, a `BundleError`."""
        try:
            return cls._load_artifact(Path(folder), artifact, threads, exclusive, trusted, allowed_delegates)
        except (KeyError, IndexError, TypeError, AttributeError) as error:
            files = ", ".join(map(str, artifact.get("files") or [])) or "no files"
            raise BundleError(f"{cls.id} stage ({files}): its {artifact.get('format')} artifact options are "
                              f"malformed ({type(error).__name__}: {error})") from None

    @classmethod
    def _load_artifact(cls, folder: Path, artifact: Mapping[str, Any], threads: int | None, exclusive: bool,
                       trusted: bool, allowed_delegates: Iterable[str | os.PathLike]) -> Runner:
        """`load_artifact` by this provider's format."""
        if cls.format is None:
            raise BundleError(f"{cls.id} has no bundle format, so a bundle cannot carry its stages")
        return cls.format.load(folder, artifact, threads, exclusive, trusted, allowed_delegates)

    def simulator(self) -> Provider | None:
        """The provider that runs this provider's stages on this host when its runtime is absent (compiled
        from the stage's ONNX, for checks rather than timing), named `simulator_name`; None when there is none."""
        return self.format.simulator(self) if self.format is not None else None

    def compile(self, model: onnx.ModelProto, *, exclusive: bool = True) -> Runner:
        """Build a runner for a standalone ONNX model (`build`). `exclusive` is False when other stages share the
        process, so the runtime must not keep spinning threads between calls. On a runtime that builds for
        fixed shapes (`static_shapes`), a stage with free dimensions or small integer inputs is built once per
        shape and integer value it is run at, simplified there (`PerShapeRunner`)."""
        self.require()
        if self.static_shapes and PerShapeRunner.needed(model):
            return PerShapeRunner(model, lambda shapes, values: self.build_at(model, shapes, values,
                                                                              exclusive=exclusive))
        return self.build(model, exclusive=exclusive)

    def build_at(self, model: onnx.ModelProto, shapes: Mapping[str, tuple], values: Mapping[str, np.ndarray], *,
                 exclusive: bool = True) -> Runner:
        """On a `static_shapes` runtime, the runner of a stage with free dimensions at one set of input shapes and
        values of its small integer inputs: the stage fixed there and simplified (`simplify.at_fixed_shapes`),
        then built."""
        from uhop_onnx.model.simplify import at_fixed_shapes

        return self.build(at_fixed_shapes(model, shapes, values), exclusive=exclusive)

    def build(self, model: onnx.ModelProto, *, exclusive: bool = True) -> Runner:
        """The runner of a stage on this runtime, present here (`compile` checked it); on a `static_shapes`
        runtime the stage's input shapes are fixed."""
        raise NotImplementedError(f"{type(self).__name__} defines neither build nor compile")


def label(ident: str, options: Mapping[str, Any], precision: str) -> str:
    """A provider's name in a plan and its figures: the id, with the device when one is set, and a reduced
    precision with the quantization an option names: `openvino:GPU`, `openvino[bf16]`, `ort-cpu[int8-dynamic]`."""
    device, method = options.get("device"), options.get("quantization")
    suffix = "" if precision == "fp32" else f"[{precision}{f'-{method}' if method else ''}]"
    return (f"{ident}:{device}" if device else ident) + suffix



def output_dtypes(model: onnx.ModelProto) -> dict[str, np.dtype]:
    """Declared numpy dtype of each graph output."""
    from onnx import helper

    return {
        o.name: np.dtype(helper.tensor_dtype_to_np_dtype(o.type.tensor_type.elem_type))
        for o in model.graph.output
        if o.type.tensor_type.elem_type
    }
