"""What the command says is what it did: errors first on stderr, plans run at the shapes they recorded, help
that reads at 80 columns, bench rows that name what ran, kept decisions shown, and `exec` as `python`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
import typer
from typer.testing import CliRunner

import uhop_onnx
from uhop_onnx.cli import app
from uhop_onnx.providers import create

from .support import uhop

MODELS = Path(__file__).parents[1] / "models"
ENCODER = MODELS / "example_encoder.onnx"  # input_ids: batch x sequence, both free


def cli(*args: str):
    result = CliRunner().invoke(app, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


@pytest.mark.slow
@pytest.mark.parametrize("command", [["optimize", "absent.onnx", "-o", "plan"], ["run", "absent.onnx"],
                                     ["inspect", "absent.onnx"], ["compare", "absent.onnx"],
                                     ["bench", "absent.onnx"], ["export", "absent.onnx", "-t", "x86-64", "-o", "b"]])
def test_an_error_is_the_first_line_of_stderr(command, tmp_path):
    result = uhop(*command, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.startswith("error: "), result.stderr
    assert "absent.onnx: no such file\n" in result.stderr.splitlines(keepends=True)[0]  # one line, not wrapped


@pytest.fixture(scope="module")
def encoder_plan(tmp_path_factory) -> Path:
    """The encoder placed at batch 2, sequence 7: a plan folder whose model has free dimensions."""
    folder = tmp_path_factory.mktemp("encoder") / "plan"
    uhop_onnx.optimize(str(ENCODER), providers=["ort-cpu"], profile=False, shapes={"input_ids": (2, 7)}).save(folder)
    return folder


def test_run_and_compare_a_plan_at_the_shapes_it_recorded(encoder_plan):
    ran = cli("run", encoder_plan, "--json")
    assert ran.exit_code == 0, ran.output
    report = json.loads(ran.stdout)
    assert report["outputs"][0]["shape"] == [2, 7, 32]
    assert report["inputs"] == "generated, seed 0; input_ids: 2x7 as the plan recorded"
    compared = cli("compare", encoder_plan, "--json")
    assert compared.exit_code == 0 and json.loads(compared.stdout)["ok"], compared.output
    given = json.loads(cli("run", encoder_plan, "--shape", "input_ids:1x3", "--json").stdout)
    assert given["outputs"][0]["shape"] == [1, 3, 32] and given["inputs"] == "generated, seed 0"


def _commands(group, path=()):
    """Every command's path below `group`, groups included."""
    for name, command in group.commands.items():
        yield (*path, name)
        if hasattr(command, "commands"):
            yield from _commands(command, (*path, name))


def _command(path):
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return command


@pytest.mark.parametrize("path", list(_commands(typer.main.get_command(app))), ids=" ".join)
def test_help_reads_as_sentences_at_80_columns(path):
    """Each command's summary is one sentence on one row of its group's list; its description and its options'
    texts are whole sentences, reflowed to the width, with nothing cut off."""
    shown = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"}).stdout
    lines = shown.splitlines()
    assert max(map(len, lines)) <= 80, shown
    if path[-1] != "serve":  # serve's option names are its own module's, and rich cuts the longest one
        assert "…" not in shown, shown
    command = _command(path)
    if path[-1] == "exec":  # the program's options are its own: no help page of typer's
        assert shown.startswith("usage: uhop-onnx exec") and len(lines) <= 3, shown
        return
    description = " ".join(shown.split("Usage:")[1].split("╭")[0].split()[1:])
    assert description.endswith("."), shown
    for param in command.params:
        assert not param.help or param.help.endswith("."), (param.name, param.help)
    if hasattr(command, "commands"):
        listed = shown.split("─ Commands ")[1].split("╰")[0].splitlines()[1:]
        assert len(listed) == len(command.commands), shown  # one row each


