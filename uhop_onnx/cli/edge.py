"""Bundles for boards: export (or a Triton repository), keygen, tune, verify, and setup of the toolkits."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ..providers.rknn.cli import rknn
from .options import (CalibrationOption, JsonOption, MeasuredInputsOption, MeasuredShapeOption, PrecisionOption,
                      ProvidersOption, QuietOption, ThreadsOption, ToleranceOption, measured_at, provider_specs)
from .render import out, print_bundle, print_json, steps


class ExportFormat(StrEnum):
    bundle = "bundle"
    triton = "triton"


def export(model: Path,
           output: Annotated[Path, typer.Option("--output", "-o", help="A new folder. A bundle may also be a "
                                                "file ending .tar.gz.")],
           target: Annotated[str | None, typer.Option("--target", "-t", help="Board profile: rk3588, jetson-orin, "
                                                      "x86-64, x86-64-v4, arm64, intel-npu, or a JSON profile's "
                                                      "path.")] = None,
           fmt: Annotated[ExportFormat, typer.Option("--format", help="bundle: each stage in its runtime's own "
                                                     "format, for a board. triton: a Triton model repository.")]
           = ExportFormat.bundle,
           providers: ProvidersOption = None, threads: ThreadsOption = None,
           sign: Annotated[Path | None, typer.Option("--sign", help="Sign the bundle's manifest with this Ed25519 "
                                                     "private key (from `uhop-onnx keygen`).")] = None,
           shape: MeasuredShapeOption = None, inputs: MeasuredInputsOption = None,
           max_batch: Annotated[int, typer.Option(min=0, help="Triton only: batch up to N requests dynamically "
                                                  "(needs a free first dimension). 0: no batching.")] = 0,
           max_delay_ms: Annotated[float | None, typer.Option(min=0, help="Triton only: how long a batch waits "
                                                              "for more requests.")] = None,
           precision: PrecisionOption = "fp32", tolerance: ToleranceOption = None,
           calibration: CalibrationOption = None, as_json: JsonOption = False, quiet: QuietOption = False) -> None:
    """Write a deployment bundle for a board, or a Triton repository."""
    if fmt is ExportFormat.triton:
        from ..products.triton import export_triton

        if shape or inputs:
            raise typer.BadParameter("--shape and --inputs size bundles; for a Triton repository, run `uhop-onnx "
                                     "optimize MODEL -o PLAN --shape ...` and export the plan folder",
                                     param_hint="--shape")

        with steps("exporting", not (as_json or quiet)):
            written = export_triton(model, output, providers=provider_specs(providers), threads=threads,
                                    max_batch=max_batch, max_delay_ms=max_delay_ms)
        if as_json:
            return print_json({"format": "triton", "repository": str(written)})
        out.print(f"Triton model repository written to {escape(str(written))}")
        return
    if max_batch or max_delay_ms is not None:
        raise typer.BadParameter("--max-batch and --max-delay-ms apply to --format triton", param_hint="--max-batch")
    if target is None:
        raise typer.BadParameter("--target is required for bundles (rk3588, jetson-orin, x86-64, x86-64-v4, arm64, "
                                 "intel-npu, or a JSON profile)", param_hint="--target")
    from ..products.export import export_bundle

    with steps("exporting", not (as_json or quiet)) as step:
        written = export_bundle(model, target, output, providers=provider_specs(providers), threads=threads,
                                progress=step, sign=sign,
                                **measured_at(shape, inputs, precision, tolerance, calibration))
    print_bundle(written, f"{'signed ' if sign else ''}bundle for {target}", as_json)


def keygen(name: Annotated[Path, typer.Option("--output", "-o", help="NAME: writes NAME.key (private, mode "
                                              "0600) and NAME.pub (public).")],
           as_json: JsonOption = False) -> None:
    """Write a new Ed25519 key pair (PEM) to sign bundles with.

    Sign with `export --sign NAME.key`; check with `verify --key NAME.pub`."""
    from ..bundle.signature import keygen as write_pair

    private, public = write_pair(name)
    if as_json:
        return print_json({"private": str(private), "public": str(public)})
    out.print(f"private key: {escape(str(private))} (keep it secret; it signs bundles)\npublic key:  "
              f"{escape(str(public))} (give it to "
              "whoever loads the bundles: `verify --key`, `load_bundle(path, key=...)`)")


def tune(bundle: Annotated[Path, typer.Argument(help="A bundle folder or .tar.gz.")],
         output: Annotated[Path, typer.Option("--output", "-o", help="A new folder, or a file ending .tar.gz.")],
         threads: ThreadsOption = None,
         budget: Annotated[float, typer.Option("--budget", min=0, help="Seconds the measured search may spend "
                                               "improving the plan.")] = 60.0,
         shape: MeasuredShapeOption = None, inputs: MeasuredInputsOption = None,
         calibration: CalibrationOption = None, as_json: JsonOption = False) -> None:
    """Place a bundle's model again by measuring it on this board.

    It measures on the bundle's sample inputs, unless --shape or --inputs gives others, and writes a new
    bundle. A reduced-precision bundle's precision and tolerance compete again (int8 only with
    --calibration)."""
    from ..products.export import tune_bundle

    with steps("tuning", not as_json) as step:
        written = tune_bundle(bundle, output, threads=threads, budget=budget, progress=step,
                              calibration=calibration, **measured_at(shape, inputs))
    print_bundle(written, f"tuned from {bundle}", as_json)


def verify(bundle: Annotated[Path, typer.Argument(help="A bundle folder or .tar.gz.")],
           key: Annotated[Path | None, typer.Option("--key", help="The signer's public key (NAME.pub): the "
                                                    "manifest must carry a valid signature by it.")] = None,
           allow_unrun: Annotated[bool, typer.Option("--allow-unrun", help="Succeed even when no stage can run "
                                                     "here (only the hashes are then checked).")] = False,
           as_json: JsonOption = False) -> None:
    """Check a bundle's hashes and signature, then run its stages here.

    --key checks the signature. Each stage this host can run is compared with ONNX Runtime. Exit 1 on a
    mismatch or tampering, or when no stage could run here (unless --allow-unrun)."""
    from ..products.verify import verify_bundle

    with steps("verifying", not as_json):
        report = verify_bundle(bundle, key=key, allow_unrun=allow_unrun)
    if as_json:
        print_json(report)
    else:
        _print_signature(report["signature"])
        for problem in report["files"]:
            out.print(f"[red]tampered:[/] {escape(str(problem))}")
        table = Table("stage", "provider", "ran here", "how", "result", title=escape(str(bundle)))
        for s in report["stages"]:
            result = {True: "[green]match[/]", False: f"[red]mismatch[/] {escape(s.get('error', ''))}",
                      None: "not checked"}[s["ok"]]
            label = s["provider"] + ("" if s.get("precision", "fp32") == "fp32" else f"[{s['precision']}]")
            table.add_row(str(s["index"]), escape(label), "yes" if s["ran"] else "no", escape(s["how"]), result)
        if report["stages"]:
            out.print(table)
        for name, o in (report["outputs"] or {}).items():
            out.print(f"output {escape(name)}: {'[green]matches[/]' if o['ok'] else '[red]differs[/]'} the reference "
                      f"(max abs error {o.get('max_abs_error')})")
        if report.get("unrun"):
            out.print(f"[{'yellow' if allow_unrun else 'red'}]no stage could run here[/]: only the hashes were "
                      "checked" + ("" if allow_unrun else "; pass --allow-unrun to accept that"))
    if not report["ok"]:
        raise typer.Exit(1)


def _print_signature(signature: dict) -> None:
    if signature["ok"]:
        out.print("[green]signature valid[/]: the manifest, and through its hashes every file, is as the key's "
                  "owner signed it")
    elif signature["ok"] is False:
        out.print(f"[red]tampered:[/] {escape(signature['error'])}")
    elif signature["signed"]:
        out.print("[yellow]signed, signature not checked[/]: give --key PUB to check it; the hashes alone prove "
                  "only that no file was corrupted")
    else:
        out.print("[yellow]unsigned[/]: the hashes prove only that no file was corrupted, not who made the bundle "
                  "(sign with `export --sign KEY`, check with `verify --key PUB`)")


setup_app = typer.Typer(help="Install the toolkits some providers need.", no_args_is_help=True)
setup_app.command("rknn", short_help="Create the rknn-toolkit2 environment that RKNN stages need.")(rknn)
