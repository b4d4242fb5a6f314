"""The exceptions uhop-onnx raises, one small tree under `UhopError` (each class's `exit_code` is the
command line's exit status for it: 2 for bad usage or input, 1 for a failed check or run), and the helpers
that word errors and warnings: `first_line`, `missing_module`, `outside`, `logger`."""

import logging
import re
import sys
from importlib import import_module


class UhopError(Exception):
    """Base of every error uhop-onnx raises on purpose; its message says what was wrong and what to do."""

    exit_code = 2


class ModelError(UhopError):
    """The model file or graph is unusable: not ONNX, truncated, cyclic, unsafe, unsupported."""


class InputError(UhopError, ValueError):
    """What the caller gave is unusable: feeds that do not match the model's inputs, shapes, sample inputs or
    calibration samples, a precision or tolerance, an option's value. A `ValueError` too, as onnxruntime
    raises for bad feeds."""


class TooLargeError(InputError):
    """Inputs, or what a model computes from them at the shapes given, cannot fit in this host's free memory:
    refused before anything is allocated."""


class FreeDimensionError(InputError):
    """A model is to be measured but has free dimensions (other than a leading one) nobody gave a size for."""


class ProviderError(UhopError):
    """A provider is unknown, absent, cannot run what it was given, or failed while running."""


class PlanError(UhopError):
    """A plan or an assignment is inconsistent, or a plan folder cannot be read or written."""


class BundleError(UhopError):
    """A bundle is missing, malformed, unsafe or tampered with."""

    exit_code = 1


class BundleNotFound(BundleError):
    """No bundle at the path given: bad input, not a failed check."""

    exit_code = 2


class OutputError(UhopError, OSError):
    """An output path cannot be written: unusable from the start (exit 2), or a write failed midway, a full disk
    say (exit 1). Nothing half-written is left. Also an `OSError`, which it replaces."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


class KeyFileError(UhopError):
    """A signing key is missing, unreadable, not an Ed25519 PEM key, or would overwrite a file."""


class CheckError(ProviderError):
    """A provider's build-time check failed: what it built from a stage differs from ONNX Runtime on the same
    inputs (or could not be checked). While placing, the nodes go to another provider; at run time, a
    fixed-shape stage refused at a new shape runs that call on ort-cpu (counted in `plan.fallbacks`)."""


class StageError(ProviderError):
    """A stage failed at run time; names the stage and its provider."""

    exit_code = 1

    def __init__(self, message: str, stage: int, provider: str):
        super().__init__(message)
        self.stage = stage
        self.provider = provider

    def __reduce__(self) -> tuple:  # pickled as raised in a worker process, whole
        return type(self), (str(self), self.stage, self.provider)


class MeasurementError(ProviderError):
    """No candidate plan could be timed; the message lists each one with its error."""

    exit_code = 1


def first_line(error: BaseException, limit: int = 400) -> str:
    """The first line of an exception's message that says something (its class name when none does), for
    one-line errors; OpenVINO's "Exception from src/...cpp:224:" location lines are passed over."""
    lines = [line.strip() for line in str(error).splitlines()]
    said = [line for line in lines if line and not _LOCATION.fullmatch(line)]
    return (said or [type(error).__name__])[0][:limit]


def missing_module(module: str, install: str) -> str | None:
    """Why `module` cannot be imported on this host, with its install command; None when it can. Any
    exception while importing it counts (a broken install is as absent as a missing one)."""
    try:
        import_module(module)
    except ImportError as error:
        return f"{module} is not installed on this host ({error}); {install}"
    except Exception as error:  # noqa: BLE001 - a broken runtime fails in any way
        return f"{module} cannot be imported on this host ({type(error).__name__}: {first_line(error)}); {install}"
    return None


_LOCATION = re.compile(r"Exception from \S+:\d+:")


def outside() -> int:
    """The `stacklevel` for a warning raised in the calling function that points at the first frame outside
    the `uhop_onnx` package: the user's line that led to it, however deep the call went."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "uhop_onnx":
        frame, level = frame.f_back, level + 1
    return level


def logger(name: str) -> logging.Logger:
    """`logging.getLogger(name)`: uhop-onnx's messages go through logging as the program configured it."""
    return logging.getLogger(name)
