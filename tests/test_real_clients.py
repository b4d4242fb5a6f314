"""Real programs, unchanged: libraries from PyPI that call onnxruntime themselves and ship their own models, each
run through its public API on real inputs (tests/clients/) stock, under the plain swap
(`onnxruntime.InferenceSession = uhop_onnx.InferenceSession` before the library is imported), under
`python -m uhop_onnx.exec`, and with sessions placed once at construction over every provider the library's
device name covers (`patch_onnxruntime(adapt=False)`: the library's calls then run on OpenVINO, LiteRT or the
kernels where uhop puts them, not only on the ONNX Runtime plan an adapting session starts on), each in its own
process. The results must be ONNX Runtime's: OCR text the same, boxes within a pixel of rounding, labels the
same, scores within fp32's tolerance, speech timestamps identical.

The uhop runs of this file share one cache folder: the swap run of each library starts cold (nothing known about
its models), the runs that follow start from what it left, so both paths are covered at the cost of one cold
start per library.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from uhop_onnx.precision.own import FP32_CHECK

from .clients.run import CLIENTS as LIBRARIES
from .clients.run import missing

# What a library's results come out within: each of a plan's stages is within fp32's rule of ONNX Runtime, and a
# placed plan's several stages, or a plan and ONNX Runtime side by side, within twice it (`precision.own`).
RTOL, ATOL = FP32_CHECK["rtol"], FP32_CHECK["atol"]

CLIENTS = Path(__file__).with_name("clients")
ROOT = CLIENTS.parent.parent
MODES = {
    "swap": [str(CLIENTS / "run.py"), "--swap"],
    "exec": ["-m", "uhop_onnx.exec", str(CLIENTS / "run.py")],
    "placed": [str(CLIENTS / "run.py"), "--placed"],
}
PIXEL_KEYS = {"box", "boxes"}  # coordinates rounded to whole pixels by the library: one pixel apart is rounding


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("uhop-cache")


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    """The stock result of a client, computed once per client."""
    done = {}

    def result(client: str) -> dict:
        if client not in done:
            done[client] = run_client([str(CLIENTS / "run.py")], client, tmp_path_factory.mktemp("stock"), {})
        return done[client]

    return result


def run_client(prefix: list[str], client: str, folder: Path, env: dict) -> dict:
    """Runs `python PREFIX CLIENT OUT.json` in its own process and returns what it wrote; fails with the
    process's own traceback when it exits non-zero."""
    out = folder / f"{client}.json"
    done = subprocess.run([sys.executable, *prefix, client, str(out)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=600)
    if done.returncode:
        pytest.fail(f"{client} exited {done.returncode}:\n{done.stderr[-6000:]}", pytrace=False)
    return json.loads(out.read_text())


def assert_same(got, want, where: str = "", pixels: bool = False) -> None:
    """`got` equals `want`, floats within `RTOL` and `ATOL` and pixel coordinates within one pixel."""
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{where}.{key}", pixels or key in PIXEL_KEYS)
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]", pixels)
    elif pixels and isinstance(want, (int, float)):
        assert abs(got - want) <= 1, f"{where}: {got} != {want} (more than a pixel apart)"
    elif isinstance(want, float):
        assert math.isclose(got, want, rel_tol=RTOL, abs_tol=ATOL), f"{where}: {got} != {want}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("client", list(LIBRARIES))
def test_results_are_onnxruntimes(client, mode, stock, cache, tmp_path):
    if reason := missing(client):
        pytest.skip(reason)
    want = stock(client)
    assert all(s["module"].startswith("onnxruntime") for s in want["sessions"].values()), want["sessions"]

    got = run_client(MODES[mode], client, tmp_path, {"UHOP_CACHE_DIR": str(cache)})

    assert all(s["module"].startswith("uhop_onnx") for s in got["sessions"].values()), \
        f"the library's sessions are not uhop's: {got['sessions']}"
    assert got["sessions"].keys() == want["sessions"].keys()
    assert all(s["providers"] for s in got["sessions"].values()), got["sessions"]
    assert_same(got["results"], want["results"], client)
