"""What the command says is what it did: errors first on stderr, plans run at the shapes they recorded, help
that reads at 80 columns, bench rows that name what ran, kept decisions shown, and `exec` as `python`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import uhop_onnx
from uhop_onnx.cli import app

from .test_cli import uhop

MODELS = Path(__file__).parents[1] / "models"
ENCODER = MODELS / "example_encoder.onnx"  # input_ids: batch x sequence, both free


def cli(*args: str):
    result = CliRunner().invoke(app, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


@pytest.mark.slow
@pytest.mark.parametrize("command", [["optimize", "absent.onnx", "-o", "plan"], ["run", "absent.onnx"],
                                     ["inspect", "absent.onnx"], ["compare", "absent.onnx"],
                                     ["bench", "absent.onnx"], ["export", "absent.onnx", "-t", "x86-64", "-o", "b"]])
def test_an_error_is_the_first_line_of_stderr(command, tmp_path):
    result = uhop(*command, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.startswith("error: "), result.stderr
    assert "absent.onnx: no such file\n" in result.stderr.splitlines(keepends=True)[0]  # one line, not wrapped


@pytest.fixture(scope="module")
def encoder_plan(tmp_path_factory) -> Path:
    """The encoder placed at batch 2, sequence 7: a plan folder whose model has free dimensions."""
    folder = tmp_path_factory.mktemp("encoder") / "plan"
    uhop_onnx.optimize(str(ENCODER), providers=["ort-cpu"], profile=False, shapes={"input_ids": (2, 7)}).save(folder)
    return folder


def test_run_and_compare_a_plan_at_the_shapes_it_recorded(encoder_plan):
    ran = cli("run", encoder_plan, "--json")
    assert ran.exit_code == 0, ran.output
    report = json.loads(ran.stdout)
    assert report["outputs"][0]["shape"] == [2, 7, 32]
    assert report["inputs"] == "generated, seed 0; input_ids: 2x7 as the plan recorded"
    compared = cli("compare", encoder_plan, "--json")
    assert compared.exit_code == 0 and json.loads(compared.stdout)["ok"], compared.output
    given = json.loads(cli("run", encoder_plan, "--shape", "input_ids:1x3", "--json").stdout)
    assert given["outputs"][0]["shape"] == [1, 3, 32] and given["inputs"] == "generated, seed 0"
