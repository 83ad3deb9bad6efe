"""pytest's hooks and fixtures for every folder of tests/ (the ``gpu`` skip, ``run_path``,
one thread per xdist worker).

The shared non-test modules live in tests/support/ (helpers, synthetic, recording, testenv,
the reliability and live-view scripts). They are imported by their bare names (``from helpers
import fresh, train``), as the scripts among them that run by path import each other: so
support/ goes on ``sys.path`` once, here, before any test module is imported.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

from testenv import PYTHON, ROOT, SUPPORT, python_env  # what tests import from conftest

__all__ = ["PYTHON", "ROOT", "SUPPORT", "python_env"]

pytest_plugins = ["pytester"]  # test_amp_step runs a user's pytest session with the plugin

# A suite started in the background (``cmd &`` in a script, nohup) inherits SIGINT ignored, and
# every process it starts would too (an ignored signal survives exec): the tests that press
# Ctrl-C (record forwarding SIGINT, top quitting on it) would wait in vain. With the handler
# Python installs in a terminal, the children get SIGINT's default again, as a user's do.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Under xdist (``-n auto``: a worker per core) each worker, and each process a test starts, gets
# one thread unless OMP_NUM_THREADS says otherwise: torch's default, a thread per core in every
# worker, makes the OpenMP threads wait on each other for a core (a fixture recording beside a
# busy worker took three times the CPU and the wall time with two threads than with one).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0) > 1 and \
        "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:  # imported already (a plugin): its pool is sized; resize it
        sys.modules["torch"].set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip)


@pytest.fixture
def run_path(tmp_path):
    return str(tmp_path / "run.h5")
