"""Recorded training processes that die on purpose, for tests/integration/test_reliability.py.

    python tests/support/reliability_harness.py PLAN.json     # writes <out>/results.json

The plan lists cases; each case is one recorded training run (a small fp16 model with a
GradScaler, the sampled tier, and a NaN batch that triggers a forensic replay) that is ended
by a signal or an exception at a chosen moment. The parent imports torch once and forks one
child per case: a fork costs milliseconds where a fresh interpreter with torch costs seconds.

Moments are chosen deterministically with a profiler that counts Python call events in the
child (``sys.setprofile``): "tick N" is the N-th event, so a seeded draw of ticks spreads kills
over everything the run executes (training, hooks, flushes, replays) and a failing case can
be replayed exactly. Ticks cannot land inside a C call, so some cases are killed by the parent
instead, a random fraction of a millisecond after the child announces a flush.

The child reports on a pipe: ``S`` before each flush of the run file, ``F <steps>`` after it
(steps on disk), ``T <step>`` after each optimizer step, ``R <tick>`` when recording started,
``W`` when a stop signal waits for ampdoctor's own code to finish, ``H`` from a script's own
SIGTERM handler. ``term_in_replay`` sends SIGTERM from the model's forward while ampdoctor
re-runs it (the replay's isolation must not put the held signal's state back).
"""

from __future__ import annotations

import atexit
import json
import os
import random
import select
import signal
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import TinyNet, batches  # noqa: E402

import ampdoctor  # noqa: E402
from ampdoctor.record.exits import ExitGuard  # noqa: E402
from ampdoctor.runfile import store  # noqa: E402

STEPS = 24
BAD_STEP = 10  # a NaN in the batch: a skipped step, a forensic replay and its snapshot
_FLUSH = store.Writer.flush
_WAIT = ExitGuard._wait_for_signal


class Ticks:
    """Counts profiler events; fires ``signum`` at a tick, or some ticks after a named call."""

    def __init__(self, tick=None, call=None, signum=signal.SIGKILL):
        self.count = 0
        self.tick = tick
        self.call = call  # [file suffix, function name, occurrence, ticks after it]
        self.seen = 0
        self.signum = signum

    def __call__(self, frame, event, arg):
        self.count += 1
        if self.call is not None and event == "call":
            suffix, name, occurrence, after = self.call
            code = frame.f_code
            if code.co_name == name and code.co_filename.endswith(suffix):
                self.seen += 1
                if self.seen == occurrence:
                    self.tick = self.count + after
        if self.count == self.tick:
            os.kill(os.getpid(), self.signum)