def tiny_model(folder: Path) -> Path:
    """Sigmoid then Softmax: ops the kernels provider has none of."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Sigmoid", ["x"], ["s"], name="sigmoid"),
         helper.make_node("Softmax", ["s"], ["y"], name="softmax", axis=-1)], "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])])
    path = folder / "tiny.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_bench_marks_an_unmeasured_plan_and_a_provider_alone_that_took_no_node(tmp_path, monkeypatch):
    """A plan whose placement optimize did not time is not timed as "the optimized plan": its row says why;
    a provider alone that took no node says which providers ran instead."""
    timed = []

    def rounds(candidates, *args, **kwargs):
        timed.extend(c.name for c in candidates)
        return {c.name: {"ms": 1.0, "spread": 0.0, "round_medians_ms": [1.0], "error": None,
                         "stages": ["ort-cpu x2"] if c.name.endswith(" alone") else []} for c in candidates}

    why = "no whole plan could be timed within the budget"
    monkeypatch.setattr("uhop_onnx.products.bench._optimize_in_process",
                        lambda *args: {"seconds": 0.5, "stages": ["ort-cpu x2"], "unmeasured": why})
    monkeypatch.setattr("uhop_onnx.products.bench.time_candidates", rounds)
    model = tiny_model(tmp_path)
    report = json.loads(cli("bench", model, "--providers", "kernels,ort-cpu", "--json").stdout)
    plan = report["candidates"]["uhop-onnx plan"]
    assert "uhop-onnx plan" not in timed and plan["ms"] is None and plan["unmeasured"] == why
    assert not report["failed"] and plan["stages"] == ["ort-cpu x2"]
    alone = report["candidates"]["kernels alone"]
    assert alone["ran"] == ["ort-cpu"] and alone["note"] == "ran ort-cpu: kernels took no node"
    ort = report["candidates"]["ort-cpu alone"]
    assert ort["ran"] == ["ort-cpu"] and "note" not in ort
    table = cli("bench", model, "--providers", "kernels,ort-cpu")
    rows = table.stdout.split("┡")[1]
    assert table.exit_code == 0 and "1.000" not in rows.split("uhop-onnx plan")[1], table.stdout  # no figure
    words = rows.split()
    assert words[words.index("plan") + 2:][:2] == ["unmeasured:", "no"], table.stdout
    assert "(ran ort-cpu:" in table.stdout and "took no" in table.stdout, table.stdout


@pytest.mark.slow
@pytest.mark.skipif(not create("kernels").present, reason="the kernels provider needs a C compiler")
def test_bench_names_what_ran_for_a_provider_that_took_no_node(tmp_path):
    result = uhop("bench", str(tiny_model(tmp_path)), "--providers", "kernels", "--threads", "1", "--rounds", "1",
                  "--budget", "5", "--json")
    assert result.returncode == 0, result.stderr
    alone = json.loads(result.stdout)["candidates"]["kernels alone"]
    assert alone["ran"] == ["ort-cpu"] and alone["note"] == "ran ort-cpu: kernels took no node", alone


def test_explain_says_why_a_plan_is_unmeasured(tmp_path):
    why = "no whole plan could be timed within the budget (3.6 s); first-supported was kept untimed"
    folder = tmp_path / "plan"
    uhop_onnx.optimize(str(tiny_model(tmp_path)), providers=["ort-cpu"], profile=False).save(folder)
    data = json.loads((folder / "plan.json").read_text())
    data["profile"] = {"chosen": "first-supported", "measured": 0, "cached": 0, "seconds": 0.01, "unmeasured": why,
                       "candidates": {"first-supported": {"ms": None, "spread": 0.0, "stages": "ort-cpu x2",
                                                          "error": "not timed: the budget ran out"}}}
    (folder / "plan.json").write_text(json.dumps(data))
    shown = cli("explain", folder)
    assert shown.exit_code == 0 and f"this plan is unmeasured: {why}" in " ".join(shown.stdout.split()), shown.stdout


@pytest.mark.skipif(not create("openvino").present, reason="openvino is not installed")
def test_explain_shows_the_decision_that_kept_a_plan(tmp_path):
    """A plan an adapting session's explorer kept: explain shows the decision beside it."""
    from uhop_onnx.adaptation.serving import Decisions
    from uhop_onnx.models import cnn

    decisions = Decisions(tmp_path / "decisions")
    plan = uhop_onnx.optimize(cnn(), providers=["openvino"], profile=False)
    decisions.keep("input: 1x3x32x32", "openvino first", plan, 12, refused={"litert first": "it differs"},
                   decision="openvino first: ort-cpu first slower (2 ms)")
    [(bucket, entry)] = decisions.table.read().items()
    folder = tmp_path / "decisions" / entry["plan"]
    said = " ".join(cli("explain", folder).stdout.split())
    assert (f"kept for {bucket} by an adapting session after 12 calls: openvino first serves it "
            "(openvino first: ort-cpu first slower (2 ms))") in said, said
    assert "litert first: refused: it differs" in said
    assert json.loads(cli("explain", folder, "--json").stdout)["kept"] == {bucket: entry}


