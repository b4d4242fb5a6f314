"""A stage at reduced precision, made with the vendors' own tools: calibration values, int8 by ONNX Runtime's
quantizer (static QDQ or dynamic) or NNCF, fp16 by onnxconverter-common, and TensorRT's calibration table.

NNCF and onnxconverter-common come with the `quantize` extra and are imported only when used; a variant
needing one that is missing is not offered (`offers`), with a warning naming the extra.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cache, partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from uhop_onnx.foundation import ortlib
from uhop_onnx.foundation.cache import cache_dir
from uhop_onnx.foundation.errors import first_line, logger, missing_module
from uhop_onnx.foundation.files import atomic_file, temporary_folder
from uhop_onnx.foundation.host import cpu_features, host_arch
from uhop_onnx.foundation.inputs import feeds_digest


if TYPE_CHECKING:
    import onnx

log = logger(__name__)

EXTRA = "pip install 'uhop-onnx[quantize]'"


@cache
def offers(module: str, variant: str) -> bool:
    """Whether `module` (from the `quantize` extra) can be imported, so the `variant` needing it is offered;
    when not, one warning per process names the variant and the install command."""
    reason = missing_module(module, EXTRA)
    if reason:
        log.warning("%s is not offered: %s", variant, reason)
    return reason is None


# quantization method -> the module (of the `quantize` extra) it needs, and the tool's name
NEEDS = {"nncf": ("nncf", "NNCF")}


def usable(methods: Sequence[str], who: str) -> tuple[str, ...]:
    """The int8 `methods` this host can run, in order: those whose module (`NEEDS`) imports (`offers`)."""
    return tuple(m for m in methods if m not in NEEDS or offers(NEEDS[m][0], f"{who} int8 by {NEEDS[m][1]}"))


def reduce_range(cpu: tuple[str, Iterable[str]] | None = None) -> bool:
    """Whether ONNX Runtime's quantizer keeps weights to 7 bits (`reduce_range`) for the CPU that runs the
    stage (`cpu`: its arch and ISA extensions as a target profile names them; None: this host's), as its
    documentation advises on x86-64 without VNNI: there its u8 x s8 kernels sum pairs of products in int16
    (`vpmaddubsw`), which full 8-bit weights can saturate."""
    arch, isa = cpu if cpu is not None else (host_arch(), cpu_features())
    return arch == "x86_64" and not any("vnni" in name.lower() for name in isa)


class Calibration:
    """Calibration samples over a model's inputs, and the fp32 values (ONNX Runtime CPU) of any tensor of
    that model on them: what a stage cut from the model is quantized on, for the CPU that will run it (`cpu`,
    as `reduce_range` takes it: a target board's; None: this host)."""

    def __init__(self, model, samples: Sequence[Mapping[str, np.ndarray]],
                 cpu: tuple[str, Iterable[str]] | None = None):
        self.model = model
        self.samples = [dict(s) for s in samples]
        self.reduce_range = reduce_range(cpu)
        self.digest = feeds_digest({f"{k}/{name}": v for k, s in enumerate(self.samples) for name, v in s.items()})
        self._values: list[dict[str, np.ndarray]] = [dict(s) for s in self.samples]
        self._ranges: dict[str, tuple[float, float] | None] = {}

    def at(self, names: Sequence[str]) -> list[dict[str, np.ndarray]]:
        """Per sample, the values of the tensors `names`."""
        missing_names = [n for n in dict.fromkeys(names) if n not in self._values[0]]
        if missing_names:
            for values, got in zip(self._values, self._run(missing_names)):
                values.update(got)
        return [{n: values[n] for n in names} for values in self._values]

    def ranges(self, names: Sequence[str], keep: Sequence[str] = ()) -> dict[str, tuple[float, float]]:
        """Per float tensor of `names`, the least and greatest value it takes over the samples (ONNX Runtime
        fp32), as int8 scales are chosen from; only the extremes are kept, not the values, but for the
        names in `keep`, whose values `at` then has without another pass over the samples."""
        missing_names = [n for n in dict.fromkeys(names) if n not in self._ranges]
        if missing_names:
            seen: dict[str, tuple[float, float]] = {}
            for values, got in zip(self._values, self._run(missing_names)):
                values.update({n: got[n] for n in keep if n in got})
                for name, value in got.items():
                    if value.dtype.kind == "f" and value.size:
                        lo, hi = seen.get(name, (math.inf, -math.inf))
                        seen[name] = (min(lo, float(value.min())), max(hi, float(value.max())))
            self._ranges.update({name: seen.get(name) for name in missing_names})
        return {n: self._ranges[n] for n in names if self._ranges.get(n) is not None}

    def _run(self, names: list[str]):
        """Per sample, the values of the model's tensors `names` (ONNX Runtime CPU; its inputs as given)."""
        import onnx

        from uhop_onnx.model.loader import reference_session

        given = [n for n in names if n in self.samples[0]]
        computed = [n for n in names if n not in self.samples[0]]
        if computed:
            model = onnx.ModelProto()
            model.CopyFrom(self.model)
            known = {v.name: v for v in (*model.graph.value_info, *model.graph.output)}
            model.graph.output.extend(known.get(n) or onnx.ValueInfoProto(name=n) for n in computed
                                      if n not in {o.name for o in model.graph.output})
            session = reference_session(model)
            inputs = {i.name for i in session.get_inputs()}
        for sample in self.samples:
            got = session.run(computed, {k: v for k, v in sample.items() if k in inputs}) if computed else []
            yield {**{n: sample[n] for n in given}, **dict(zip(computed, got))}

    def of(self, model: onnx.ModelProto) -> list[dict[str, np.ndarray]]:
        """Per sample, the values of a stage's inputs."""
        return self.at([i.name for i in model.graph.input])


def stage_values(model: onnx.ModelProto) -> list[str]:
    """A stage's inputs and every value its nodes compute: the tensors whose ranges quantize it."""
    return [i.name for i in model.graph.input] + [out for node in model.graph.node for out in node.output if out]


def quantize_int8(model: onnx.ModelProto, calibration: Calibration | None, method: str = "static"):
    """`model` (a stage cut from the calibration's model) as int8, by `method`:
    - "static": QDQ from ONNX Runtime's `quant_pre_process` and `quantize_static` (per channel), calibrated
      on the values its inputs take over the samples (weights in 7 bits where `reduce_range`);
    - "dynamic": ONNX Runtime's `quantize_dynamic` of its MatMuls (weights int8 per channel, activations
      quantized at run time, so no calibration);
    - "nncf": QDQ from NNCF's post-training quantization (`nncf.quantize`, with its bias correction) on the
      same values;
    - "qnn": QDQ as ONNX Runtime configures it for the QNN EP's HTP, on the same values.
    Kept in the cache by the model's bytes, the method and the calibration's digest, so the same data gives
    the same model."""
    import onnx

    data = model.SerializeToString(deterministic=True)
    digest = "none" if method == "dynamic" else calibration.digest
    seven = calibration.reduce_range if calibration is not None else reduce_range()
    reduced = "-7bit" if method in ("static", "dynamic") and seven else ""
    path = cache_dir() / "quantized" / f"{hashlib.sha256(data).hexdigest()[:32]}-{method}{reduced}-{digest}.onnx"
    if path.is_file():
        try:
            return onnx.load_from_string(path.read_bytes())
        except Exception as error:  # noqa: BLE001 - a damaged cache entry is made again
            log.warning("quantized stage %s is unreadable (%s); quantizing again", path, first_line(error))
    quantize = partial(QUANTIZERS[method], reduce_range=seven) if reduced else QUANTIZERS[method]
    quantized = _in_files(model, quantize, None if method == "dynamic" else calibration.of(model))
    try:
        with atomic_file(path, "wb") as handle:
            handle.write(quantized.SerializeToString(deterministic=True))
    except OSError as error:
        log.warning("could not keep the quantized stage in the cache at %s: %s", path, error)
    return quantized


def _in_files(model, quantize: Callable[[Path, Path, list | None], None], samples: list | None):
    """`quantize(source, target, samples)` run on `model` written to a temporary folder (ONNX Runtime's
    quantizer reads and writes files), after `quant_pre_process` where it accepts the model."""
    import onnx
    from onnxruntime.quantization.shape_inference import quant_pre_process

    # ONNX Runtime's quantizer (and NNCF) make sessions through `onnxruntime.InferenceSession` themselves
    with ortlib.own_session(), temporary_folder("quantize") as folder:
        source, prepared, target = (Path(folder) / name for name in ("in.onnx", "pre.onnx", "out.onnx"))
        onnx.save(model, source)
        try:
            quant_pre_process(str(source), str(prepared), skip_symbolic_shape=True)
        except Exception as error:  # noqa: BLE001 - the stage is quantized as it is
            log.info("quant_pre_process refused a stage (%s); quantizing it as it is", first_line(error))
            prepared = source
        quantize(prepared, target, samples)
        return onnx.load(target)


class _Reader:
    """The samples as ONNX Runtime's `CalibrationDataReader` reads them."""

    def __init__(self, samples: list[dict[str, np.ndarray]]):
        self.left = iter(samples)

    def get_next(self):
        return next(self.left, None)


def _static(source: Path, target: Path, samples: list, reduce_range: bool = False) -> None:
    from onnxruntime.quantization import QuantFormat, quantize_static

    quantize_static(str(source), str(target), _Reader(samples), quant_format=QuantFormat.QDQ, per_channel=True,
                    reduce_range=reduce_range)


def _dynamic(source: Path, target: Path, samples: None, reduce_range: bool = False) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(source), str(target), op_types_to_quantize=["MatMul"], per_channel=True,
                     weight_type=QuantType.QInt8, reduce_range=reduce_range)


def _nncf(source: Path, target: Path, samples: list) -> None:
    """NNCF's lines go where uhop-onnx's own logs go and its progress bars nowhere: neither on stdout,
    which `--json` output owns."""
    import contextlib
    import io

    import nncf
    import onnx

    nncf_log = logging.getLogger("nncf")
    nncf_log.handlers, nncf_log.propagate = [], True
    with contextlib.redirect_stdout(io.StringIO()):
        quantized = nncf.quantize(onnx.load(source), nncf.Dataset(samples), subset_size=len(samples))
    onnx.save(quantized, target)


def _qnn(source: Path, target: Path, samples: list) -> None:
    """QDQ as ONNX Runtime prepares a model for the QNN EP's HTP: `qnn_preprocess_model`, then `quantize` with
    the configuration `get_qnn_qdq_config` gives (uint8 activations and weights)."""
    import onnx
    from onnxruntime.quantization import quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config, qnn_preprocess_model

    model, plain, prepared = onnx.load(source), target.with_name("plain.onnx"), target.with_name("qnn.onnx")
    del model.metadata_props[:]  # qnn_preprocess_model (onnxruntime 1.32) fails on a model that has any
    onnx.save(model, plain)
    if not qnn_preprocess_model(str(plain), str(prepared)):
        prepared = plain
    quantize(str(prepared), str(target), get_qnn_qdq_config(str(prepared), _Reader(samples)))


QUANTIZERS = {"static": _static, "dynamic": _dynamic, "nncf": _nncf, "qnn": _qnn}


def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with float16 weights and compute (onnxconverter-common's `convert_float_to_float16`), its
    inputs and outputs kept float32 so it plugs into the plan unchanged."""
    from onnxconverter_common import float16

    return float16.convert_float_to_float16(model, keep_io_types=True)


def trt_calibration_table(model: onnx.ModelProto, calibration: Calibration, folder: Path) -> str:
    """The file name, in `folder` (TensorRT's engine cache, where the TensorRT EP reads it), of the int8
    calibration table of `model`: each float tensor's symmetric range, max |value| over the calibration
    samples (`Calibration.ranges`), written by ONNX Runtime's `write_calibration_table` (the flatbuffers
    format the EP reads with `trt_int8_use_native_calibration_table` off)."""
    from onnxruntime.quantization import write_calibration_table
    from onnxruntime.quantization.calibrate import TensorData

    data = model.SerializeToString(deterministic=True)
    name = f"calibration-{hashlib.sha256(data).hexdigest()[:32]}-{calibration.digest}.flatbuffers"
    if (folder / name).is_file():
        return name
    ranges = calibration.ranges(stage_values(model))
    table = {tensor: TensorData(lowest=np.float32(-peak), highest=np.float32(peak))
             for tensor, peak in ((t, max(abs(lo), abs(hi))) for t, (lo, hi) in ranges.items())}
    with temporary_folder("calibrate") as work:
        write_calibration_table(table, work)
        with atomic_file(folder / name, "wb") as handle:
            handle.write((Path(work) / "calibration.flatbuffers").read_bytes())
    return name
