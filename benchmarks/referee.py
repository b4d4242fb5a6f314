"""What a quantized or fp16 model is held to against ONNX Runtime, and how the candidates a session offers fare.

    python benchmarks/referee.py [--models int8-qdq,fp16,ocr-rec-qdq] [--inputs 4]

Models, each written by another tool: `int8-qdq`, timm's ResNet-18 quantized by onnxruntime.quantization
(`quantize_static`, QDQ); `fp16`, the same network converted by onnxconverter-common (`keep_io_types`); and
`ocr-rec-qdq`, the PP-OCR text recognizer rapidocr ships, quantized by `quantize_static` (QDQ, int8 weights and
activations) on text lines drawn with Pillow, at 1x3x48x320. For each: the tolerance the session holds its
outputs to (`precision.own`), and per candidate an adapting session offers (OpenVINO and LiteRT, whole or
first), its worst max abs error against ONNX Runtime over the checked inputs (none of them calibration inputs),
whether it is admitted, and its task-level agreement (top-1 class; the recognizer's greedy CTC text).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import uhop_onnx  # noqa: E402
from uhop_onnx.foundation.errors import first_line  # noqa: E402
from uhop_onnx.precision import compare, own  # noqa: E402
from uhop_onnx.runtime.compile import compile_plan  # noqa: E402

REC_SHAPE = (1, 3, 48, 320)


def _lines(count: int, seed: int) -> list[np.ndarray]:
    """Text lines drawn with Pillow's own font, normalised as PP-OCR's recognizer expects (x/127.5 - 1)."""
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    font = ImageFont.load_default(size=30)
    lines = []
    for _ in range(count):
        text = "".join(rng.choice(list("ABCDEFGHJKLMNPRSTUVWXYZ0123456789 abcdefghijkmnopqrstuvwxyz"), 12))
        image = Image.new("RGB", REC_SHAPE[:1:-1], (255, 255, 255))
        ImageDraw.Draw(image).text((int(rng.integers(2, 20)), 6), text, fill=(0, 0, 0), font=font)
        array = np.asarray(image, np.float32).transpose(2, 0, 1)[None] / 127.5 - 1.0
        lines.append(np.ascontiguousarray(array))
    return lines


def _recognizer(folder: Path, seed: int) -> Path:
    """rapidocr's recognizer quantized by `quantize_static` (QDQ) on drawn text lines."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    import rapidocr

    source = next(Path(rapidocr.__file__).parent.glob("models/*rec*.onnx"))
    fixed = onnx.load(source)
    name = fixed.graph.input[0].name
    samples = iter([{name: x} for x in _lines(8, seed)])

    class Lines(CalibrationDataReader):
        def get_next(self):
            return next(samples, None)

    out = folder / "ocr-rec-qdq.onnx"
    quantize_static(str(source), str(out), Lines(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    return out


def _task(output: np.ndarray, model: str) -> tuple:
    """What the program makes of an output: the recognizer's greedy CTC indices, else the top-1 class."""
    if model == "ocr-rec-qdq":
        best = output[0].argmax(-1)
        return tuple(int(k) for i, k in enumerate(best) if k and (i == 0 or k != best[i - 1]))
    return tuple(output.reshape(output.shape[0], -1).argmax(1))


def main(models: str = "int8-qdq,fp16,ocr-rec-qdq", inputs: int = 4) -> None:
    from benchmarks.corpus_models import case

    folder = Path(tempfile.mkdtemp(prefix="uhop-referee-"))
    print("| model | kind | tolerance (per output) | candidate | worst max abs error | admitted | task agrees |")
    print("|---|---|---|---|---|---|---|")
    for name in models.split(","):
        if name == "ocr-rec-qdq":
            path = _recognizer(folder, seed=0)
            checked = [{onnx.load(path).graph.input[0].name: x} for x in _lines(inputs, seed=1)]
        else:
            path, feeds = case(name)
            rng = np.random.default_rng(1)
            checked = [{k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in feeds.items()}
                       for _ in range(inputs)]
        model = onnx.load(path)
        rules = own.tolerances(model, lambda: model)
        rule = own.describe(next(iter(rules.values())))
        ort = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        wants = [ort.run(None, f) for f in checked]
        for label in ("openvino", "litert"):  # each runtime first, ONNX Runtime for the rest, as the search offers
            try:
                plan = uhop_onnx.optimize(str(path), providers=[label, "ort-cpu"], profile=False)
                executor = compile_plan(plan)
                gots = [executor.run(None, f) for f in checked]
                executor.close()
            except Exception as error:  # noqa: BLE001 - a candidate that fails is reported as such
                print(f"| {name} | {own.kind(model)} | {rule} | {label} | failed: {first_line(error)} | no | - |")
                continue
            worst, admitted, agrees = 0.0, True, True
            for got, want in zip(gots, wants):
                for out, a, b in zip(rules, got, want):
                    verdict = compare(a, b, rules[out])
                    worst, admitted = max(worst, verdict["max_abs_error"] or 0.0), admitted and verdict["ok"]
                agrees = agrees and _task(got[0], name) == _task(want[0], name)
            where = "+".join(sorted({s.provider for s in plan.stages}))
            print(f"| {name} | {own.kind(model)} | {rule} | {label} ({where}) | {worst:.4g} | "
                  f"{'yes' if admitted else 'no'} | {'yes' if agrees else 'no'} |")


if __name__ == "__main__":
    typer.run(main)
