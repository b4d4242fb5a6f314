"""The rknn-toolkit2 virtual environment: created once, beside ours, because the toolkit pins old numpy/onnx/torch.

The lean recipe: the toolkit's own requirements, a CPU torch (pip takes the local CPU wheel where the
machine has one), setuptools < 81 (the toolkit imports `pkg_resources`), then the toolkit with --no-deps.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

TOOLKIT = "rknn-toolkit2==2.5.0"
REQUIREMENTS = (
    "numpy<=1.26.4",
    "onnx>=1.16.1,<=1.18.0",
    "onnxruntime>=1.17.0",
    "protobuf>=4.21.6,<=4.25.4",
    "psutil>=5.9.0",
    "ruamel.yaml>=0.17.21",
    "scipy>=1.9.3",
    "tqdm>=4.64.1",
    "opencv-python-headless>=4.5.5.64",  # the same cv2 as opencv-python, without the desktop libraries
    "fast-histogram>=0.11",
)
TORCH = "torch==2.13.0"  # pip's version check then complains about the toolkit's torch<=2.4 pin, harmlessly
READY = ".uhop-rknn-ready"  # written last, holding the toolkit requirement the venv was built for


def venv_path() -> Path:
    """`$UHOP_RKNN_VENV`, else `~/.cache/uhop-onnx/rknn-venv`."""
    return Path(os.environ.get("UHOP_RKNN_VENV") or Path.home() / ".cache" / "uhop-onnx" / "rknn-venv")


def venv_python(venv: Path | None = None) -> Path:
    return (venv or venv_path()) / "bin" / "python"


def is_ready(venv: Path | None = None) -> bool:
    """Whether the venv was completed for this toolkit version."""
    venv = venv or venv_path()
    marker = venv / READY
    return venv_python(venv).exists() and marker.is_file() and marker.read_text().strip() == TOOLKIT


def create_venv(venv: Path | None = None, python: str = sys.executable) -> Path:
    """Create (or finish) the toolkit venv and return its path; does nothing when it is already complete."""
    venv = venv or venv_path()
    if is_ready(venv):
        log.info("rknn-toolkit2 environment already at %s", venv)
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    if not venv_python(venv).exists():
        _run([python, "-m", "venv", str(venv)])
    pip = [str(venv_python(venv)), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    _run([*pip, *REQUIREMENTS])
    _run([*pip, TORCH])
    _run([*pip, "setuptools<81"])
    _run([*pip, "--no-deps", TOOLKIT])
    _run([str(venv_python(venv)), "-c", "from rknn.api import RKNN"])
    (venv / READY).write_text(TOOLKIT + "\n")
    return venv


def _run(command: list[str]) -> None:
    log.info("running %s", " ".join(command))
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        from uhop_onnx.foundation.errors import ProviderError

        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise ProviderError(f"setting up rknn-toolkit2 failed at: {' '.join(command)}\n{tail}")
