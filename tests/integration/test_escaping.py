"""A module name from a run file reaches a terminal or a Markdown viewer as text, never as
escape sequences or tags (the HTML report escapes everything already: test_report.py)."""

import os
import shutil
import subprocess

import h5py
import numpy as np
import pytest
from conftest import PYTHON, ROOT, python_env

from ampdoctor.render import safe

HOSTILE = ("blocks.0\x1b]0;pwned\x07\x1b[2J<script>alert(1)</script>\x9b31m'\"x"
           "\nverdict: healthy\r\nINJECTED\u2028line")


def _name_every_module(path, name):
    """Point every module name of ``path`` (snapshots, tensors) at ``name``, added to /blob."""
    data = name.encode()
    with h5py.File(path, "r+") as f:
        blob = f["blob"]
        off = blob.shape[0]
        blob.resize((off + len(data),))
        blob[off:] = np.frombuffer(data, np.uint8)
        for table, column in (("snapshots", "module"), ("tensors", "name")):
            rows = f[table][:]
            rows[f"{column}_off"], rows[f"{column}_len"] = off, len(data)
            f[table][:] = rows


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("names") / "run.h5")
    shutil.copyfile(os.path.join(ROOT, "fixtures", "formats", "v2.h5"), path)
    _name_every_module(path, HOSTILE)
    return path


def _out(*args):
    proc = subprocess.run([PYTHON, "-m", "ampdoctor", *args], env=python_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _no_control_bytes(text):
    return not any(ord(c) < 32 and c not in "\n\t" or 0x7f <= ord(c) <= 0x9f for c in text)


def _no_line_of_its_own(text):
    """The name's line breaks are written out: none of its parts starts a line (the v2
    fixture's verdict is bad_input, so a line 'verdict: healthy' could only be the name's)."""
    lines = text.splitlines()
    return not any(line.lstrip("| ").startswith(("verdict: healthy", "INJECTED", "line"))
                   for line in lines) and "\u2028" not in text


@pytest.mark.parametrize("args", [("diagnose",), ("dump",),
                                  ("compare", os.path.join(ROOT, "fixtures", "formats", "v2.h5"))])
def test_text_output_writes_control_bytes_out(hostile, args):
    out = _out(*args, hostile)
    assert _no_control_bytes(out) and _no_line_of_its_own(out)
    if args[0] == "diagnose":  # the name is still there to read, its escapes written out
        assert "blocks.0\\x1b]0;pwned\\x07\\x1b[2J<script>" in out


@pytest.mark.parametrize("args", [("diagnose", "--format", "markdown"),
                                  ("report", "--format", "markdown", "-o", "-")])
def test_markdown_holds_no_tag_from_the_file(hostile, args):
    out = _out(args[0], hostile, *args[1:])
    assert _no_control_bytes(out) and _no_line_of_its_own(out)
    prose = [line for line in _outside_fences(out)]
    for line in prose:
        stripped = safe._CODE_SPAN.sub("", line)
        assert "<script" not in stripped, line
    assert "&lt;script>alert(1)&lt;/script>" in out


def _outside_fences(text):
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield line


def test_safe_escapes_and_leaves_code_alone():
    assert safe.terminal("a\x1b[31mb\tc\n") == "a\\x1b[31mb\tc\n"
    assert safe.markdown("x <b>`<i>`\n```\n<u>\n```\n") == "x &lt;b>`<i>`\n```\n<u>\n```\n"
    text = "**First bad:** module <img src=x onerror=alert(1)>"
    assert safe.markdown(safe.markdown(text)) == safe.markdown(text)  # composes, once


def test_top_once_writes_control_bytes_out(hostile):
    out = _out("top", "--once", hostile)
    assert _no_control_bytes(out) and _no_line_of_its_own(out) and "blocks.0" in out


def test_json_and_html_keep_the_name_whole(hostile, tmp_path):
    """Machine formats hold the name with its breaks written out, in valid JSON / escaped HTML."""
    import json

    data = json.loads(_out("diagnose", hostile, "--format", "json"))
    assert "verdict: healthy" in json.dumps(data) and data["verdict"] == "bad_input"
    html = tmp_path / "r.html"
    _out("report", hostile, "-o", str(html))
    text = html.read_text()
    assert "<script>alert" not in text and "&lt;script&gt;" in text


def test_top_keeps_its_own_colours_only():
    from ampdoctor.live import top

    assert top.safe.terminal("\x1b[31mred\x1b[0m \x1b[2J", colour=True) == \
        "\x1b[31mred\x1b[0m \\x1b[2J"
