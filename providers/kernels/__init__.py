"""`kernels`: our own generated, verified and autotuned C kernels for Conv, Gemm, MatMul and their epilogues.

The provider (here) lowers a stage (`lowering`) into steps that a runner (`runner`) calls as fused kernels. A
bundle carries the steps as JSON, the constants as `.npz` and the library built for the board's architecture
with its C source, so the board needs only numpy and ctypes (and a C compiler, for a bundle that is not
signed). Schedules come from the autotuner's cache for this device (or are tuned on first sight with the
option `tune`), else from the default.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from uhop_onnx.foundation.errors import ProviderError
from uhop_onnx.foundation.host import host_arch

from ..base import Absent, Artifact, ArtifactFormat, Provider
from ..runner import Runner
from ..capability import Support
from .lowering import KERNELS_TABLE, lower, refusals
from .runner import KernelsRunner

if TYPE_CHECKING:
    import onnx

__all__ = ["ARCH_TARGETS", "KernelsProvider", "KernelsRunner", "host_arch"]

# A board's CPU architecture -> the kernel target a bundle ships for it and the package of its compiler.
# x86-64 boards get AVX2+FMA (what the x86-64 profile promises), not whatever more this host has.
ARCH_TARGETS = {
    "x86_64": ("x86-64-avx2", "apt-get install -y gcc"),
    "aarch64": ("aarch64-neon", "apt-get install -y gcc-aarch64-linux-gnu"),
}


class KernelsFiles(ArtifactFormat):
    """The stage's steps as JSON, its constants as `.npz`, and the library built for the board's architecture
    with its C source; its simulator runs an aarch64 board's build under qemu."""

    name = "kernels"
    simulator_name = "qemu"

    def blocker(self, provider: Provider) -> str | None:
        """None when this host can build the library for the option `arch` (the host's by default)."""
        from uhop_onnx.custom_ops.spec import TARGETS

        arch = provider.options.get("arch", host_arch())
        if arch not in ARCH_TARGETS:
            return f"kernels: unknown arch {arch!r}; valid: {', '.join(ARCH_TARGETS)}"
        target, install = ARCH_TARGETS[arch]
        compiler = TARGETS[target].compiler
        if compiler == "cc" and arch != host_arch():
            return f"kernels for {arch} are built with this host's `cc`, and this host is {host_arch()}"
        if shutil.which(compiler) is None:
            return f"kernels for {arch} need the C compiler {compiler}, which is not on PATH; install: {install}"
        return None

    def export(self, provider: Provider, model: onnx.ModelProto, folder: Path, stem: str) -> Artifact:
        """The stage's steps as `stem.json`, its constants as `stem.npz`, and for the board's architecture the
        library `kernels_<target>.so` (verified here when this host runs its ISA) and its C source
        `kernels_<target>.c`, from which a board builds its own when the bundle is not signed."""
        from uhop_onnx.custom_ops import codegen
        from uhop_onnx.custom_ops.spec import LibrarySpec

        blocker = self.blocker(provider)
        if blocker:
            raise ProviderError(blocker)
        target = ARCH_TARGETS[provider.options.get("arch", host_arch())][0]
        program, constants = lower(model)
        used = sorted({name for s in program["steps"] for name in (*s["inputs"], s["bias"]) if name in constants})
        library, source = f"kernels_{target}.so", f"kernels_{target}.c"  # one copy, shared by the kernels stages
        if not (folder / library).exists():
            shutil.copyfile(_library(target), folder / library)
            (folder / source).write_text(codegen.generate(LibrarySpec(target)))
        (folder / f"{stem}.json").write_text(json.dumps({**program, "constants": used}, indent=1) + "\n")
        np.savez(folder / f"{stem}.npz", *[constants[name] for name in used])
        return Artifact("kernels", [f"{stem}.json", f"{stem}.npz", library, source],
                        {"target": target, "tune": bool(provider.options.get("tune", False))})

    def load(self, folder: Path, artifact: Mapping[str, Any], threads: int | None, exclusive: bool, trusted: bool,
             allowed_delegates: Iterable[str | os.PathLike]) -> Runner:
        """A bundle's kernels stage: its steps and constants over a library that passed its self-test.

        The library the bundle carries is loaded only when `trusted` (a signature the loader checked covers it);
        otherwise this host builds its own from the C source the bundle ships, which must be the source this
        version generates for the target, so that no code from the bundle runs."""
        from uhop_onnx.custom_ops.spec import LibrarySpec, host_targets
        from uhop_onnx.custom_ops.verify import VerificationError, load, tested

        files = {Path(name).suffix: folder / name for name in artifact["files"]}
        options = artifact["options"]
        if options["target"] not in host_targets():
            raise ProviderError(f"the stage's kernels are built for {options['target']}; this host runs "
                                f"{', '.join(host_targets())}")
        program = json.loads(files[".json"].read_text())
        with np.load(files[".npz"], allow_pickle=False) as stored:
            constants = {name: stored[f"arr_{i}"] for i, name in enumerate(program["constants"])}
        spec = LibrarySpec(options["target"])
        try:
            lib = tested(files[".so"], spec) if trusted else load(spec, _own_source(files.get(".c"), spec))
        except VerificationError as error:
            raise ProviderError(f"kernels: the stage's library failed its self-test: {error}") from None
        return KernelsRunner(program, constants, lib, threads or len(os.sched_getaffinity(0)),
                             bool(options.get("tune")), exclusive)

    def simulator(self, provider: Provider) -> Provider | None:
        """The aarch64 build under qemu (`emulate`), for a stage built for an aarch64 board on another host."""
        arch = provider.options.get("arch", host_arch())
        if provider.options.get("emulate") or arch != "aarch64" or arch == host_arch():
            return None
        return KernelsProvider({**provider.options, "emulate": True}, provider.threads)


