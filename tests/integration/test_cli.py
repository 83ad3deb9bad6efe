"""The CLI veneer: help for every command, README and docs/ coverage, exit codes, renderings."""

import glob
import json
import os
import re
import subprocess

import pytest
import torch
from click.testing import CliRunner
from conftest import PYTHON, ROOT, python_env
from helpers import fresh, train

import ampdoctor
from ampdoctor import cli
from ampdoctor.runfile import schema


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cli") / "run.h5")
    model, opt = fresh()
    scaler = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(model, opt, scaler, path=path, every=2):
        train(model, opt, scaler, steps=6, bad_step=3)
    return path


@pytest.mark.parametrize("name", sorted(cli.cli.commands))
def test_every_command_has_help_and_is_in_the_readme(name):
    command = cli.cli.commands[name]
    assert command.help and len(command.help) > 20
    result = CliRunner().invoke(cli.cli, [name, "--help"])
    assert result.exit_code == 0 and "Usage" in result.output
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert f"ampdoctor {name}" in readme  # the front door names every command
    docs = [open(p).read() for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))]
    heading = re.compile(rf"^#+ .*`ampdoctor {name}\b", re.M)
    assert any(heading.search(text) for text in [readme, *docs]), f"no section on {name}"


def test_diagnose_text_json_markdown(recorded):
    assert cli.main(["diagnose", recorded]) == 0
    runner = CliRunner()
    out = runner.invoke(cli.cli, ["diagnose", recorded, "--format", "json"])
    data = json.loads(out.output)
    assert set(data) >= {"verdict", "confidence", "first_bad", "causes", "evidence", "fixes",
                         "run"}
    assert data["first_bad"]["step"] == 3
    md = runner.invoke(cli.cli, ["diagnose", recorded, "--format", "markdown"]).output
    assert md.startswith("## ampdoctor:")


def test_fail_on_unhealthy(recorded):
    assert cli.main(["diagnose", recorded, "--fail-on", "unhealthy"]) == 1
    assert cli.main(["diagnose", recorded]) == 0


def test_dump(recorded, capsys):
    assert cli.main(["dump", recorded]) == 0
    out = capsys.readouterr().out
    assert f"format version {schema.FORMAT_VERSION}" in out and "steps" in out and \
        "stats" in out and "\nsummary:\n  rank: 0" in out


@pytest.mark.parametrize("args", [["diagnose", "/nonexistent/run.h5"], ["dump", "/"],
                                  ["diagnose", "--format", "xml", "x"],
                                  ["index", "/nonexistent/run.h5"]])
def test_bad_input_is_one_line_and_exit_2(args):
    proc = subprocess.run([PYTHON, "-m", "ampdoctor", *args], env=python_env(),
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip()


def test_index_writes_the_missing_node_summaries_once(tmp_path, capsys):
    from synthetic import Synth, write

    from ampdoctor.runfile import paths

    base = str(tmp_path / "run.h5")
    for r in range(10):
        write(Synth(20), paths.rank_path(base, r), rank=r, world_size=10)
    assert cli.main(["index", base]) == 0
    assert capsys.readouterr().out == ("run.h5: 2 node summaries written (run.node0.json, "
                                       "run.node8.json) for 10 of its 10 rank files\n")
    assert cli.main(["index", base]) == 0
    assert "already has a fresh node summary; nothing written" in capsys.readouterr().out
    assert cli.main(["diagnose", base]) == 0 and "10 rank files" in capsys.readouterr().out


def test_version():
    proc = subprocess.run([PYTHON, "-m", "ampdoctor", "--version"], env=python_env(),
                          capture_output=True, text=True)
    assert proc.returncode == 0 and ampdoctor.__version__ in proc.stdout
