"""NPU cores per RKNN stage (`core_mask`): the rule a bundle written away from the board follows, the option
when given, and the measurement `tune` makes on the board (its timing loop run here on ONNX Runtime, since
the board's runtime, rknn-toolkit-lite2, has aarch64 wheels only)."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from uhop_onnx.providers import create
from uhop_onnx.providers.rknn import Rknn, cores


def relu(batch: int | str) -> onnx.ModelProto:
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 8, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 8, 4, 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_a_batch_one_stage_spreads_over_every_core_and_a_batch_is_left_to_the_runtime():
    assert cores.chosen(relu(1), "rk3588") == "0_1_2"
    assert cores.chosen(relu(1), "rk3576") == "0_1"
    assert cores.chosen(relu(4), "rk3588") == "auto"
    assert cores.chosen(relu("batch"), "rk3588") == "auto"
    assert cores.chosen(relu(1), "rk3568") == "auto"  # one core: nothing to choose


def test_the_option_when_given_wins_over_the_rule(tmp_path):
    assert Rknn({"core_mask": "0"}).chosen_cores(relu(1), tmp_path / "s.rknn") == ("0", None)
    assert Rknn({}).chosen_cores(relu(1), tmp_path / "s.rknn") == ("0_1_2", None)  # not a board: the rule


def test_measuring_times_each_mask_worth_trying_and_keeps_the_fastest():
    opened = []

    def open_runner(mask):
        opened.append(mask)
        return create("ort-cpu").compile(relu(1))

    timings = cores.measured(relu(1), "rk3588", open_runner)
    assert opened == ["0", "0_1", "0_1_2"] and list(timings) == opened
    assert all(ms > 0 for ms in timings.values())
    assert cores.fastest({"0": 3.0, "0_1": 2.1, "0_1_2": 2.5}) == "0_1"
    assert list(cores.measured(relu(1), "rk3568", open_runner)) == ["auto"]
