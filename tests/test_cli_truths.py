"""What the command says is what it did: errors first on stderr, plans run at the shapes they recorded, help
that reads at 80 columns, bench rows that name what ran, kept decisions shown, and `exec` as `python`."""

from __future__ import annotations

import pytest

from .test_cli import uhop


@pytest.mark.slow
@pytest.mark.parametrize("command", [["optimize", "absent.onnx", "-o", "plan"], ["run", "absent.onnx"],
                                     ["inspect", "absent.onnx"], ["compare", "absent.onnx"],
                                     ["bench", "absent.onnx"], ["export", "absent.onnx", "-t", "x86-64", "-o", "b"]])
def test_an_error_is_the_first_line_of_stderr(command, tmp_path):
    result = uhop(*command, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.startswith("error: "), result.stderr
    assert "absent.onnx: no such file\n" in result.stderr.splitlines(keepends=True)[0]  # one line, not wrapped
