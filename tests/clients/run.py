"""Runs one real client through its library's public API and writes what came back as JSON.

    python tests/clients/run.py [--swap | --placed] CLIENT OUT.json

CLIENT is a module beside this file (`rapidocr_pages`, `magika_files`, `silero_speech`, `nudenet_pictures`):
`build()` makes the library's object, `inputs()` lists real inputs, `call(app, x)` is one call of the library's
public API, `sessions(app)` names the sessions the library made. With `--swap`, ONNX Runtime's InferenceSession
is replaced by uhop's before the library is imported, as a user writes it; run under
`python -m uhop_onnx.exec`, the library gets uhop's without a line changed. With `--placed`, the library's
sessions are uhop's that do not adapt (`patch_onnxruntime(adapt=False)`): each is placed once, when made, over
every provider its device covers, so that its calls run on the runtimes uhop picked from the first one, not on
the ONNX Runtime plan an adapting session starts on. OUT.json also records which class made each session and
the providers it reports, so that a run that never reached uhop cannot pass as one.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

# Client module -> (the modules it imports, the command that installs them).
CLIENTS = {
    "rapidocr_pages": (["rapidocr", "skimage"], "pip install rapidocr==3.10.0 scikit-image"),
    "magika_files": (["magika"], "pip install magika==1.0.3"),
    "silero_speech": (["silero_vad", "torch"], "pip install silero-vad==6.2.3 torch"),
    "nudenet_pictures": (["nudenet", "skimage"], "pip install nudenet==3.4.2 scikit-image"),
}


def missing(name: str) -> str | None:
    """Why client `name` cannot run here (what is missing and the command that installs it), or None."""
    modules, install = CLIENTS[name]
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"{', '.join(absent)} not installed: {install}" if absent else None


def swap_in_uhop() -> None:
    """The plain swap."""
    import onnxruntime

    import uhop_onnx

    onnxruntime.InferenceSession = uhop_onnx.InferenceSession


def load(name: str):
    """The client module `name` beside this file."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    return importlib.import_module(name)


def describe(sessions: dict) -> dict:
    """Per session: the module of its class and the providers it reports."""
    return {k: {"module": type(s).__module__, "providers": list(s.get_providers())} for k, s in sessions.items()}


def main(argv: list) -> None:
    if argv[0] == "--swap":
        swap_in_uhop()
    elif argv[0] == "--placed":
        import uhop_onnx

        uhop_onnx.patch_onnxruntime(adapt=False)
    argv = argv[1:] if argv[0].startswith("--") else argv
    name, out = argv
    client = load(name)
    app = client.build()
    results = [client.call(app, x) for x in client.inputs()]
    Path(out).write_text(json.dumps({"results": results, "sessions": describe(client.sessions(app))}))


if __name__ == "__main__":
    main(sys.argv[1:])
