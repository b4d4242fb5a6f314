"""ort-cuda and ort-tensorrt at reduced precision, checked by configuration (no GPU here): the EP options each
variant builds, the calibration table TensorRT reads, and the fp16 model CUDA runs, itself run on ORT CPU."""

from __future__ import annotations

import numpy as np
import pytest

from uhop_onnx.foundation.errors import ProviderError
from uhop_onnx.models import cnn
from uhop_onnx.precision import errors, gate
from uhop_onnx.providers.ort import OrtCpu, OrtCuda, OrtTensorRT
from uhop_onnx.providers.quantize import Calibration

from .conftest import reference


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("UHOP_CACHE_DIR", str(tmp_path / "cache"))


def samples(count: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"input": rng.standard_normal((1, 3, 32, 32)).astype(np.float32)} for _ in range(count)]


def test_tensorrt_fp16_is_trt_fp16_enable_on_the_fp32_stage(tmp_path):
    base = OrtTensorRT({"engine_cache": str(tmp_path)})
    fp16 = base.at_precision("fp16")
    model = cnn()
    assert base.precisions() == ["fp32", "fp16", "int8"] and fp16.label == "ort-tensorrt[fp16]"
    assert fp16.lower(model) is model
    options = fp16.stage_options(model)
    assert options["trt_fp16_enable"] is True and "trt_int8_enable" not in options
    assert base.stage_options(model)["trt_fp16_enable"] is False and base.precision == "fp32"


def test_tensorrt_int8_writes_the_calibration_table_it_names(tmp_path):
    from onnxruntime.quantization.CalTableFlatBuffers.TrtTable import TrtTable

    model = cnn()
    calibration = Calibration(model, samples(4, seed=1))
    int8 = OrtTensorRT({"engine_cache": str(tmp_path)}).at_precision("int8", calibration)
    stage = int8.lower(model)
    options = int8.stage_options(stage)
    assert options["trt_int8_enable"] is True and options["trt_int8_use_native_calibration_table"] is False
    assert options["trt_engine_cache_path"] == str(tmp_path)  # where the EP looks the table name up
    table = TrtTable.GetRootAsTrtTable((tmp_path / options["trt_int8_calibration_table_name"]).read_bytes(), 0)
    ranges = {table.Dict(i).Key().decode(): float(table.Dict(i).Value()) for i in range(table.DictLength())}
    assert {"input", "output"} <= set(ranges)
    assert ranges["input"] == pytest.approx(max(float(np.abs(s["input"]).max()) for s in calibration.samples))
    outputs = [reference(model, s)[0] for s in calibration.samples]
    assert ranges["output"] == pytest.approx(max(float(np.abs(y).max()) for y in outputs), rel=1e-5)
    assert [n.op_type for n in stage.graph.node] == [n.op_type for n in model.graph.node]  # fp32 ops, not QDQ
    assert int8.lower(model).SerializeToString() == stage.SerializeToString()  # the same data, the same table
    with pytest.raises(ProviderError, match="calibration table"):
        int8.stage_options(model)  # a stage that names no table


def test_cuda_fp16_is_an_onnxconverter_common_model_close_to_fp32_on_ort_cpu():
    pytest.importorskip("onnxconverter_common")
    from onnx import TensorProto

    model = cnn()
    fp16 = OrtCuda().at_precision("fp16")
    assert "fp16" in OrtCuda().precisions() and fp16.label == "ort-cuda[fp16]"
    assert fp16.stage_options(model) == OrtCuda().stage_options(model)  # the model changes, not the EP options
    half = fp16.lower(model)
    assert {t.data_type for t in half.graph.initializer} == {TensorProto.FLOAT16}
    assert [i.type.tensor_type.elem_type for i in (*half.graph.input, *half.graph.output)] == [TensorProto.FLOAT] * 2
    runner = OrtCpu().compile(half)
    per_sample = [errors(runner.run(x), {"output": reference(model, x)[0]}) for x in samples(4, seed=9)]
    ok, worst = gate(per_sample, 1e-2)
    assert ok and worst["output"]["max_abs_error"] > 0, worst  # within 1e-2, and not the fp32 model itself


def test_without_the_quantize_extra_cuda_offers_no_fp16_and_says_why(monkeypatch, caplog):
    import sys

    from uhop_onnx.providers.quantize import offers

    monkeypatch.setitem(sys.modules, "onnxconverter_common", None)  # as where the extra is not installed
    offers.cache_clear()
    try:
        assert OrtCuda().precisions() == ["fp32"]
    finally:
        offers.cache_clear()
    assert "ort-cuda fp16 is not offered" in caplog.text and "pip install 'uhop-onnx[quantize]'" in caplog.text
