"""Shared helpers: tiny deterministic training loops that run in milliseconds on CPU."""

from __future__ import annotations

import os
import sys

import pytest

pytest_plugins = ["pytester"]  # test_amp_step runs a user's pytest session with the plugin

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def python_env() -> dict:
    """Environment for subprocesses: the package importable, torch single-threaded."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


PYTHON = sys.executable
