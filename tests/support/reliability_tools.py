"""Run files made on purpose (good, bad, damaged) and a fuzzer for the reader. No torch.

    python tests/support/reliability_tools.py killed PATH       # a run whose writer is SIGKILLed
    python tests/support/reliability_tools.py fuzz OUT N SEED BASE...  # prints a JSON summary

The fuzzer damages real run files (bit flips, zeroed or overwritten ranges, truncations) and
reads each one in a forked child with a time limit, through everything a user can call:
``load``, ``diagnose`` and its three renderings, ``inspect`` and the CLI. A case passes when
it gets a diagnosis or one ``RunFileError`` sentence naming the file; a crash, a hang, any
other exception or a CLI exit code other than 0 or 2 is a failure, reported with its bytes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import sys
import time
import traceback

import h5py
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from ampdoctor import cli
from ampdoctor.diagnosis import engine
from ampdoctor.errors import RunFileError  # noqa: E402
from ampdoctor.render import diagnosis as report
from ampdoctor.runfile import schema, store  # noqa: E402
from ampdoctor.runfile.schema import Event, Kind, Source  # noqa: E402

# -- synthetic runs ---------------------------------------------------------------------------


def reading_commands(path: str, good: str, out: str) -> dict[str, list[str]]:
    """Every command that reads a run file, as ``ampdoctor`` arguments, on ``path`` (``good``:
    a sound run for ``compare`` to set it against; ``out``: a folder for what they write):
    what the crafted files and the fuzzer's mutants are each read with."""
    return {
        "diagnose": ["diagnose", path],
        "diagnose-json": ["diagnose", path, "--format", "json"],
        "dump": ["dump", path],
        "top": ["top", "--once", "--wait", "0", path],
        "report": ["report", path, "-o", os.path.join(out, "report.html")],
        "markdown": ["report", path, "--format", "markdown", "-o", os.path.join(out, "r.md")],
        "export": ["export", path, "--tensorboard", os.path.join(out, "tb")],
        "compare": ["compare", good, path],
        "compare-base": ["compare", path, good],
    }


