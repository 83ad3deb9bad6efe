"""Text from a run file made safe for where it is shown: a terminal, or Markdown.

Module names, exception texts and paths come from the file, which is untrusted input: a name
may hold terminal escape sequences (that recolour, retitle or rewrite a terminal) or HTML (that
a Markdown viewer renders). The HTML report escapes everything through ``tables.esc``; text and
Markdown go through these as they leave a renderer.

Example::

    terminal("blocks.0\\x1b[2J")             # 'blocks.0\\\\x1b[2J': shown, never obeyed
    markdown("module <script>x</script>")    # 'module &lt;script>x&lt;/script>'
"""

from __future__ import annotations

import re

# C0 controls but tab and newline, DEL, and C1 controls (0x9b alone starts a CSI sequence).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`).*?(?<!`)\1(?!`)")


_SGR = re.compile(r"(\x1b\[[0-9;]*m)")  # select graphic rendition: colour, bold, nothing else


def terminal(text: str, colour: bool = False) -> str:
    """``text`` with every control byte but tab and newline written out (``\\x1b``).
    ``colour``: colour and bold sequences are kept (``top`` paints with them); they can
    neither move the cursor nor retitle or clear the terminal."""
    if colour:
        return "".join(part if i % 2 else terminal(part) for i, part in
                       enumerate(_SGR.split(text)))
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def markdown(text: str) -> str:
    """``text`` (Markdown) with control bytes written out and, outside code blocks and code
    spans (where Markdown shows HTML as text), every ``<`` escaped, so no tag reaches a
    viewer: a name in prose reads as written."""
    out, fenced = [], False
    for line in terminal(text).split("\n"):
        if _FENCE.match(line):
            fenced = not fenced
            out.append(line)
        else:
            out.append(line if fenced else _prose(line))
    return "\n".join(out)


def _prose(line: str) -> str:
    parts, last = [], 0
    for span in _CODE_SPAN.finditer(line):
        parts += [line[last:span.start()].replace("<", "&lt;"), span.group()]
        last = span.end()
    parts.append(line[last:].replace("<", "&lt;"))
    return "".join(parts)