class KernelsProvider(Provider):
    """Kernels generated for this host's ISA, built with its C compiler, verified against numpy."""

    id = "kernels"
    install = "apt-get install -y gcc  (any C11 compiler reachable as `cc`)"
    table = KERNELS_TABLE
    format = KernelsFiles()
    # arch: the board's, for bundles; emulate: run the board's build under qemu (to verify its stages here)
    option_types = {"tune": bool, "arch": str, "emulate": bool}

    def probe(self) -> tuple[str, str]:
        from uhop_onnx.custom_ops.build import BuildError, compiler_version
        from uhop_onnx.custom_ops.spec import host_target

        if shutil.which("cc") is None:
            raise Absent("no C compiler: `cc` is not on PATH")
        try:
            version = compiler_version("cc")
        except BuildError as error:
            raise Absent(str(error)) from None
        return version, host_target()

    def query(self, model: onnx.ModelProto) -> dict[str, Support]:
        """Refuse what `lower` cannot take: Adds that are not a bias, Clips without constant bounds and MatMuls
        of vectors."""
        return {name: Support(False, reason, "runtime") for name, reason in refusals(model).items()}

    def build(self, model: onnx.ModelProto, *, exclusive: bool = True) -> Runner:
        """A runner over the host's verified library. The library's worker threads spin briefly between
        kernel calls; sharing the process with other stages (`exclusive=False`), the runner sends them to
        sleep at the end of each run, so they take no core from the next stage."""
        from uhop_onnx.custom_ops.build import BuildError
        from uhop_onnx.custom_ops.verify import VerificationError, host_library

        try:
            lib = self._emulated() if self.options.get("emulate") else host_library()
        except (VerificationError, BuildError) as error:
            raise ProviderError(f"kernels: no library built and passed verification on this host: {error}") from None
        threads = self.threads or len(os.sched_getaffinity(0))
        return KernelsRunner(*lower(model), lib, threads, bool(self.options.get("tune", False)), exclusive)

    def _emulated(self):
        """The board's (option `arch`) kernels under qemu; only aarch64 has an emulator here."""
        from uhop_onnx.custom_ops import cross
        from uhop_onnx.custom_ops.spec import LibrarySpec

        arch = self.options.get("arch", host_arch())
        if arch != "aarch64":
            raise ProviderError(f"kernels: emulate runs aarch64 kernels under qemu; arch is {arch!r}")
        missing = cross.missing_tools()
        if missing:
            raise ProviderError(f"kernels: emulating aarch64 needs {', '.join(missing)}; install: {cross.INSTALL}")
        return cross.Emulated(LibrarySpec(ARCH_TARGETS[arch][0]))

def _library(target: str) -> Path:
    """The built library for `target`: loaded and verified when this host runs that ISA, else built only."""
    from uhop_onnx.custom_ops import build, codegen
    from uhop_onnx.custom_ops.spec import LibrarySpec, host_targets
    from uhop_onnx.custom_ops.verify import VerificationError, load

    spec = LibrarySpec(target)
    try:
        return load(spec).path if target in host_targets() else build.build(codegen.generate(spec), target)
    except (VerificationError, build.BuildError) as error:
        raise ProviderError(f"kernels: the {target} library for the bundle failed: {error}") from None


def _own_source(shipped: Path | None, spec) -> str:
    """The C source to build an unsigned bundle's kernels from: the bundle's, when it is what this version
    generates for the target and this host has the compiler."""
    from uhop_onnx.custom_ops import codegen
    from uhop_onnx.custom_ops.spec import TARGETS

    unsigned = "the bundle is not signed, so the library it carries is not loaded"
    source = codegen.generate(spec)
    if shipped is None or shipped.read_text() != source:
        raise ProviderError(f"kernels: {unsigned}, and its C source is missing or not what this uhop-onnx "
                            f"generates for {spec.target}; load a signed bundle with its key "
                            "(load_bundle(path, key=...)), or export it again with this version")
    compiler = TARGETS[spec.target].compiler
    if shutil.which(compiler) is None:
        raise ProviderError(f"kernels: {unsigned}, and building it here from the bundle's C source needs {compiler}; "
                            f"install: {KernelsProvider.install}; or load a signed bundle with its key")
    return source
