"""Target profiles: what a board runs (providers, versions, CPU) and a static cost per provider class.

The built-in profiles are in `targets.json`; a user's profile is a JSON file of the same shape (one profile,
with a `name`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import UhopError

BUILTIN = Path(__file__).with_name("targets.json")


@dataclass(frozen=True)
class TargetProvider:
    """A provider on the board and its static cost model: ms = flops/gflops + bytes/gbps, plus stage_ms a stage."""

    id: str
    options: dict[str, Any] = field(default_factory=dict)
    version: str = ""
    required: bool = False  # the target makes no sense without it: a host that cannot build it fails
    gflops: float = 10.0
    gbps: float = 5.0
    stage_ms: float = 0.1

    def cost_ms(self, flops: float, nbytes: float) -> float:
        return flops / (self.gflops * 1e6) + nbytes / (self.gbps * 1e6)


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    arch: str
    isa: list[str]
    memory_gb: float
    providers: list[TargetProvider]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def builtin_targets() -> dict[str, dict[str, Any]]:
    return json.loads(BUILTIN.read_text())


def load_target(name_or_path: str) -> Target:
    """A built-in profile by name, or a user's profile from a JSON file."""
    profiles = builtin_targets()
    if name_or_path in profiles:
        data = {"name": name_or_path, **profiles[name_or_path]}
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise UhopError(f"unknown target {name_or_path!r}; built-in targets: {', '.join(profiles)}, "
                            "or the path of a JSON profile")
        try:
            data = json.loads(path.read_text())
        except ValueError as error:
            raise UhopError(f"{path}: not a JSON target profile ({error})") from None
    return target_from_json(data, name_or_path)


def target_from_json(data: dict[str, Any], where: str) -> Target:
    """A profile from its JSON form (a profile file's, or a bundle manifest's `target`)."""
    try:
        providers = [TargetProvider(**p) for p in data["providers"]]
        return Target(name=data["name"], description=data.get("description", ""), arch=data["arch"],
                      isa=list(data.get("isa", [])), memory_gb=float(data.get("memory_gb", 0)), providers=providers)
    except (KeyError, TypeError) as error:
        raise UhopError(f"target profile {where!r} is incomplete or malformed ({error}); it needs name, "
                        "arch and providers [{id, options, gflops, gbps, stage_ms}]") from None
