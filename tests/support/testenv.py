"""Where the checkout is, and how a test's subprocess finds it (no torch, no pytest).

Tests import these through ``conftest`` (``from conftest import PYTHON, ROOT, python_env``);
the support scripts that run by path (``python tests/support/recording.py ...``) import them
from here, as their own folder is first on ``sys.path`` there.
"""

from __future__ import annotations

import os
import sys

SUPPORT = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(SUPPORT))
PYTHON = sys.executable


def python_env() -> dict:
    """Environment for subprocesses: the package importable, torch single-threaded."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
