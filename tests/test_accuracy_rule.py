"""One accuracy rule: the gate, `compare`, `verify_bundle` and adaptive sessions judge outputs alike (one NaN
rule, one relative error), and `compare` holds a gated plan to its gate's rule unless told otherwise."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import uhop_onnx
from uhop_onnx.foundation.compare import tolerance_for
from uhop_onnx.models import cnn
from uhop_onnx.precision import FP32_TOLERANCE, compare, errors, gate, scaled

from .support import uhop

NAN = np.array([[1.0, np.nan, np.inf, -2.0]])


@pytest.mark.parametrize("rule", [FP32_TOLERANCE, scaled(1e-2)])
def test_nan_matched_by_nan_and_equal_infinities_agree_everywhere(rule):
    assert compare(NAN, NAN.copy(), rule)["ok"]
    assert gate([errors({"y": NAN}, {"y": NAN.copy()})], rule.get("scaled", 1e-2))[0]
    for other in (np.array([[1.0, 0.0, np.inf, -2.0]]), np.array([[1.0, np.nan, -np.inf, -2.0]])):
        result = compare(other, NAN, rule)
        assert not result["ok"] and result["nonfinite"] == 1, result
        assert not gate([errors({"y": other}, {"y": NAN})], 1e6)[0]


def test_one_relative_error_of_the_largest_reference_magnitude():
    want, got = np.array([10.0, 0.001]), np.array([10.0, 0.002])
    for rule in (None, FP32_TOLERANCE, scaled(1e-2)):
        assert compare(got, want, rule)["max_rel_error"] == pytest.approx(1e-4)
    assert gate([errors({"y": got}, {"y": want})], 1e-2)[1]["y"]["max_rel_error"] == pytest.approx(1e-4)
    assert not compare(got, want, FP32_TOLERANCE)["ok"]  # element by element, 0.001 off a 0.001
    assert compare(got, want, scaled(1e-4))["ok"]  # 0.001 <= 1e-4 * (1 + 10)


def test_the_scaled_rule_is_the_gates():
    want = np.array([[10.0, -2.0]])
    for got, inside in ((np.array([[10.1, -2.0]]), True), (np.array([[10.2, -2.0]]), False)):
        assert compare(got, want, scaled(1e-2))["ok"] is inside
        assert gate([errors({"y": got}, {"y": want})], 1e-2)[0] is inside


def test_shapes_and_non_numbers():
    assert compare(np.zeros(3), np.zeros(4), FP32_TOLERANCE) == {"ok": False, "error": "shape [3], expected [4]"}
    words = np.array(["a", "b"])
    assert compare(words, words.copy(), FP32_TOLERANCE)["ok"] and not compare(words, words[::-1], FP32_TOLERANCE)["ok"]


def test_compare_follows_the_plan_unless_told():
    assert tolerance_for(None) == FP32_TOLERANCE and tolerance_for(1e-2) == {"scaled": 1e-2}
    assert tolerance_for(1e-2, rtol=1e-3) == {"rtol": 1e-3, "atol": FP32_TOLERANCE["atol"]}


def test_the_compare_command_holds_a_gated_plan_to_its_gate(tmp_path):
    """A LiteRT fp16 plan is outside fp32's tolerance; marked gated at 1e-2, `compare` passes it at that rule."""
    onnx.save(cnn(), tmp_path / "cnn.onnx")
    plan = uhop_onnx.optimize(str(tmp_path / "cnn.onnx"), providers=["litert"], profile=False)
    for tolerance, code in ((None, 1), (1e-2, 0)):
        folder = tmp_path / f"plan-{tolerance}"
        plan.save(folder, report=False)
        data = json.loads((folder / "plan.json").read_text())
        data["stages"] = [{**stage, "precision": "fp16"} for stage in data["stages"]]  # as litert[fp16] saves them
        if tolerance is not None:
            data |= {"tolerance": tolerance, "accuracy": {}}
        (folder / "plan.json").write_text(json.dumps(data))
        result = uhop("compare", str(folder), "--json")
        assert result.returncode == code, result.stdout + result.stderr
        assert json.loads(result.stdout)["tolerance"] == tolerance_for(tolerance)
    told = uhop("compare", str(tmp_path / "plan-0.01"), "--rtol", "1e-4", "--json")
    assert told.returncode == 1 and json.loads(told.stdout)["tolerance"]["rtol"] == 1e-4


def test_an_output_larger_than_a_chunk_is_judged_as_a_whole():
    """`compare` works `CHUNK` elements at a time: what each chunk finds adds up to the output's figures."""
    from uhop_onnx.precision.accuracy import CHUNK

    want = np.linspace(-1.0, 1.0, 2 * CHUNK + 3, dtype=np.float32)
    got = want.copy()
    got[CHUNK + 1] = np.inf  # the second chunk: outside every tolerance
    got[-1] += np.float32(0.5)  # the last, partial chunk: the largest error
    figures = compare(got, want, {"rtol": 1e-4, "atol": 1e-5})
    assert not figures["ok"] and figures["nonfinite"] == 1
    assert figures["max_abs_error"] == pytest.approx(0.5) and figures["scale"] == pytest.approx(2.0)
    got[CHUNK + 1] = want[CHUNK + 1]
    assert not compare(got, want, {"rtol": 1e-4, "atol": 1e-5})["ok"]  # the last chunk's error alone
    got[-1] = want[-1]
    assert compare(got, want, {"rtol": 0.0, "atol": 0.0})["ok"] and compare(got, want)["cosine"] == pytest.approx(1.0)
