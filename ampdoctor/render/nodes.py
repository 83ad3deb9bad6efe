"""``ampdoctor index``'s one line: the node summaries it wrote, and of how many rank files.

Example::

    render_indexed(nodes.index("run.h5"))
    # 'run.h5: 2 node summaries written (run.node0.json, run.node8.json) for 16 rank files; ...'
"""

from __future__ import annotations

import os
from typing import Any

from ..safe import terminal


def render_indexed(ix: Any) -> str:
    """What ``nodes.index`` did (an ``Indexed``), in one line."""
    name = terminal(os.path.basename(ix.path))
    if not ix.written:
        out = (f"{name}: every one of its {ix.ranks} rank files already has a fresh node "
               "summary; nothing written")
    else:
        shown = ", ".join(terminal(os.path.basename(p)) for p in ix.written[:3]) + \
            (f", ... {len(ix.written) - 3} more" if len(ix.written) > 3 else "")
        out = (f"{name}: {len(ix.written)} node summar{'y' if len(ix.written) == 1 else 'ies'} "
               f"written ({shown}) for {ix.entries} of its {ix.ranks} rank files"
               + (f"; {ix.covered} already had one" if ix.covered else ""))
    if ix.unreadable:
        out += (f"; {ix.unreadable} rank files have no summary to hold (cut short, or format 1):"
                " diagnose reads them on their own")
    return out
