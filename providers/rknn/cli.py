"""`uhop-onnx setup rknn`: create the rknn-toolkit2 environment (idempotent)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer()


@app.command()
def rknn(
    venv: Annotated[Path | None, typer.Option(
        help="Where to create it; default: $UHOP_RKNN_VENV, else ~/.cache/uhop-onnx/rknn-venv.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
) -> None:
    """Create the rknn-toolkit2 virtual environment that converts and simulates RKNN stages (about
    1.5 GB, a minute or two; does nothing when it is already complete)."""
    from uhop_onnx.foundation.errors import UhopError

    from .setup import TOOLKIT, create_venv, is_ready, venv_path

    target = venv or venv_path()
    already = is_ready(target)
    try:
        create_venv(target)
    except UhopError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps({"toolkit": TOOLKIT, "venv": str(target), "already": already}))
    else:
        typer.echo(f"{TOOLKIT} {'already set up' if already else 'set up'} at {target}")
