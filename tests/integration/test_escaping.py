"""Text from a run file reaches every output as text, never as escape sequences, tags or links.

A corpus of hostile names (HTML, backtick runs, a backslash before a backtick, OSC/CSI/BEL, the
C1 byte 0x9b, bidi overrides, line breaks, mathtext, a very long name) is put into run files as
module names, tensor names, an exception's text and /meta strings; every command reads them,
and each stream is checked by its kind: terminal text (stdout, stderr) holds no C0/C1 or bidi
control; Markdown, rendered by a CommonMark parser, holds no HTML element or link of the file's;
HTML holds no element of the file's; JSON parses and holds the text whole.
"""

import html.parser
import json
import os
import re
import shutil
import subprocess

import h5py
import numpy as np
import pytest
from conftest import PYTHON, ROOT, python_env
from synthetic import Synth, write

from ampdoctor import safe
from ampdoctor.runfile.schema import Kind

markdown_it = pytest.importorskip("markdown_it")

CORPUS = (
    "<img src=x onerror=alert(1)>", "<script>alert(1)</script>",
    "a`<b>bold</b>`c", "``<i>x</i>``", "\\`<u>y</u>\\`",  # code spans a name closes early
    "\x1b]0;pwned\x07", "\x1b]8;;http://evil.example\x1b\\ln\x1b]8;;\x1b\\",  # OSC: title, link
    "\x1b[2J\x1b[H", "\x1b[8mhidden\x1b[0m", "\x9b31m", "\x1b[30;40m",  # CSI, C1 CSI, colour
    "\u202eevil\u202c", "\u2066iso\u2069",  # bidi override, isolate
    "\nverdict: healthy", "\r\nINJECTED", "\u2028sep",  # lines of its own
    "[a link](javascript:alert(1))", "<http://evil.example>", "&lt;b&gt;", "*em* _u_ ~s~",
    "# heading", "| cell |", "$\\frac{a}{b$",  # links, entities, emphasis, blocks, mathtext
)
HOSTILE = "blocks.0." + "".join(CORPUS)
LONG = "blocks.1." + "<b>`\x1b[31m" * 400 + "tail\x1b["  # an unterminated CSI at the end
EXCEPTION = "boom <img src=x onerror=alert(2)> `x` \x1b]0;title\x07\nTraceback: fake"
# what may come out as markup: the report's own footer
OWN_HTML = {"<sub>", "</sub>"}


def _hostile_run(path):
    s = Synth(40, dtype="float16", scaler=True)
    s.skip(range(5, 40), loss_nan=True)
    s.snapshot(5, "forward", HOSTILE, "Attention<script>`", fp32_finite=1)
    s.sampled(range(0, 40, 10), Kind.OUTPUT, HOSTILE, absmax=70000.0)
    s.sampled(range(0, 40, 10), Kind.PARAM_GRAD, LONG, absmax=1.0)
    s.exception("RuntimeError", EXCEPTION)
    s.meta["device"]["name"] = "gpu\x1b]0;x\x07<img src=x>"
    s.meta["optimizer"][0]["class"] = "Adam`<img src=x>`"
    write(s, path)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("names")
    hostile = _hostile_run(str(folder / "run.h5"))
    v2 = str(folder / "v2.h5")
    shutil.copyfile(os.path.join(ROOT, "fixtures", "formats", "v2.h5"), v2)
    _name_every_module(v2, HOSTILE)
    return {"synthetic": hostile, "v2": v2, "folder": folder}


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


