"""The `uhop-onnx` command, a thin shell over the Python API: `app`, and `main` as the console script runs it."""

# Exit codes: 0 success, 1 a failed check (a stage that failed, a mismatch), 2 bad usage or input. Tables fit
# 80 columns (summaries first; `--wide` for the rest); every text from outside (names, reasons, paths) is printed
# as text, never as rich markup. The runtimes' own logs show only with `-v`; warnings are one line each. Progress
# goes to stderr, hidden by `--quiet` and `--json`.

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Annotated

import typer
from rich.markup import escape

from .cache import app as cache_app
from ..foundation.errors import UhopError
from .kernels import app as kernels_app
from . import bench, edge, plans, render, serve, shell

app = typer.Typer(name="uhop-onnx", help="Place ONNX models on the fastest mix of providers, and run them.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                  rich_markup_mode="markdown")


def main() -> None:
    """The command; `-v` is taken anywhere on the line (`uhop-onnx run model.onnx -v`), as trtexec takes it."""
    shell.AS_COMMAND = True
    args = sys.argv[1:]
    if args[:1] == ["exec"]:  # the program's arguments and output are its own: no -v taken, nothing silenced
        app(args=args)
    import signal

    def ended(number: int, frame: object) -> None:
        """SIGTERM or SIGHUP: unwind as Ctrl-C does, so that workers are stopped and temporary files removed,
        and exit with 128 + the signal's number; a second signal ends the process at once."""
        for each in caught:
            signal.signal(each, signal.SIG_DFL)
        raise SystemExit(128 + number)

    caught = [n for n in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(n) is signal.SIG_DFL]  # nohup's kept
    for number in caught:
        signal.signal(number, ended)
    verbose = any(a in shell.VERBOSE for a in args)
    if verbose:
        args = ["-v", *(a for a in args if a not in shell.VERBOSE)]
    warnings.formatwarning = shell.one_line
    with shell.runtimes_silenced(not verbose):
        try:
            app(args=args)
        except UhopError as error:
            render.err.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False, soft_wrap=True)
            sys.exit(error.exit_code)


@app.callback()
def _options(verbose: Annotated[bool, typer.Option(*shell.VERBOSE, help="Show the runtimes' own logs and "
                                                   "uhop-onnx's progress log.")] = False) -> None:
    """Place ONNX models on the fastest mix of providers, and run them."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0" if verbose else "3")  # LiteRT's C++ logging
    from ..foundation.ortlib import set_log_severity

    set_log_severity(2 if verbose else 4)  # not verbose: its errors are raised to us, not logged


for command in (plans.devices, plans.inspect, plans.optimize, plans.run, plans.compare, plans.explain, bench.bench,
                edge.export, edge.keygen, edge.tune, edge.verify):
    app.command()(command)
app.command("exec", context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
            add_help_option=False)(serve.exec_program)
app.command("serve", short_help=serve.SERVE_SUMMARY)(serve.serve)
app.add_typer(edge.setup_app, name="setup")
app.add_typer(kernels_app, name="kernels")
app.add_typer(cache_app, name="cache")
