"""The node summary a node's ``ampdoctor record`` keeps while its command runs, and at exit.

``record`` already knows which rank files its own processes write (``written.py``). Once the
command has started, a thread looks at their sizes and modification times every
``INTERVAL`` seconds; when one changed (a flush), it rewrites this node's summary,
``run.node{R}.json`` (``runfile/nodes.py``); once the command has exited, it writes it a
last time. ``diagnose`` then reads one small file per node instead of every rank file's
``/summary``.

A failure here never touches the command: the node summary is only a faster way to read what
the rank files hold, so a write that fails (a full disk, a removed directory) is given up
silently, and ``diagnose`` reads those rank files on their own.

Example::

    with keeper.Keeper(settings) as node:
        code = run_command(command, env, started=node.start)   # run.node8.json on each flush
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any, Optional

from ...runfile import nodes, paths
from . import written

INTERVAL = 2.0  # seconds between looks: a flush is at most a second apart, a rewrite is cheap


class Keeper:
    """Keeps this node's summary current while a command runs (a context manager)."""

    def __init__(self, settings: Any, interval: float = INTERVAL):
        self.settings = settings
        self.interval = interval
        self._stop = threading.Event()
        self._seen: dict[str, Optional[nodes.Key]] = {}
        self._node: Optional[str] = None
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "Keeper":
        return self

    def start(self) -> None:
        """Start looking, once the command runs: ``record`` starts it with a ``preexec_fn``,
        which a thread holding a lock at that fork could deadlock."""
        if self.settings.session and self._thread is None:  # no list: nothing to speak for
            self._thread = threading.Thread(target=self._watch, name="ampdoctor-node-summary",
                                            daemon=True)
            self._thread.start()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.update()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            self.update()

    def update(self) -> Optional[str]:
        """Rewrite the node summary if a rank file changed since the last; returns its path."""
        try:
            return self._update()
        except Exception:  # noqa: BLE001 - the node summary never fails the command
            return None

    def _update(self) -> Optional[str]:
        files = own_rank_files(self.settings)
        now = {p: nodes.key(p) for p in files}
        if not files or now == self._seen:
            return None
        node = paths.node_path(self.settings.output, _rank(files[0]) or 0)  # the lowest
        nodes.write(node, files)
        if self._node is not None and self._node != node:  # a lower rank appeared late
            os.unlink(self._node)
        self._seen, self._node = now, node
        return node


def own_rank_files(settings: Any) -> list[str]:
    """The rank files of this output that this node's processes noted, by rank."""
    out = os.path.abspath(settings.output)
    mine = [p for p in written.read(settings.session) or []
            if paths.run_name(p) == out and _rank(p) is not None and os.path.isfile(p)]
    return sorted(mine, key=lambda p: _rank(p) or 0)


def _rank(path: str) -> Optional[int]:
    match = re.search(r"\.rank(\d+)\.[^.]*$", path)
    return int(match.group(1)) if match else None
