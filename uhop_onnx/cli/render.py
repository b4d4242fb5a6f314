"""Printing: the consoles, tables that fit 80 columns, progress on stderr, and what several commands show."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, ProgressColumn, SpinnerColumn, Task, TextColumn
from rich.table import Table
from rich.text import Text

from ..runtime.report import (candidate_error, effort_text, interval_text, ms_order, ms_text, off_accelerator_lines,
                      stages_summary)


out = Console()
err = Console(stderr=True)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


class Clock(ProgressColumn):
    """Seconds elapsed and, under a `budget`, seconds left: `12 s, 18 s left`; nothing on the best-plan line."""

    def __init__(self, budget: float | None):
        super().__init__()
        self.budget = budget

    def render(self, task: Task) -> Text:
        if task.fields.get("best"):
            return Text("")
        elapsed = task.elapsed or 0.0
        left = "" if self.budget is None else f", {max(self.budget - elapsed, 0):.0f} s left"
        return Text(f"{elapsed:.0f} s{left}", style="progress.elapsed")


@contextmanager
def steps(title: str, enabled: bool = True, budget: float | None = None) -> Iterator[Any]:
    """A transient spinner on stderr with the current step, seconds elapsed (and left of `budget`), and on
    a second line the best plan so far (a step starting with `partitioner.search.BEST`); yields the step
    callback. Only on a terminal: elsewhere rich would leave an empty line, above any error that follows."""
    if not (enabled and err.is_interactive):
        yield lambda step: None
        return
    from ..partitioner.search import BEST

    with Progress(SpinnerColumn(finished_text=" "), TextColumn("{task.description}"), Clock(budget),
                  console=err, transient=True) as progress:
        task = progress.add_task(title)
        best = progress.add_task("", visible=False, total=1, completed=1, best=True)

        def step(text: str) -> None:
            if text.startswith(BEST):
                progress.update(best, description=escape(text), visible=True)
            else:
                progress.update(task, description=escape(f"{title}: {text}"))

        yield step


def fit(table: Table, *long: int) -> Table:
    """Short columns kept whole on one line; only the `long` ones (indices) wrap when the terminal is narrow."""
    for k, column in enumerate(table.columns):
        column.no_wrap = k not in long
        column.overflow = "fold"
    return table


def print_stages(plan, title: str, wide: bool = False) -> None:
    """The stages; with `wide`, each one's measured alternatives too."""
    table = Table("stage", "provider", "nodes", "first node .. last node", "ms", "boundary ms",
                  *(["alternatives (ms)"] if wide else []), title=escape(title))
    for k, s in enumerate(plan.stages):
        span = s.nodes[0] if len(s.nodes) == 1 else f"{s.nodes[0]} .. {s.nodes[-1]}"
        note = plan.fell_back(k)
        provider = escape(s.label) + (f" [yellow]{escape(note)}[/]" if note else "")
        others = ", ".join(f"{p} {ms:.3f}" for p, ms in sorted(s.alternatives.items(), key=lambda kv: kv[1])
                           if p != s.label)
        table.add_row(str(k), provider, str(len(s.nodes)), escape(span), ms_text(s.cost_ms), ms_text(s.boundary_ms),
                      *([escape(others)] if wide else []))
    out.print(fit(table, 3, 6))
    if plan.profile:
        out.print("[dim]stage ms: the stage's blocks, each measured alone on its provider; a whole plan's ms "
                  "(below): the plan run end to end in its own process, hand-overs included[/]")


def print_replaced(plan) -> None:
    """The nodes a provider's build check refused, and where they run instead."""
    where = {node: s.label for s in plan.stages for node in s.nodes}
    for r in plan.replaced:
        out.print(f"[yellow]re-placed[/] {escape(r['node'])}: {r['provider']} failed its build check, now on "
                  f"{where.get(r['node'], '?')} ({escape(r['reason'])})", highlight=False)


