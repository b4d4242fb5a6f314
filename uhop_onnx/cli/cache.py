"""`uhop-onnx cache ...`: what the on-disk cache holds, and keeping it under its cap."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="The on-disk cache: info, prune, clear.\n\nIt lies in $UHOP_CACHE_DIR, capped by "
                       "$UHOP_CACHE_MAX.",
                  no_args_is_help=True, add_completion=False)
out = Console()

AS_JSON = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


def _size(count: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


@app.command()
def info(as_json: AS_JSON = False) -> None:
    """The cache folder, its total size and cap, and its entries by kind."""
    from ..foundation.cache import info as cache_info

    report = cache_info()
    if as_json:
        out.print_json(json.dumps(report))
        return
    out.print(report["folder"], highlight=False, markup=False)
    out.print(f"{_size(report['bytes'])} in {report['entries']} entries, cap {_size(report['cap'])} (UHOP_CACHE_MAX)")
    table = Table("kind", "entries", "size")
    for kind, figures in report["kinds"].items():
        table.add_row(kind, str(figures["entries"]), _size(figures["bytes"]))
    if report["kinds"]:
        out.print(table)
    if report["kept"]:
        out.print(f"never pruned: {', '.join(report['kept'])}")


def _removed(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        out.print_json(json.dumps(report))
        return
    out.print(report["folder"], highlight=False, markup=False)
    out.print(f"removed {len(report['removed'])} entries ({_size(report['before'] - report['bytes'])}); "
              f"{_size(report['bytes'])} left")


@app.command()
def prune(max_size: Annotated[str | None, typer.Option("--max", help="The cap for this pruning: bytes, 500M or 2G. "
                                                                        "Default: $UHOP_CACHE_MAX, else 2G.")] = None,
          as_json: AS_JSON = False) -> None:
    """Remove the least recently used entries until under the cap."""
    from ..foundation.cache import parse_size
    from ..foundation.cache import prune as cache_prune

    _removed(cache_prune(None if max_size is None else parse_size(max_size, "--max")), as_json)


@app.command()
def clear(as_json: AS_JSON = False) -> None:
    """Remove every entry.

    The rknn-toolkit2 environment and the benchmarks' exports stay."""
    from ..foundation.cache import clear as cache_clear

    _removed(cache_clear(), as_json)
