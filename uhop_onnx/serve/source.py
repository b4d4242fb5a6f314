"""What to serve or export: a `Plan`, a plan folder, or a model (file or `ModelProto`) optimized here."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..foundation.errors import UhopError
from ..runtime.plan import PLAN_FILE, Plan


def load_plan(source: Any, providers: str | Sequence[str] | None = None, threads: int | None = None,
              profile: bool = True) -> tuple[Plan, str]:
    """The plan and its default model name: the plan's model name, or a model file's stem."""
    if isinstance(source, Plan):
        return source, source.model_name
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if (path / PLAN_FILE).is_file():
            plan = Plan.load(path)
            return plan, plan.model_name
        if not path.is_file():
            raise UhopError(f"{path}: no such model file or plan folder; give an .onnx file or a folder written "
                            "by `uhop-onnx optimize`")
    from ..products.optimizer import optimize

    if isinstance(providers, str):
        providers = [p for p in providers.split(",") if p]
    plan = optimize(source, providers=providers or None, profile=profile, threads=threads)
    return plan, Path(source).stem if isinstance(source, (str, os.PathLike)) else plan.model_name
