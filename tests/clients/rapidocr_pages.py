"""OCR with rapidocr: its PP-OCRv6 detector, the angle classifier and the PP-OCRv6 recognizer, shipped in its wheel,
on a scanned page that scikit-image ships. rapidocr asks ONNX Runtime for
`("CPUExecutionProvider", {"arena_extend_strategy": "kSameAsRequested"})` and reads the recognizer's
alphabet from the model's metadata."""

from pathlib import Path

import skimage.data
from rapidocr import RapidOCR


def build() -> RapidOCR:
    return RapidOCR(params={"Global.log_level": "warning"})


def inputs() -> list:
    return [str(Path(skimage.data.__file__).with_name("page.png"))]


def call(engine: RapidOCR, picture: str) -> dict:
    out = engine(picture)
    return {"texts": list(out.txts), "boxes": out.boxes.tolist(), "scores": list(out.scores)}


def sessions(engine: RapidOCR) -> dict:
    """The library's sessions, by model (made on the first call)."""
    return {"det": engine.text_det.session.session, "cls": engine.text_cls.session.session,
            "rec": engine.text_rec.session.session}
