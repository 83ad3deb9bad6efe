"""What a job's diagnosis says of its files: the node summaries used or passed over, and the
rank files that could not be read at all.

A node summary (``runfile/nodes.py``) only makes a diagnosis faster, so nothing here changes
the answer; but a node summary that is missing or older than its ranks' files makes the next
diagnosis slower, and a rank file cut short is left out of it, and the user should know both.
numpy-free, torch-free.

Example::

    notes(found, ["run.rank5.h5 is damaged ..."], 16)
    # ['Left out: run.rank5.h5 is damaged ...; the other 15 rank files were diagnosed.', ...]
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional

from . import ranks

# Below this many rank files, reading each one's own /summary takes under a second or so:
# no need to suggest `ampdoctor index`.
SUGGEST_INDEX = 256
SHOWN = 3  # unreadable files named one by one


def notes(found: Any, left_out: list[str], files: int) -> list[str]:
    """Notes on the files behind a job's diagnosis (``found``: ``nodes.lookup``'s answer)."""
    out = []
    if left_out:
        named = "; ".join(left_out[:SHOWN]) + (f"; and {len(left_out) - SHOWN} more"
                                              if len(left_out) > SHOWN else "")
        out.append(f"Left out, could not be read: {named}. The other {files - len(left_out)} "
                   "rank files were diagnosed without them.")
    for path, node in sorted(found.missing.items()):
        out.append(f"{os.path.basename(node)} names {os.path.basename(path)}, which is missing.")
    out += [f"Passed over: {why}." for why in found.unreadable]
    slow = files - len(found.summaries)
    if found.nodes and found.stale:
        out.append(f"The files of {_ranks(found.stale)} changed after their node summary was "
                   "written: read on their own.")
    if found.nodes and slow > len(found.stale):
        out.append(f"{slow - len(found.stale)} rank files have no node summary (a node that "
                   "stopped before writing one): read from their own files; `ampdoctor index "
                   "RUN` writes one.")
    elif not found.nodes and files >= SUGGEST_INDEX:
        out.append(f"The {files} rank files have no node summaries (recorded by an older "
                   "ampdoctor, or their nodes stopped first): each was read on its own; "
                   "`ampdoctor index RUN` writes them, for a faster diagnosis next time.")
    return out


def _ranks(files: Any) -> str:
    known = sorted(r for r in (_rank(p) for p in files) if r is not None)
    return ranks.ranks_text(known, limit=8) if known else f"{len(files)} rank files"


def _rank(path: str) -> Optional[int]:
    match = re.search(r"\.rank(\d+)\.[^.]*$", os.fspath(path))
    return int(match.group(1)) if match else None
