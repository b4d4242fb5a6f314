"""Target profiles: what a board runs (providers, versions, CPU, the precisions each provider runs there) and a
static cost per provider class.

The built-in profiles are in `targets.json`; a user's profile is a JSON file of the same shape (one profile,
with a `name`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..foundation.errors import UhopError
from ..providers import device_kind
from ..precision.values import REDUCED

BUILTIN = Path(__file__).with_name("targets.json")
# A CPU computes bf16 only with one of these in its `isa` (x86's AVX-512 BF16 or AMX, Arm's BF16 extension);
# without them a runtime asked for bf16 computes in fp32, so a profile declaring it would be wrong.
BF16_ISA = ("avx512_bf16", "amx_bf16", "bf16")


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
    # reduced precision -> how many times faster than at its default precision (the figures above) its nodes
    # run there: the precisions the board runs this provider at, besides the default one
    precisions: dict[str, float] = field(default_factory=dict)

    def cost_ms(self, flops: float, nbytes: float) -> float:
        return flops / (self.gflops * 1e6) + nbytes / (self.gbps * 1e6)

    def at(self, precision: str) -> TargetProvider:
        """This provider's cost model at `precision` (one it declares, or its default "fp32"): its nodes cost
        the declared factor less; a stage costs the same."""
        if precision == "fp32":
            return self
        speed = self.precisions[precision]
        return replace(self, gflops=self.gflops * speed, gbps=self.gbps * speed, precisions={})

    @property
    def on_cpu(self) -> bool:
        """Whether it computes on the board's CPU, by the device kind its provider declares for its options."""
        return device_kind(self.id, self.options) == "cpu"


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

    def check(self) -> Target:
        """`self`, once every declared precision is a reduced one with a positive speed factor, and bf16 on a
        CPU is backed by the profile's `isa`; else a `UhopError` naming the provider."""
        for entry in self.providers:
            if not isinstance(entry.precisions, dict):
                raise UhopError(f"target {self.name}: provider {entry.id} precisions must be an object "
                                f'{{"int8": speed factor, ...}}, got {entry.precisions!r}')
            for precision, speed in entry.precisions.items():
                where = f"target {self.name}: provider {entry.id} precision {precision!r}"
                if precision not in REDUCED:
                    raise UhopError(f"{where}: not one of {', '.join(REDUCED)} (fp32 is every provider's default)")
                if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not speed > 0:
                    raise UhopError(f"{where}: the speed factor {speed!r} must be a positive number")
                if precision == "bf16" and entry.on_cpu and not set(BF16_ISA) & set(self.isa):
                    raise UhopError(f"{where}: the CPU computes bf16 only with {' or '.join(BF16_ISA)} in the "
                                    f"profile's isa ({', '.join(self.isa) or 'empty'}); add it, or drop bf16")
        return self


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
        target = Target(name=data["name"], description=data.get("description", ""), arch=data["arch"],
                        isa=list(data.get("isa", [])), memory_gb=float(data.get("memory_gb", 0)), providers=providers)
    except (KeyError, TypeError, AttributeError) as error:
        raise UhopError(f"target profile {where!r} is incomplete or malformed ({error}); it needs name, "
                        "arch and providers [{id, options, gflops, gbps, stage_ms, precisions}]") from None
    return target.check()