def synthetic_run(path: str, steps: int = 40, flush_every: int = 10, close: bool = True,
                  modules: int = 6) -> store.Writer:
    """A run written through ``store.Writer`` the way the recorder writes one: sampled stats
    every 5 steps, a skipped step with a snapshot and its saved batch, meta, events."""
    w = store.Writer(path, argv=["train.py", "--synthetic"])
    w.meta("status", schema.STATUS_RUNNING)
    w.meta("autocast", {"device_type": "cpu", "enabled": True, "dtype": "float16"})
    w.meta("scaler", {"class": "GradScaler", "enabled": True, "init_scale": 65536.0})
    names = [f"blocks.{i}.mlp" for i in range(modules)]
    ids = {}
    for i, name in enumerate(names):
        for kind in (Kind.OUTPUT, Kind.GRAD_OUTPUT):
            ids[(name, kind)] = _tensor(w, len(ids), kind, name, "Linear")
    for i in range(steps):
        _step(w, i, ids, bad=(i == steps // 2))
        if (i + 1) % flush_every == 0:
            w.flush()
    if close:
        w.close(schema.STATUS_FINISHED)
    else:
        w.flush()
    return w


def _tensor(w, tid, kind, name, owner):
    row = schema.empty("tensors", 1)
    row["id"], row["kind"], row["dtype"], row["numel"] = tid, int(kind), 2, 4096
    row["name_off"], row["name_len"] = w.text(name)
    row["type_off"], row["type_len"] = w.text(owner)
    w.append("tensors", row)
    return tid


def _step(w, i, ids, bad=False):
    row = schema.empty("steps", 1)
    row["step"], row["time"], row["dt"] = i, 1.7e9 + i, 0.1
    row["loss"] = np.nan if bad else 2.0 / (1 + i)
    row["scale"], row["scale_after"] = 65536.0, 32768.0 if bad else 65536.0
    row["found_inf"] = row["skipped"] = int(bad)
    row["grad_norm"], row["lr"], row["micro"], row["sampled"] = 1.0, 1e-3, 1, int(i % 5 == 0)
    row["flags"] = schema.flag(Event.SKIPPED) | schema.flag(Event.NONFINITE_LOSS) if bad else 0
    w.append("steps", row)
    w.append("groups", np.array([(i, 0, 1e-3, 0.01)], schema.GROUPS))
    if i % 5 == 0:
        stats = schema.empty("stats", len(ids))
        stats["step"], stats["tensor"] = i, list(ids.values())
        stats["seq"], stats["source"] = np.arange(len(ids)), int(Source.SAMPLED)
        stats["numel"] = stats["sample_n"] = 4096
        stats["absmax"], stats["rms"], stats["nonfinite"] = 3.0 + i, 1.0, 0
        w.append("stats", stats)
    if bad:
        _snapshot(w, i, ids)


def _snapshot(w, step, ids):
    sid = w.rows("snapshots")
    snap = schema.empty("snapshots", 1)
    snap["id"], snap["step"], snap["trigger"], snap["phase"] = sid, step, int(Event.SKIPPED), 1
    snap["culprit"] = next(iter(ids.values()))
    snap["module_off"], snap["module_len"] = w.text("blocks.0.mlp")
    snap["module_type_off"], snap["module_type_len"] = w.text("Linear")
    snap["detail_off"], snap["detail_len"] = w.text(json.dumps({"why": "synthetic"}))
    w.append("snapshots", snap)
    batch = np.arange(32, dtype=np.float32).reshape(4, 8)
    arr = schema.empty("arrays", 1)
    arr["snapshot"], arr["dtype"], arr["ndim"] = sid, b"<f4", 2
    arr["name_off"], arr["name_len"] = w.text("args.0")
    arr["shape"][0, :2] = batch.shape
    arr["numel"] = arr["saved"] = batch.size
    arr["data_off"], arr["data_len"] = w.bytes(batch.tobytes())
    w.append("arrays", arr)
    event = schema.empty("events", 1)
    event["step"], event["kind"], event["value"] = step, int(Event.FORENSICS), float(sid)
    w.append("events", event)


def killed_run(path: str) -> None:
    """A synthetic run whose writer is SIGKILLed after its flushes: flagged as being written."""
    synthetic_run(path, close=False)
    os.kill(os.getpid(), signal.SIGKILL)


# -- bad files --------------------------------------------------------------------------------


def bad_file(case: str, path: str, good: str) -> str:
    """Make the bad file ``case`` at ``path`` (``good``: a finished run to damage)."""
    if case == "missing":
        pass
    elif case == "directory":
        os.mkdir(path)
    elif case == "empty":
        open(path, "wb").close()
    elif case == "random_bytes":
        with open(path, "wb") as fh:
            fh.write(random.Random(1).randbytes(20000))
    elif case == "truncated":
        data = open(good, "rb").read()
        open(path, "wb").write(data[: len(data) * 2 // 3])
    elif case == "other_hdf5":
        with h5py.File(path, "w") as f:
            f["images"] = np.zeros((4, 4))
            f.attrs["format"] = "something-else"
    elif case in ("missing_table", "wrong_dtype", "newer_version"):
        open(path, "wb").write(open(good, "rb").read())
        with h5py.File(path, "r+") as f:
            if case == "missing_table":
                del f["events"]
            elif case == "wrong_dtype":
                del f["steps"]
                f.create_dataset("steps", data=np.zeros(3, dtype=[("step", "<f4")]))
            else:
                f.attrs["format_version"] = schema.FORMAT_VERSION + 1
    elif case == "zero_steps":
        w = store.Writer(path)
        w.meta("status", schema.STATUS_RUNNING)
        w.close(schema.STATUS_FINISHED)
    else:
        raise ValueError(case)
    return path


# -- fuzzing ----------------------------------------------------------------------------------

MUTATIONS = ("flip", "zero", "garbage", "truncate")


def mutate(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    kind = rng.choice(MUTATIONS)
    out = bytearray(data)
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    elif kind in ("zero", "garbage"):
        start = rng.randrange(len(out))
        length = min(rng.choice((1, 4, 16, 64, 512, 4096)), len(out) - start)
        out[start:start + length] = bytes(length) if kind == "zero" else rng.randbytes(length)
    else:
        out = out[: rng.randrange(len(out))]
    return kind, bytes(out)


def read_everything(path: str) -> str:
    """Everything a user can do with a file; returns 'diagnosis' or 'refused'."""
    try:
        d = engine.diagnose(path)
        for fmt in report.FORMATS:
            report.render(d, fmt)
        outcome = "diagnosis"
    except RunFileError as exc:
        message = str(exc)
        assert path in message and "\n" not in message, f"not one sentence: {message!r}"
        outcome = "refused"
    try:
        report.render_dump(store.inspect(path))
    except RunFileError:
        pass
    try:  # what a reader of a large job's rank files reads of each (the fast path)
        found = store.summary.read(path)
        assert found is None or found.steps >= 0
    except RunFileError as exc:
        assert path in str(exc) and "\n" not in str(exc), f"not one sentence: {exc!r}"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        for command in ("diagnose", "dump"):
            code = cli.main([command, path])
            assert code in (0, 2), f"ampdoctor {command} exited {code}"
    return outcome


def in_child(fn, *args, timeout: float = 20.0) -> tuple[str, str]:
    """Run ``fn(*args)`` in a forked child: ('ok', result) or ('crash'|'hang'|'error', why)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            result, code = str(fn(*args)), 0
        except BaseException:  # noqa: BLE001 - reported to the parent
            result, code = traceback.format_exc(limit=6), 3
        os.write(w, result.encode()[-8000:])
        os._exit(code)
    os.close(w)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return "hang", f"no answer in {timeout:.0f} s"
        time.sleep(0.002)
    text = os.read(r, 1 << 16).decode(errors="replace")
    os.close(r)
    if os.WIFSIGNALED(status):
        return "crash", f"killed by signal {os.WTERMSIG(status)}"
    return ("ok" if os.WEXITSTATUS(status) == 0 else "error"), text


def fuzz(out: str, n: int, seed: int, bases: list[str]) -> dict:
    rng = random.Random(seed)
    originals = [open(b, "rb").read() for b in bases]
    counts: dict[str, int] = {}
    failures = []
    for i in range(n):
        k = i % len(bases)
        kind, data = mutate(originals[k], rng)
        path = os.path.join(out, f"case{i}.h5")
        with open(path, "wb") as fh:
            fh.write(data)
        status, detail = in_child(read_everything, path)
        key = detail if status == "ok" else status
        counts[key] = counts.get(key, 0) + 1
        if status != "ok":
            keep = os.path.join(out, f"failure{i}.h5")
            os.replace(path, keep)
            failures.append({"case": i, "base": bases[k], "mutation": kind, "status": status,
                             "detail": detail, "file": keep})
        else:
            os.remove(path)
    return {"cases": n, "counts": counts, "failures": failures}


if __name__ == "__main__":
    if sys.argv[1] == "killed":
        killed_run(sys.argv[2])
    elif sys.argv[1] == "fuzz":
        result = fuzz(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
        print(json.dumps(result))
