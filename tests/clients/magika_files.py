"""File-type classification with magika (its standard_v3_3 model, shipped in its wheel) over files of the Python
standard library of many kinds. magika asks ONNX Runtime for `providers=["CPUExecutionProvider"]`."""

import sysconfig
from pathlib import Path

from magika import Magika

# Patterns under the standard library's folder; the first two files of each, where present.
PATTERNS = ["*.py", "LICENSE.txt", "__pycache__/*.pyc", "lib-dynload/*.so", "config-*/Makefile", "config-*/*.a",
            "ensurepip/_bundled/*.whl", "idlelib/Icons/*.gif", "idlelib/Icons/*.png", "idlelib/*.def",
            "email/*.rst", "test/*.pem", "test/*.wav", "test/*.xml", "test/*.html", "test/*.json",
            "test/*.c", "test/*.sh", "test/*.zip", "test/*.tar", "turtledemo/*.cfg"]


def build() -> Magika:
    return Magika()


def inputs() -> list:
    """Batches of paths: the whole set at once, as `magika -r` sends it."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [[p for pattern in PATTERNS for p in sorted(root.glob(pattern))[:2]]]


def call(magika: Magika, paths: list) -> list:
    return [{"path": str(p), "label": str(r.output.label), "dl": str(r.dl.label), "score": float(r.score)}
            for p, r in zip(paths, magika.identify_paths(paths))]


def sessions(magika: Magika) -> dict:
    return {"standard_v3_3": magika._onnx_session}
