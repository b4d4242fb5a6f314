"""Serving a model (`serve`), and running a program with uhop-onnx in ONNX Runtime's place (`exec`)."""

from __future__ import annotations

import typer

from ..serve.cli import serve

__all__ = ["SERVE_SUMMARY", "exec_program", "serve"]

SERVE_SUMMARY = "Serve a model over the Open Inference Protocol (KServe v2 REST)."  # serve's row in the list


def exec_program(ctx: typer.Context) -> None:
    """Run a Python program with uhop-onnx's session as onnxruntime's.

    As `uhop-onnx exec -- python app.py ARGS`. UHOP_PRECISION and UHOP_TOLERANCE set its sessions' precision
    and tolerance."""
    from ..exec import main as run_program

    raise typer.Exit(run_program(ctx.args, prog="uhop-onnx exec"))
