"""Which LiteRT delegate libraries may be loaded: a delegate is native code, so a plan or bundle file never
chooses its path.

A delegate is a name from `KNOWN`, found in the system's library folders, or a path the user allowed: in
the call (`allowed_delegates=[...]`) or in `UHOP_ALLOWED_DELEGATES` (paths separated by `:`). A delegate a
user passes directly as a provider option in Python is theirs and is not checked here; one read from a
`plan.json` or an unsigned bundle's manifest is.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

ENV = "UHOP_ALLOWED_DELEGATES"
# Delegates boards ship, by the name a plan may give: the library file each is installed as.
KNOWN = {
    "gpu": "libtensorflowlite_gpu_delegate.so",
    "vx": "libvx_delegate.so",  # NXP i.MX NPU (VeriSilicon)
    "ethos-u": "libethosu_delegate.so",
    "armnn": "libarmnn_delegate.so",
    "qnn": "libQnnTFLiteDelegate.so",
    "edgetpu": "libedgetpu.so.1",
    "hexagon": "libhexagon_delegate.so",
}
SYSTEM_DIRS = ("/usr/lib", "/usr/local/lib", "/lib", "/usr/lib/aarch64-linux-gnu", "/usr/lib/x86_64-linux-gnu",
               "/usr/lib/arm-linux-gnueabihf", "/vendor/lib64", "/system/lib64")


def allowed(extra: Iterable[str | os.PathLike] = ()) -> set[str]:
    """The real paths of the delegates the user allowed: `extra` and `UHOP_ALLOWED_DELEGATES`."""
    listed = [*extra, *(p for p in os.environ.get(ENV, "").split(os.pathsep) if p)]
    return {os.path.realpath(p) for p in listed}


def locate(name: str) -> str | None:
    """The system path of the known delegate `name`, or None when it is not installed."""
    for folder in SYSTEM_DIRS:
        path = Path(folder) / KNOWN[name]
        if path.is_file():
            return str(path)
    return None


def refusal(value: object, extra: Iterable[str | os.PathLike] = ()) -> str:
    """Why the delegate `value`, read from a file, may not be loaded; "" when it may."""
    if not isinstance(value, str):
        return f"must be a delegate name or an allowed path, got {type(value).__name__}"
    if value in KNOWN:
        return "" if locate(value) else f"{value!r} ({KNOWN[value]}) is not installed in {', '.join(SYSTEM_DIRS)}"
    if os.path.realpath(value) in allowed(extra):
        return ""
    return (f"{value!r} is neither a known delegate ({', '.join(KNOWN)}) nor a path the user allowed; "
            f"allow it with allowed_delegates=[...] or {ENV}")


def resolve(value: str) -> str:
    """The library to load for `value`: a known name's system path, else `value` itself."""
    return (locate(value) or value) if value in KNOWN else value
