"""The /events and /snapshots tables read, for the rules: the events of a kind, where and why
ampdoctor stopped recording, the script's exception, the forensic replays (their detail
parsed), the sampled steps' op probe findings, the steps sampled because the loss had stopped
falling, a replay's saved batch. ``EventViews`` is a base of ``facts.Facts``; the functions
read a run without it (``ranks``, ``forecast``).

Example::

    recording_stopped(ampdoctor.load("run.h5"))   # None, or {"step": 0, "why": "..."}
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from ..runfile import schema
from ..runfile.payloads import FlatLossProbe, HiddenNonfinite, SnapshotDetail
from ..runfile.run import one_line
from ..runfile.schema import Event, Phase
from .tensors import TensorViews

PHASES = {Phase.FORWARD: "forward", Phase.BACKWARD: "backward", Phase.INPUT: "input",
          Phase.LOSS: "loss", Phase.OPTIMIZER: "optimizer", Phase.NONE: "none",
          Phase.UNKNOWN: "unknown"}


class EventViews(TensorViews):
    """The /events and /snapshots tables of a run, each view computed on first use."""

    def events(self, kind: Event) -> np.ndarray:
        ev = self.run.events
        return ev[ev["kind"] == int(kind)]

    @property
    def stopped(self) -> Optional[dict]:
        """Where and why ampdoctor stopped recording (an internal fault), or None."""
        return recording_stopped(self.run)

    @property
    def exception(self) -> Optional[tuple[str, str]]:
        """(type, message) of the exception the training script raised, if any."""
        rows = self.events(Event.EXCEPTION)
        status = self.run.status
        if len(rows):
            # one line: a message is quoted inside a sentence (a traceback's lines would start
            # lines of their own in a diagnosis)
            text = one_line(str(rows["text"][-1]))
            typ, _, msg = text.partition(": ")
            return typ, msg
        if status.startswith(schema.STATUS_EXCEPTION):
            return status.split(":", 1)[1], ""
        return None

    @property
    def snapshots(self) -> list[dict]:
        """Forensic replays, oldest first, as dicts (detail JSON parsed)."""
        def build():
            out = []
            for s in self.run.snapshots:
                detail = SnapshotDetail.from_text(s["detail"])
                out.append({"id": int(s["id"]), "step": int(s["step"]),
                            "phase": _phase_name(int(s["phase"])),
                            "module": str(s["module"]) or None,
                            "module_type": str(s["module_type"]) or None,
                            "fp32_finite": int(s["fp32_finite"]),
                            "fp32_absmax": float(s["fp32_absmax"]),
                            "in_absmax": float(s["in_absmax"]),
                            "out_absmax": float(s["out_absmax"]),
                            "scale": float(s["scale"]), "lr": float(s["lr"]),
                            "trigger": int(s["trigger"]), "detail": detail})
            return out
        return self.memo("snapshots", build)

    @property
    def hidden_nonfinite(self) -> list[dict]:
        """The sampled steps' op probe findings (``hidden_nonfinite``)."""
        return self.memo("hidden", lambda: hidden_nonfinite(self.run))

    @property
    def flat_probes(self) -> dict[int, dict]:
        """Steps sampled because the loss had not fallen (``flat_probes``)."""
        return self.memo("flat_probes", lambda: flat_probes(self.run))

    def batch_absmax(self, snapshot_id: int) -> tuple[float, bool]:
        """Largest finite magnitude in a snapshot's saved float batch, and whether it held
        NaN/inf. Only the batch ("args.*", "kwargs.*"): not the culprit's own inputs, the
        output gradient or the RNG state saved beside it."""
        arrays = self.run.arrays
        rows = np.flatnonzero(arrays["snapshot"] == snapshot_id)
        biggest, bad = math.nan, False
        for r in rows:
            name = str(arrays["name"][r])
            if not name.startswith(("args.", "kwargs.")):
                continue
            try:
                a = self.run.array(int(r))
            except Exception:  # noqa: BLE001 - a damaged array must not stop the diagnosis
                continue
            if a.dtype.kind != "f" or not a.size:
                continue
            fin = np.isfinite(a)
            bad = bad or not bool(fin.all())
            if fin.any():
                m = float(np.abs(a[fin]).max())
                biggest = m if math.isnan(biggest) else max(biggest, m)
        return biggest, bad


def recording_stopped(run: Any) -> Optional[dict]:
    """``{"step", "why"}`` when ampdoctor stepped aside after an internal fault (its
    RECORDER_ERROR event): the file holds the steps before ``step`` and nothing after.

    Example::

        recording_stopped(ampdoctor.load("run.h5"))
        # {'step': 0, 'why': "before_clip: RuntimeError: aten.take.default got mixed ..."}
    """
    ev = run.events
    rows = ev[ev["kind"] == int(Event.RECORDER_ERROR)]
    if not len(rows):
        return None
    return {"step": int(rows["step"][0]), "why": one_line(str(rows["text"][0]))}


def hidden_nonfinite(run: Any) -> list[dict]:
    """The sampled steps' op probe findings (``Event.HIDDEN_NONFINITE``: a module whose output
    stayed finite although an op inside it made inf/NaN), in step and execution order:
    {"step", "module", "type", "tensor", "created" (bits 1 NaN, 2 +inf, 4 -inf), "op",
    "dtype", "inner", "index", "ops"}.

    Example::

        hidden_nonfinite(ampdoctor.load("run.h5"))[0]["op"]     # 'mul'
    """
    ev, t = run.events, run.tensors
    found = ev[ev["kind"] == int(Event.HIDDEN_NONFINITE)]
    if not len(found):  # (no name table to build: 10^5 modules are 466 664 tensors)
        return []
    names = {int(i): str(n) for i, n in zip(t["id"], t["name"])}
    types = {int(i): str(c) for i, c in zip(t["id"], t["type"])}
    out = []
    for row in found:
        detail = HiddenNonfinite.from_text(str(row["text"]))
        tid = int(row["tensor"])
        value = float(row["value"])
        out.append({"step": int(row["step"]), "module": names.get(tid) or None,
                    "type": types.get(tid) or None, "tensor": tid,
                    "created": int(value) if math.isfinite(value) else 0,
                    "op": detail.op, "dtype": detail.dtype,
                    "inner": detail.inner or names.get(tid),
                    "index": detail.index, "ops": detail.ops})
    return sorted(out, key=lambda h: (h["step"], h["index"]))


def flat_probes(run: Any) -> dict[int, dict]:
    """The steps the recorder sampled (op probe included) because the loss had not fallen for
    a while (``Event.FLAT_LOSS_PROBE``, ``record/flatloss.py``), by step: {"start", "recent"
    (the loss's median at the start and over the last ten steps), "flat_steps", "probe"}.

    Example::

        flat_probes(ampdoctor.load("run.h5"))   # {29: {'start': 1.43, 'recent': 2.08, ...}}
    """
    ev = run.events
    out = {}
    for row in ev[ev["kind"] == int(Event.FLAT_LOSS_PROBE)]:
        detail = FlatLossProbe.from_text(str(row["text"]))
        out[int(row["step"])] = {"start": float(detail.start), "recent": float(detail.recent),
                                 "flat_steps": detail.flat_steps, "probe": detail.probe}
    return out


def _phase_name(code: int) -> str:
    try:
        return PHASES[Phase(code)]
    except ValueError:
        return "unknown"