def print_adaptation(plan) -> None:
    """Per shape bucket an adapting session decided on this plan: its decision, then each candidate tried with
    its figure (its time over the serving plan's, a 95% interval), where it stood and what ONNX Runtime held it
    to."""
    for key, bucket in (plan.adaptation or {}).items():
        out.print(f"[bold]adapted at {escape(key)}[/] ({bucket['calls']} calls): "
                  f"{escape(bucket['decision'] or 'not decided yet')}", highlight=False)
        for trial in bucket["candidates"]:
            low, high = trial["interval"] or (None, None)
            figure = f", {low:.3f}-{high:.3f}x the serving plan's time" if low is not None else ""
            why = f": {trial.get('error') or trial.get('why')}" if trial.get("error") or trial.get("why") else ""
            if trial.get("tolerance"):
                error = trial.get("max_abs_error")
                why += f" (held to {trial['tolerance']}{'' if error is None else f'; max abs error {error:.3g}'})"
            out.print(f"  {escape(trial['label'])}: {escape(trial['state'])}{figure}{escape(why)}", highlight=False)


def print_candidates(profile: dict, console: Console = out) -> None:
    """One line per whole plan timed, at the console's width: its figure, the range of its round medians, its
    stages (a long plan summarised) and, in a column of its own, why it failed or its error against fp32;
    stages and errors that do not fit are cut with an ellipsis (`--json` has them whole). Then why the plan
    chosen is unmeasured, where it is."""
    rows = sorted(profile["candidates"].items(), key=lambda kv: ms_order(kv[1]["ms"]))
    cells = [[("* " if name == profile["chosen"] else "") + name, ms_text(c["ms"]), interval_text(c),
              stages_summary(c["stages"]), candidate_error(c)] for name, c in rows]
    headers = ["whole plan", "ms", "range", "stages", "error"][:5 if any(row[4] for row in cells) else 4]
    widths = [max(len(h), *(len(row[k]) for row in cells)) for k, h in enumerate(headers)]
    room = max(console.width, 60) - 3 * len(headers) - 1  # what borders and padding leave
    widths[3] = min(widths[3], max(room - sum(widths[:3]) - (len(headers) > 4) * 16, 12))
    if len(headers) > 4:
        widths[4] = max(room - sum(widths[:4]), 12)
    table = Table(*headers, title="whole plans timed (* this plan)", caption=escape(effort_text(profile)))
    for row, (name, c) in zip(cells, rows):
        texts = [_cut(text, width) for text, width in zip(row, widths)]
        style = "bold green" if name == profile["chosen"] else "red" if c["ms"] is None else ""
        table.add_row(*(Text(text, style=style if k in (0, 4) else "") for k, text in enumerate(texts)))
    for column, width in zip(table.columns, widths):
        column.no_wrap, column.width = True, width
    console.print(table)
    if profile.get("unmeasured"):
        console.print(f"[yellow]this plan is unmeasured:[/] {escape(profile['unmeasured'])}", highlight=False)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def print_bundle(bundle: Path, title: str, as_json: bool = False) -> None:
    manifest = _manifest_of(bundle)
    if as_json:
        return print_json({"bundle": str(bundle), "manifest": manifest})
    out.print(escape(f"{title}: {bundle} ({manifest['placement']})"), highlight=False, soft_wrap=True)
    table = Table("stage", "provider", "format", "nodes", "files")
    for k, s in enumerate(manifest["stages"]):
        table.add_row(str(k), escape(s["provider"]), escape(s["artifact"]["format"]), str(len(s["nodes"])),
                      escape(", ".join(s["artifact"]["files"])))
    out.print(fit(table, 0))
    for line in off_accelerator_lines(manifest.get("off_accelerator")):
        out.print(escape(line), highlight=False)
    if manifest.get("profile"):
        print_candidates(manifest["profile"])


def _manifest_of(bundle: Path) -> dict:
    from ..bundle.manifest import read_manifest, unpacked

    with unpacked(bundle) as folder:
        return read_manifest(folder)
