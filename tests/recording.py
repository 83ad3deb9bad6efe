"""Record a training script into a run file, in a subprocess, the way a user would.

The one place the fixture tests start a recording. Until ``ampdoctor record`` lands on main,
the child runs the script under the in-process discovery recorder (no model, optimizer or
scaler given: they are found as the script uses them, exactly what ``record`` does); switching
to ``ampdoctor record -o OUT --every N -- python SCRIPT ARGS`` is a change to ``command`` only.
"""

from __future__ import annotations

import subprocess
import sys

from conftest import PYTHON, python_env

# Runs in the child: start the recorder, run the script as __main__, finish the file with the
# script's outcome (an exception becomes the run's status, as `ampdoctor record` records it).
_CHILD = """
import runpy, sys
import ampdoctor.recorder as r
out, every, script, args = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
rec = r.Recorder(path=out, every=every).start()
sys.argv = [script, *args]
try:
    runpy.run_path(script, run_name="__main__")
except BaseException as exc:
    rec.record_exception(type(exc), exc)
    rec.close("exception:" + type(exc).__name__)
    raise
rec.close()
"""


def command(script: str, out: str, args: list[str], every: int) -> list[str]:
    return [PYTHON, "-c", _CHILD, out, str(every), script, *args]


def record(script: str, out: str, args: list[str] = (), every: int = 10,
           timeout: float = 300) -> subprocess.CompletedProcess:
    """Record ``python script *args`` into ``out``; returns the finished process."""
    return subprocess.run(command(script, out, list(args), every), env=python_env(),
                          capture_output=True, text=True, timeout=timeout)


def start(script: str, out: str, args: list[str] = (), every: int = 10) -> subprocess.Popen:
    """Like ``record`` but without waiting (several fixtures record side by side)."""
    return subprocess.Popen(command(script, out, list(args), every), env=python_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


if __name__ == "__main__":  # python tests/recording.py SCRIPT OUT [EVERY] [-- ARGS]
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    head = argv[: argv.index("--")] if "--" in argv else argv
    proc = record(head[0], head[1], rest, int(head[2]) if len(head) > 2 else 10)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    sys.exit(proc.returncode)
