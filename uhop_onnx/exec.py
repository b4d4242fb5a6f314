"""`python -m uhop_onnx.exec app.py ARGS` (or `-m module ARGS`): a program run unchanged with uhop-onnx's
session in ONNX Runtime's place (`patch_onnxruntime`), as `python -m cProfile app.py` runs one under the
profiler. `UHOP_PRECISION` and `UHOP_TOLERANCE` set the precision and tolerance of the sessions it makes.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import InputError
from .patch import patch_onnxruntime
from .precision import check_choice

USAGE = "usage: {prog} [python] (SCRIPT | -m MODULE) [ARGS...]"


def main(argv: list[str], prog: str = "python -m uhop_onnx.exec") -> int:
    """Run the program `argv` names (`["app.py", ...]`, `["-m", "pkg.app", ...]`, a leading `python` or
    `--` dropped) under the patch; its exit status (1 and its traceback when it raises)."""
    args = list(argv)
    if args[:1] == ["--"]:
        args.pop(0)
    if args and _is_python(args[0]):
        args.pop(0)
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE.format(prog=prog))
        return 0
    try:
        defaults = env_defaults(os.environ)
        run = _runner(args)
    except InputError as error:
        print(f"{prog}: {error}\n{USAGE.format(prog=prog)}", file=sys.stderr)
        return 2
    try:
        with patch_onnxruntime(**defaults):
            run()
    except SystemExit as done:
        return _status(done.code)
    except Exception:  # noqa: BLE001 - the program's own failure, shown as Python shows it
        traceback.print_exc()
        return 1
    return 0


def env_defaults(env: Mapping[str, str]) -> dict[str, Any]:
    """The sessions' defaults from `UHOP_PRECISION` and `UHOP_TOLERANCE` (unset: fp32, exactly as asked)."""
    defaults: dict[str, Any] = {}
    if env.get("UHOP_PRECISION"):
        defaults["precision"] = env["UHOP_PRECISION"].strip()
    if env.get("UHOP_TOLERANCE"):
        try:
            defaults["tolerance"] = float(env["UHOP_TOLERANCE"])
        except ValueError:
            raise InputError(f"UHOP_TOLERANCE={env['UHOP_TOLERANCE']!r} is not a number; give one such as 1e-2") from None
    try:
        check_choice(defaults.get("precision", "fp32"), defaults.get("tolerance"))
    except InputError as error:
        raise InputError(f"UHOP_PRECISION/UHOP_TOLERANCE: {error}") from None
    return defaults


def _runner(args: list[str]):
    """What runs the program, with `sys.argv` and `sys.path` set as `python SCRIPT` or `python -m` sets them."""
    if not args:
        raise InputError("no program given")
    if args[0] == "-m":
        if len(args) < 2:
            raise InputError("-m needs a module name")
        sys.argv[:] = args[1:]
        sys.path.insert(0, os.getcwd())
        return lambda: runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    script = Path(args[0])
    if not script.is_file():
        raise InputError(f"{script} is not a file")
    sys.argv[:] = args
    sys.path.insert(0, str(script.resolve().parent))
    return lambda: runpy.run_path(str(script), run_name="__main__")


def _is_python(word: str) -> bool:
    """`python`, `python3`, `python3.11` or this interpreter's path."""
    name = Path(word).name
    return word == sys.executable or name == "python" or (name.startswith("python3") and not name.endswith(".py"))


def _status(code: Any) -> int:
    """A `SystemExit` code as a process's status: None 0, an int itself, anything else printed and 1."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