@pytest.mark.skipif(not create("litert").present, reason="litert is not installed")
def test_inspect_checks_a_model_at_the_shapes_given():
    """LiteRT needs static shapes: at the encoder's free sizes it refuses most nodes; at --shape's, none."""
    free = json.loads(cli("inspect", ENCODER, "--providers", "litert", "--json").stdout)
    fixed = json.loads(cli("inspect", ENCODER, "--providers", "litert", "--shape", "input_ids:1x16", "--json").stdout)
    kept = sum(n["support"]["litert"]["ok"] is not None for n in fixed["nodes"])
    assert fixed["shapes"] == {"input_ids": [1, 16]} and fixed["supported"]["litert"] == kept
    assert free["shapes"] == {} and free["supported"]["litert"] < kept
    assert "checked at input_ids: 1x16" in " ".join(cli("inspect", ENCODER, "--shape", "input_ids:1x16").stdout.split())
    with pytest.raises(uhop_onnx.InputError, match="the model has no input 'nope'"):
        cli("inspect", ENCODER, "--shape", "nope:1x16")


def python(*args: str, cwd: Path) -> str:
    """What `args` print, run by this interpreter in `cwd`; fails on a non-zero exit."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE")}
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={**env, "UHOP_CACHE_DIR": str(cwd / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


EXEC_FORMS = [("-m", "uhop_onnx.exec"), ("-m", "uhop_onnx.cli", "exec", "--", "python")]


@pytest.mark.slow
@pytest.mark.parametrize("form", [EXEC_FORMS[0], EXEC_FORMS[1][:-1]],
                         ids=["python -m uhop_onnx.exec", "uhop-onnx exec"])
def test_exec_runs_a_script_named_python_something_as_the_script(form, tmp_path):
    """An interpreter is known by what it is (this one's path here), not by its name."""
    (tmp_path / "python3-tool").write_text("import sys\nprint(sys.argv)\n")
    assert python(*form, "python3-tool", "z", cwd=tmp_path) == "['python3-tool', 'z']\n"
    assert python(*form, sys.executable, "python3-tool", "z", cwd=tmp_path) == "['python3-tool', 'z']\n"


def test_the_uhop_onnx_command_starts_a_program_without_the_clis_modules(tmp_path):
    """A program under `uhop-onnx exec` pays at start for the patch, not for typer, rich or onnx."""
    command = Path(sys.executable).parent / "uhop-onnx"
    if not command.is_file():
        pytest.skip("the uhop-onnx command is not installed beside this interpreter")
    model = Path(__file__).parent.parent / "models" / "example_mobilenet.onnx"
    (tmp_path / "app.py").write_text(
        "import sys, numpy as np, onnxruntime as ort\n"
        "s = ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])\n"
        "i = s.get_inputs()[0]\n"
        "s.run(None, {i.name: np.zeros(i.shape, np.float32)})\n"
        "print(sorted({'typer', 'rich', 'onnx'} & set(sys.modules)), type(s).__module__)\n")
    done = subprocess.run([str(command), "exec", "--", "python", "app.py", str(model)], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120, env={**os.environ, "UHOP_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "[] uhop_onnx.products.patch\n"


@pytest.mark.slow
@pytest.mark.parametrize("form", EXEC_FORMS, ids=["python -m uhop_onnx.exec", "uhop-onnx exec python"])
def test_exec_passes_the_interpreters_options_on(form, tmp_path):
    code = ("import sys; print(sys.argv, sys.flags.optimize, sys.flags.dev_mode, sys.stdout.write_through, "
            "sys.dont_write_bytecode, sys.warnoptions[-1], sys.flags.isolated)")
    assert python(*form, "-u", "-X", "dev", "-O", "-B", "-W", "error::UserWarning", "-c", code, "arg",
                  cwd=tmp_path) == "['-c', 'arg'] 1 True True True error::UserWarning 0\n"
    (tmp_path / "flags.py").write_text(f"import sys\n{code.replace('; ', chr(10))}\n")
    assert python(*form, "-OWdefault", "-m", "flags", cwd=tmp_path).endswith("1 False False False default 0\n")
    isolated = ("-I", "-c", "import sys; print(sys.flags.isolated, sys.path[0])")
    assert python(*form, *isolated, cwd=tmp_path) == python(*isolated, cwd=tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("form", EXEC_FORMS, ids=["python -m uhop_onnx.exec", "uhop-onnx exec python"])
def test_exec_puts_the_scripts_folder_first_on_the_path_as_python_does(form, tmp_path):
    """The working folder is not on the program's path: its tabnanny.py does not shadow the standard one."""
    (tmp_path / "tabnanny.py").write_text("SHADOW = True\n")
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "main.py").write_text(
        "import os, sys, tabnanny\nprint(sys.path[0], os.getcwd() in sys.path, hasattr(tabnanny, 'SHADOW'))\n")
    assert python(*form, "app/main.py", cwd=tmp_path) == python("app/main.py", cwd=tmp_path)
    assert python("app/main.py", cwd=tmp_path) == f"{(tmp_path / 'app').resolve()} False False\n"
