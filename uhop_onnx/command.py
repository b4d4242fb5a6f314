"""The `uhop-onnx` command: `uhop-onnx exec ...` runs its program before the CLI's modules (typer, rich, every
command's) are imported, so that the program pays at start only for what the patch imports; every other command
is the CLI's (`uhop_onnx.cli`)."""

from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:2] == ["exec"]:
        from .exec import main as run_program

        sys.exit(run_program(sys.argv[2:], prog="uhop-onnx exec"))
    from .cli import main as cli

    cli()
