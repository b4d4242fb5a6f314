"""`python -m uhop_onnx.exec app.py ARGS` (or `-m module ARGS`, `-c CODE ARGS`): a program run as `python` runs
it, with uhop-onnx's session in ONNX Runtime's place (`patch_onnxruntime`), as `python -m cProfile app.py` runs
one under the profiler. A leading interpreter (`python`, `/usr/bin/python3`) is dropped: the program runs in
this one. The interpreter's own options (`-u`, `-X dev`, `-W error`, `-O`, `-B`, `-E`, `-s`, `-I`...) start
this interpreter again with them. `UHOP_PRECISION` and `UHOP_TOLERANCE` set the precision and tolerance of the
sessions it makes.
"""

from __future__ import annotations

import builtins
import mmap
import os
import runpy
import shutil
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .foundation.errors import InputError
from .precision import check_choice

USAGE = "usage: {prog} [python] [option ...] (file | -m mod | -c cmd) [arg ...]"
FLAGS = "bBdEiIOPqRsuv"  # the interpreter's options without a value, passed on to it as `python` takes them
VALUED = "WX"  # and those with one: `-W error`, `-Xdev`
NATIVE = (b"\x7fELF", b"\xcf\xfa\xed\xfe", b"\xce\xfa\xed\xfe", b"\xca\xfe\xba\xbe")  # ELF, Mach-O, fat Mach-O


def main(argv: list[str], prog: str = "python -m uhop_onnx.exec") -> int:
    """Run the program `argv` names (`["app.py", ...]`, `["-m", "pkg.app", ...]`, `["-c", CODE, ...]`; a
    leading interpreter or `--` dropped) under the patch; its exit status (1 and its traceback when it
    raises). Given interpreter options, this interpreter is started again with them (`os.execv`)."""
    args = list(argv)
    if args[:1] == ["--"]:
        args.pop(0)
    if args and not args[0].startswith("-") and is_interpreter(args[0]):
        args.pop(0)
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE.format(prog=prog))
        return 0
    try:
        options, program = split(args)
        defaults = env_defaults(os.environ)
        if options:
            _again(options, program)
        from .products.patch import patch_onnxruntime  # uhop-onnx's imports, before the program's sys.path

        run = _runner(program)
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


def is_interpreter(word: str) -> bool:
    """Whether a command line's first word names a Python interpreter rather than the script, by what it is:
    a file here that is a Python executable; else, found on PATH as a shell finds a command, a Python
    executable or a script that is not a Python program (a wrapper such as pyenv's shims). A file here that is
    no interpreter is the script, whatever its name."""
    if Path(word).is_file():
        return _python_executable(Path(word))
    found = shutil.which(word) if os.sep not in word else None
    return found is not None and (_python_executable(Path(found)) or _wrapper(Path(found)))


def split(args: list[str]) -> tuple[list[str], list[str]]:
    """The interpreter's options before the program (`-uB` as `-u`, `-B`; `-Werror` as `-W`, `error`) and
    the program: `SCRIPT ARGS`, `-m MODULE ARGS` or `-c CODE ARGS`, as `python` reads its command line."""
    options, rest = [], list(args)
    while rest and rest[0].startswith("-") and rest[0] != "-":
        word = rest.pop(0)
        if word == "--":
            break
        letters = "" if word.startswith("--") else word[1:]
        if not letters:
            raise InputError(f"{word}: not an interpreter option; {_taken()}")
        while letters:
            letter, letters = letters[0], letters[1:]
            if letter in "mc":
                return options, [f"-{letter}", *([letters] if letters else []), *rest]
            if letter in VALUED:
                if not (letters or rest):
                    raise InputError(f"-{letter} needs a value")
                options += [f"-{letter}", letters or rest.pop(0)]
                letters = ""
            elif letter in FLAGS:
                options.append(f"-{letter}")
            else:
                raise InputError(f"-{letter}: not an interpreter option; {_taken()}")
    return options, rest


def _taken() -> str:
    return f"taken: -{', -'.join(FLAGS)}, -W ARG, -X OPT, then SCRIPT, -m MODULE or -c CODE"


def _again(options: list[str], program: list[str]) -> None:
    """Start this interpreter again with `options`, running the program under this module (never returns)."""
    if not program:
        raise InputError("no program given")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *options, "-m", "uhop_onnx.exec", *program])


def _runner(args: list[str]):
    """What runs the program, with `sys.argv` and `sys.path` set as `python SCRIPT`, `python -m` or `python -c`
    sets them."""
    if not args:
        raise InputError("no program given")
    if args[0] in ("-m", "-c") and len(args) < 2:
        raise InputError(f"{args[0]} needs {'a module name' if args[0] == '-m' else 'the code to run'}")
    if args[0] == "-m":
        sys.argv[:] = args[1:]
        _search_first(os.getcwd())
        return lambda: runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    if args[0] == "-c":
        sys.argv[:] = ["-c", *args[2:]]
        _search_first("")
        return lambda: exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
    script = Path(args[0])
    if not script.is_file():
        found = shutil.which(args[0])
        raise InputError(f"{script} is not a file" + (f" (a command at {found}: give that path)" if found else ""))
    sys.argv[:] = args
    _search_first(str(script.resolve().parent))
    return lambda: runpy.run_path(str(script), run_name="__main__")


def _search_first(entry: str) -> None:
    """`sys.path[0]` as `python` sets it for the program, in place of what this process's start put there (the
    working folder under `-m`, the command's folder for `uhop-onnx`): nothing is put there under `-P` or
    `-I`, as `python` puts nothing there then."""
    if not sys.flags.safe_path:
        sys.path[0] = entry


def _python_executable(path: Path) -> bool:
    """This interpreter (the same file), or a native executable holding CPython's entry point."""
    try:
        if path.resolve() in {Path(sys.executable).resolve(), Path(sys._base_executable).resolve()}:
            return True
        with path.open("rb") as file:
            if file.read(4) not in NATIVE:
                return False
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return data.find(b"Py_BytesMain") >= 0
    except (OSError, ValueError):
        return False


def _wrapper(path: Path) -> bool:
    """A script (`#!`) whose own interpreter is no Python executable: a shell script such as a pyenv shim."""
    try:
        with path.open("rb") as file:
            line = file.readline(4096)
    except OSError:
        return False
    words = line[2:].decode(errors="replace").split() if line.startswith(b"#!") else []
    if words[:1] and Path(words[0]).name == "env":
        words = [w for w in words[1:] if not w.startswith("-")]
    found = shutil.which(words[0]) if words else None
    return found is not None and not _python_executable(Path(found))


def _status(code: Any) -> int:
    """A `SystemExit` code as a process's status: None 0, an int itself, anything else printed and 1."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