def train(path, report, case):
    """One recorded run, as a user would write it (plus the reports on ``report``)."""
    def say(text):
        os.write(report, (text + "\n").encode())

    def reporting_flush(self):
        say("S")
        _FLUSH(self)
        say(f"F {self.committed['steps']}")

    store.Writer.flush = reporting_flush

    def reporting_wait(self, *args):
        say("W")
        return _WAIT(self, *args)

    ExitGuard._wait_for_signal = reporting_wait
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    ticks = case.get("ticks")
    if case.get("user_handler"):
        signal.signal(signal.SIGTERM, lambda s, f: say("H"))
    if case.get("term_in_replay"):
        _term_in_replay(model)

    def loop():
        for i, (x, y) in enumerate(batches(STEPS, bad_step=BAD_STEP)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            say(f"T {i}")
            if case.get("raise_at") == i:
                raise RuntimeError(f"the training script failed at step {i}")
            if case.get("pause"):
                time.sleep(case["pause"])
        say(f"E {ticks.count if ticks else 0}")

    rec = ampdoctor.watch(model, opt, scaler, path=path, every=3, flush_seconds=0.0)
    say(f"R {ticks.count if ticks else 0}")
    if case.get("with", True):
        with rec:
            loop()
    else:  # never closed by the script: the interpreter's exit finishes the file
        loop()


def _term_in_replay(model):
    """SIGTERM sent from inside a replay: the model's forward, called by ampdoctor's
    forensic code (a fix trial's re-run: the NaN step's bad batch is found without one),
    sends it to its own process."""
    forward = model.forward
    forensic = os.path.join("ampdoctor", "record", "forensic") + os.sep

    def replayed_forward(*args, **kwargs):
        frame = sys._getframe(1)
        while frame is not None:
            if forensic in frame.f_code.co_filename:
                os.kill(os.getpid(), signal.SIGTERM)
                break
            frame = frame.f_back
        return forward(*args, **kwargs)

    model.forward = replayed_forward


def child(path, report, case):
    ticks = None
    if "tick" in case or "call" in case or case.get("count"):
        ticks = Ticks(case.get("tick"), case.get("call"), case.get("signal", signal.SIGKILL))
        case["ticks"] = ticks
        sys.setprofile(ticks)
    train(path, report, case)
    sys.setprofile(None)
    os.write(report, f"C {ticks.count if ticks else 0}\n".encode())


def run_case(out, case):
    """Fork, run one case, end it as planned; return what the parent saw."""
    path = os.path.join(out, f"{case['id']}.h5")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            child(path, w, case)
        except BaseException as exc:  # noqa: BLE001 - the planned exception
            # What the interpreter does with an uncaught exception before it exits.
            sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
            code = 1
        atexit._run_exitfuncs()
        os._exit(code)
    os.close(w)
    lines = _watch(pid, r, case)
    _, status = os.waitpid(pid, 0)
    os.close(r)
    return {"id": case["id"], "path": path, "lines": lines,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}


def _watch(pid, fd, case):
    """Collect the child's reports; for 'async' cases, kill it inside its n-th flush."""
    lines, buf, flushes = [], b"", 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            continue
        data = os.read(fd, 65536)
        if not data:
            break
        buf += data
        *done, buf = buf.split(b"\n")
        for line in done:
            text = line.decode()
            lines.append(text)
            if text == "S" and "async_flush" in case:
                flushes += 1
                if flushes == case["async_flush"]:
                    time.sleep(case["delay_us"] / 1e6)
                    os.kill(pid, case.get("signal", signal.SIGKILL))
            if text.startswith("T ") and case.get("async_step") == int(text[2:]):
                time.sleep(case["delay_us"] / 1e6)
                os.kill(pid, case.get("signal", signal.SIGKILL))
    else:
        os.kill(pid, signal.SIGKILL)
        lines.append("TIMEOUT")
    return lines


def main(plan_path):
    with open(plan_path) as fh:
        plan = json.load(fh)
    torch.set_num_threads(1)
    # Torch and ampdoctor import a lot lazily (optimizers pull in sympy); a short recorded
    # run here does it once, so that the children's ticks count the run, not the imports.
    warm = {"id": "warmup", "with": True}
    train(os.path.join(plan["out"], "warmup.h5"), os.open(os.devnull, os.O_WRONLY), warm)
    calibration = run_case(plan["out"], {"id": "calibration", "count": True})
    first, last = (int(_report(calibration, kind)) for kind in "RE")
    for case in plan["cases"]:
        if "at" in case:  # a fraction of the run, from recording's start to the loop's end
            case["tick"] = first + int(case["at"] * (last - first))
    results = [calibration] + [run_case(plan["out"], case) for case in plan["cases"]]
    with open(os.path.join(plan["out"], "results.json"), "w") as fh:
        json.dump(results, fh)


def _report(result, kind):
    return next(line.split()[1] for line in result["lines"] if line.startswith(kind + " "))


def spread(n, seed):
    """``n`` moments spread over a run, as fractions: one uniform draw in each n-th of it."""
    rng = random.Random(seed)
    return [(k + rng.random()) / n for k in range(n)]


if __name__ == "__main__":
    main(sys.argv[1])