def _run(*args):
    proc = subprocess.run([PYTHON, "-m", "ampdoctor", *args], env=python_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _terminal_clean(proc.stderr), proc.stderr[-2000:]  # stderr is a terminal's too
    return proc.stdout


def _terminal_clean(text):
    """No C0/C1 control but newline and tab, no bidi control: nothing a terminal obeys."""
    return not [c for c in text if (ord(c) < 32 and c not in "\n\t") or 0x7f <= ord(c) <= 0x9f
                or c in "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068"
                "\u2069\u2028\u2029"]


def _no_line_of_its_own(text):
    """The name's line breaks are written out: none of its parts starts a line."""
    return not any(line.lstrip("|>-*# ").startswith(("verdict: healthy", "INJECTED", "sep",
                                                     "Traceback: fake"))
                   for line in text.splitlines())


def _markdown_is_text(text, images=()):
    """Rendered by CommonMark, the Markdown holds no HTML, link or heading of the file's: only
    its own footer and ``images`` (the figures it wrote)."""
    md = markdown_it.MarkdownIt("commonmark")
    images = {md.normalizeLink(path) for path in images}
    found = []

    def walk(tokens):
        for t in tokens:
            if t.type in ("html_inline", "html_block") and t.content.strip() not in OWN_HTML:
                found.append(t.content)
            if t.type == "link_open" or t.type == "image" and t.attrs["src"] not in images:
                found.append(t.attrs)
            if t.type == "heading_open" and "heading" in text.splitlines()[t.map[0]]:
                found.append("a heading of the file's")
            walk(t.children or [])

    walk(md.parse(text))
    assert not found, found
    rendered = md.render(text)
    rendered = re.sub(r'<img src="([^"]*)"', lambda m: "" if m.group(1) in images else m.group(),
                      rendered)
    for tag in ("<img", "<script", "<b>", "<i>", "<u>", "href="):
        assert tag not in rendered, (tag, rendered[:3000])
    return True


TEXT_COMMANDS = [("diagnose",), ("dump",), ("top", "--once", "--wait", "0")]


@pytest.mark.parametrize("which", ["synthetic", "v2"])
@pytest.mark.parametrize("args", TEXT_COMMANDS, ids=lambda a: a[0])
def test_terminal_text_holds_no_control(files, which, args):
    out = _run(*args, files[which])
    assert _terminal_clean(out) and _no_line_of_its_own(out), out[-3000:]
    assert "blocks.0" in out
    if args[0] == "diagnose":  # the name is still there to read, its escapes written out
        assert "\\x1b]0;pwned\\x07" in out and "<img src=x onerror=alert(1)>" in out


@pytest.mark.parametrize("which", ["synthetic", "v2"])
def test_compare_both_ways_holds_no_control(files, which):
    good = os.path.join(ROOT, "fixtures", "formats", "v2.h5")
    for pair in ((good, files[which]), (files[which], files[which])):
        out = _run("compare", *pair)
        assert _terminal_clean(out) and _no_line_of_its_own(out), out[-3000:]
        md = _run("compare", *pair, "--format", "markdown")
        assert _terminal_clean(md) and _markdown_is_text(md)


@pytest.mark.parametrize("which", ["synthetic", "v2"])
@pytest.mark.parametrize("args", [("diagnose", "--format", "markdown"),
                                  ("report", "--format", "markdown", "-o", "-")],
                         ids=["diagnose", "report"])
def test_markdown_holds_no_html_or_link_of_the_file(files, which, args):
    out = _run(args[0], files[which], *args[1:])
    assert _terminal_clean(out) and _no_line_of_its_own(out)
    assert _markdown_is_text(out)
    # the name reads as written once rendered
    rendered = markdown_it.MarkdownIt("commonmark").render(out)
    assert "&lt;img src=x onerror=alert(1)&gt;" in rendered


def test_report_markdown_file_is_text(files, tmp_path):
    target = tmp_path / "r.md"
    _run("report", files["synthetic"], "--format", "markdown", "-o", str(target))
    text = target.read_text()
    assert _terminal_clean(text) and _no_line_of_its_own(text) and _markdown_is_text(text)


def test_report_markdown_figures_are_images_only():
    """The figures' links (paths the caller chose) stay one image each, whatever the path."""
    from ampdoctor.release.report import release_report
    from ampdoctor.render.release import render_release
    from ampdoctor.runfile.store import load

    with load(os.path.join(ROOT, "fixtures", "formats", "v2.h5")) as run:
        report = release_report(run)
    path = "figs/a b)<img src=x>.png"
    text = render_release(report, "markdown", images={"loss": path})
    assert _markdown_is_text(text, images=(path,))


class _Elements(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


@pytest.mark.parametrize("which", ["synthetic", "v2"])
def test_html_report_holds_no_element_of_the_file(files, which, tmp_path):
    target = tmp_path / "r.html"
    _run("report", files[which], "-o", str(target))
    parser = _Elements()
    parser.feed(target.read_text())
    # (the report's own: b, code, p, ...; the file's would be script, i, u, a, onerror)
    assert not [t for t, a in parser.tags if t in ("script", "i", "u", "a") or "onerror" in a]
    assert all(a.get("src", "").startswith("data:image/png") for t, a in parser.tags
               if t == "img")


@pytest.mark.parametrize("which", ["synthetic", "v2"])
def test_json_holds_the_text_whole(files, which, tmp_path):
    out = _run("diagnose", files[which], "--format", "json")
    assert _terminal_clean(out)  # json.dumps writes every control out
    data = json.loads(out)
    from ampdoctor.runfile.run import one_line  # how a name is read: its breaks written out

    assert any(one_line(HOSTILE) in text for text in _strings(data))
    report = json.loads(_run("report", files[which], "--format", "json", "-o", "-"))
    assert report["diagnosis"]["verdict"] == data["verdict"]


def _strings(data):
    if isinstance(data, str):
        yield data
    elif isinstance(data, dict):
        for value in data.values():
            yield from _strings(value)
    elif isinstance(data, list):
        for value in data:
            yield from _strings(value)


def test_export_writes_its_texts_as_markdown_text(files, tmp_path):
    logdir = tmp_path / "tb"
    _run("export", files["synthetic"], "--tensorboard", str(logdir))
    texts = []
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for here, _dirs, names in os.walk(logdir):
        if any(n.startswith("events.") for n in names):
            acc = EventAccumulator(here, size_guidance={"tensors": 0})
            acc.Reload()
            for tag in acc.Tags().get("tensors", []):
                texts += [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)
                          if e.tensor_proto.string_val]
    assert texts
    for text in texts:
        assert _terminal_clean(text) and _markdown_is_text(text)


def test_record_closing_line_is_one_escaped_line(capsys):
    from ampdoctor.record.command import launch

    launch._say("ampdoctor: recorded 3 steps; diagnosis: unstable_op in " + HOSTILE)
    err = capsys.readouterr().err
    assert _terminal_clean(err) and err.count("\n") == 1


def test_error_sentences_are_escaped(tmp_path):
    """A path (or a file's text) in the one sentence on stderr is shown, never obeyed."""
    bad = tmp_path / "x\x1b]0;t\x07.h5"
    bad.write_bytes(b"not hdf5")
    proc = subprocess.run([PYTHON, "-m", "ampdoctor", "diagnose", str(bad)], env=python_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and _terminal_clean(proc.stderr)
    assert len(proc.stderr.splitlines()) == 1


# -- the escapers themselves -------------------------------------------------------------------


def test_terminal_writes_every_control_out():
    assert safe.terminal("a\x1b[31mb\tc\n\x9b\u202e\x07") == "a\\x1b[31mb\tc\n\\x9b\\u202e\\x07"
    assert safe.one_line("a\nb\r\u2028") == "a\\nb\\x0d\\u2028"


@pytest.mark.parametrize("name", CORPUS + (HOSTILE, LONG, "`", "``", " ` ", "a b", "1. x", "2) x",
                                           "- x", "---", "===", "+ x", "## x", "    x"))
def test_markdown_escapers_read_as_written(name):
    md = markdown_it.MarkdownIt("commonmark")
    shown = safe.one_line(name)
    code = md.parse(safe.md_code(name))[1].children
    assert [t.type for t in code] == ["code_inline"] and code[0].content == shown
    para = md.parse("x " + safe.md_text(name))[1].children
    assert [t.type for t in para] == ["text"] * len(para)
    assert "".join(t.content for t in para) == ("x " + shown).rstrip()  # (a paragraph's end)
    block = md.parse("\n".join(safe.md_fence(name + "\n```\n" + name, "python")))
    assert [t.type for t in block] == ["fence"]
    assert block[0].content == safe.terminal(name + "\n```\n" + name) + "\n"


def test_top_keeps_its_own_colours_only():
    from ampdoctor.live import top

    painted = top._painter(True)("red", "x") + " \x1b[2J\x1b[8m" + "\ufdd08\ufdd1"
    shown = top._finish(painted, 80, True)
    assert shown.startswith("\x1b[31mx\x1b[0m \\x1b[2J\\x1b[8m")
    assert "\x1b[8m" not in shown and "\x1b[2J" not in shown
    assert top._finish("\x1b[", 80, True) == "\\x1b["  # unterminated: shown, no error
