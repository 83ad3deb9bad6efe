"""One escaper per output kind, for text from a run file (or a parity JSON) on its way out.

Module names, exception texts, ``/meta`` strings and paths come from the file, which is
untrusted input: a name may hold terminal escape sequences (that recolour, retitle or rewrite a
terminal), bidi overrides (that reorder what a line seems to say), or HTML and Markdown (that a
viewer renders). Every renderer of a kind uses that kind's escaper on such text where it puts it
into its output; the renderer's own markup is added around the escaped text, never through it.

- terminal: ``terminal``: no C0 or C1 control but tab and newline, no bidi control; each is
  written out (``\\x1b``, ``\\u202e``), so ESC, BEL, CSI and OSC are shown, never obeyed.
- Markdown (CommonMark): ``md_text`` for prose and table cells (every character CommonMark
  gives a meaning inline backslash-escaped, line breaks written out: no tag, link or block
  survives), ``md_code`` for an inline code span, ``md_fence`` for a fenced code block (each
  fenced by more backticks than the longest run inside).
- HTML: ``html`` (``html.escape``, quotes included).
- JSON: ``json.dumps`` itself (its default ``ensure_ascii`` writes every control out).

Example::

    terminal("blocks.0\\x1b[2J")          # 'blocks.0\\\\x1b[2J': shown, never obeyed
    md_code("a`b")                        # '``a`b``'
    md_text("<img src=x>")                # '\\\\<img src=x\\\\>'
"""

from __future__ import annotations

import html as _html
import re
from typing import Any

# C0 controls but tab and newline, DEL, C1 controls (0x9b alone starts a CSI sequence), the
# bidi controls (embeddings, overrides, isolates and marks: they reorder what a line shows) and
# the Unicode noncharacters U+FDD0-U+FDEF (``top`` marks its own colours with them).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e"
                      "\u2066-\u2069\ufdd0-\ufdef]")
# Line breaks a viewer honours beside \n (and \r\n): written out in Markdown's one-line texts.
_BREAKS = {"\n": "\\n", "\r": "\\r", "\u2028": "\\u2028", "\u2029": "\\u2029"}
_BREAK = re.compile("[\n\r\u2028\u2029]")
# The ASCII punctuation CommonMark reads inline (emphasis, code, links, autolinks and raw HTML,
# entities, escapes themselves) or in a table (|): each is backslash-escaped in prose.
_MD_INLINE = re.compile(r"([\\`*_\[\]<>&|~!])")
# What starts a block at the beginning of a line (only the text's start can be there: its
# breaks are written out): a heading, a bullet, a thematic break or setext underline, an
# ordered list's number, each followed by a space or the end ('2.5x' and '--apply' start none).
_MD_BLOCK = re.compile(r"^\s*(?:[#+\-=]+|\d{1,9}[.)])(?=\s|$)")
_BACKTICKS = re.compile("`+")


def _written(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def terminal(text: str) -> str:
    """``text`` with every control but tab and newline written out: ``\\x1b``, ``\\x9b``,
    ``\\u202e``. Nothing in it can move the cursor, recolour, retitle or reorder a line."""
    return _CONTROL.sub(lambda m: _written(m.group()), text)


def one_line(text: str) -> str:
    """``terminal(text)`` with its line breaks written out too (``\\n``)."""
    return _BREAK.sub(lambda m: _BREAKS[m.group()], terminal(text))


def md_text(value: Any) -> str:
    """``value`` as Markdown prose that reads as written: one line, its inline punctuation
    backslash-escaped and a leading block marker escaped, so no tag, link, emphasis or block
    of the file's survives a CommonMark renderer."""
    text = _MD_INLINE.sub(r"\\\1", one_line(str(value)))
    block = _MD_BLOCK.match(text)
    if block is None:
        return text
    cut = block.end() - 1  # the marker, or the '.' or ')' after a list item's number
    return text[:cut] + "\\" + text[cut:]


def _fence(text: str, least: int) -> str:
    longest = max((len(run) for run in _BACKTICKS.findall(text)), default=0)
    return "`" * max(least, longest + 1)


def md_code(value: Any) -> str:
    """``value`` as one inline code span, fenced by more backticks than any run inside it (a
    backtick in a name stays a backtick); its line breaks and controls written out."""
    text = one_line(str(value))
    if not text:
        return ""
    fence = _fence(text, 1)
    # CommonMark strips one space from each end when both are spaces: pad a text that begins
    # or ends with a backtick (it would join the fence) or a space (it would be stripped).
    pad = " " if text[0] in "` " or text[-1] in "` " else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def md_fence(code: str, info: str = "") -> list[str]:
    """``code`` as a fenced code block's lines: the fence longer than any backtick run inside,
    so no line of the code can close it; controls written out."""
    body = terminal(code)
    fence = _fence(body, 3)
    return [fence + info, *body.split("\n"), fence]


def html(value: Any) -> str:
    """``value`` as HTML text or an attribute's value."""
    return _html.escape(str(value), quote=True)
