"""A plan is built whole, then frozen: nothing changes it after (saving included), and its stages keep the fp32
model they were cut as."""

from __future__ import annotations

import dataclasses

import pytest

import uhop_onnx
from uhop_onnx.models import mlp
from uhop_onnx.runtime.plan import Plan


def test_a_plan_is_frozen_and_saving_leaves_it_as_it_was(tmp_path):
    plan = uhop_onnx.optimize(mlp(), providers=["ort-cpu"], profile=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.placement = "changed"
    before = plan.to_json()
    plan.save(tmp_path / "plan")
    assert plan.to_json() == before and plan.folder is None and all(s.sha256 is None for s in plan.stages)
    loaded = Plan.load(tmp_path / "plan")
    assert loaded.folder == tmp_path / "plan" and all(s.sha256 for s in loaded.stages)
    assert [s.fp32 is not None for s in plan.stages] == [True] * len(plan.stages)
    assert all(s.fp32 is None for s in loaded.stages) and "fp32" not in loaded.stages[0].to_json()
