"""The step log: the step being recorded, and the finished steps' /steps and /groups rows until
the drain writes them.

A finished step leaves a ``StepRow``: its host fields, named as the /steps columns they fill,
and its device values (``steps.VALUES``) stacked in one tensor that stays on the device. The
drain (``drain``) reads every pending step's values in one host read per device
(``steps.fetch``: the documented sync of a flush), derives found_inf, skipped and the flags
from them, and writes the rows; it runs about once a second (``flush_seconds``), before a
forensic replay, at close, and at the five steps at most that the flat-loss watch asks for
(``flatloss.FlatLoss``, which then takes the losses just read).

Example (what the recorder's hooks do at a step boundary)::

    log.finish(log.step)        # the step's row and its param groups' rows, no host read
    if log.due(time.perf_counter()):
        log.drain()
    log.begin(log.step.index + 1)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from ..runfile import schema
from ..runfile.schema import Event, flag
from . import readback
from .apply import lrfactors
from .environment import peak_memory
from .flatloss import FlatLoss
from .journal import Journal
from .objectives import Parts
from .steps import VALUES, Constants, Step, columns, device_values, fetch_all
from .watched import Watched


@dataclass
class StepRow:
    """A finished step, until the drain: the /steps fields known on the host, by name, and
    the device values (``steps.VALUES`` order), not read yet."""

    step: int
    time: float
    dt: Any  # a StepClock mark: seconds on CPU, a CUDA event span read at the drain
    loss_dtype: int
    micro: int
    sampled: int
    flags: int
    skipped: int  # 1: neither scaled nor stepped (a scaled step's is decided at the drain)
    lr: float  # the largest of the param groups'
    has_loss: bool
    has_grad: bool
    values: torch.Tensor
    parts: Optional[Parts] = None  # several losses or optimizers (objectives.py)


HOST_FIELDS = ("step", "time", "loss_dtype", "micro", "sampled", "flags", "skipped", "lr")


class StepLog:
    """The current step (``step``) and the rows of those finished, until the drain."""

    def __init__(self, journal: Journal, watched: Watched, flush_seconds: float):
        self.journal = journal
        self.watched = watched
        self.flush_seconds = flush_seconds
        self.step = Step(index=0, t0=time.time())
        self.steps = 0  # steps ended
        self.pending: list[StepRow] = []
        self.latest: Optional[StepRow] = None  # the last step ended (forensics' history)
        self.constants = Constants()
        self.flush_now = False  # a forensic replay ran in this step: drain at its end
        self._groups: list[tuple] = []
        self._clock = readback.StepClock(None)
        self._last_flush = 0.0
        # the loss as a drain reads it, watched for a loss that stopped falling (the hooks set
        # it where the flat-loss probe runs: flatloss.FlatLoss)
        self.flat: Optional[FlatLoss] = None

    def open(self, device: Optional[torch.device]) -> None:
        """Recording begins: the clock starts, on the model's device if it is known."""
        self._last_flush = time.perf_counter()
        self._clock = readback.StepClock(device)

    def follow(self, device: Optional[torch.device]) -> None:
        """The model was discovered (or changed): step times come from its device."""
        if self._clock.device != device:
            self._clock = readback.StepClock(device)

    def begin(self, index: int) -> Step:
        self.step = Step(index=index, t0=time.time())
        self.flush_now = False
        return self.step

    def finish(self, st: Step, parts: Optional[Parts] = None) -> None:
        """The step has ended: its /groups rows and its /steps row, pending (no host read);
        ``parts``: its /losses and /optimizers rows' values, as ``objectives`` gave them."""
        lrs = self._write_groups(st.index)
        # The step time is a CUDA event span on CUDA, and the peak memory is read at the drain.
        self.latest = StepRow(
            step=st.index, time=time.time(), dt=self._clock.mark(), loss_dtype=st.loss_dtype,
            micro=st.micro, sampled=int(st.sampled), flags=st.flags,
            skipped=0 if st.stepped or st.scaled else 1, lr=max(lrs) if lrs else math.nan,
            has_loss=st.loss_sum is not None, has_grad=st.grad_norm is not None,
            values=device_values(st, self.constants), parts=parts)
        self.pending.append(self.latest)
        self.steps = st.index + 1

    def due(self, now: float) -> bool:
        """Time to drain (``now``: ``time.perf_counter()`` at the step's end)? Also at the
        few steps the flat-loss watch asks for (``FlatLoss.wants_drain``)."""
        return self.flush_now or now - self._last_flush >= self.flush_seconds or (
            self.flat is not None and self.flat.wants_drain(self.steps))

    def _write_groups(self, step: int) -> list[float]:
        lrs = []
        rows: list[tuple] = []
        for opt in self.watched.optimizers:
            # --apply lr_factor: the LR the step ran with
            for g, lr in zip(opt.param_groups, lrfactors.ran_with(opt)):
                lrs.append(lr)
                wd = g.get("weight_decay", math.nan)
                rows.append((step, len(rows), lr, float(wd) if isinstance(wd, (int, float))
                             else math.nan))
        self._groups.extend(rows)
        return lrs

    def drain(self) -> None:
        """Fetch the pending steps' device values (the documented sync: one read per device)
        and flush the file. Step times (CUDA events) and the peak memory are read here too."""
        w = self.journal.file
        rows = None
        if self.pending:
            # Taken first: an interrupt below can lose these steps but never write them twice.
            pending, self.pending = self.pending, []
            rows, losses, optimizers = self._rows(pending)
            w.append("steps", rows)
            w.append("losses", losses)
            w.append("optimizers", optimizers)
        if self._groups:
            groups, self._groups = self._groups, []
            w.append("groups", np.array(groups, schema.GROUPS))
        w.flush()
        self._last_flush = time.perf_counter()
        if rows is not None and self.flat is not None:
            self._see_losses(rows["loss"])

    def _see_losses(self, losses: np.ndarray) -> None:
        """The flat-loss watch takes the losses just read (host values: no read of its own).
        A failure of its own turns it off, after the rows are safe in the file."""
        flat = self.flat
        try:
            if flat is not None:
                flat.see(losses)
        except Exception as exc:  # noqa: BLE001 - the watch steps aside, the recording goes on
            self.flat = None
            if self.journal.strict:
                raise
            self.journal.warn_once("flat_loss", f"the flat-loss watch stopped ({type(exc).__name__}"
                                   f": {exc}); sampled steps come at the interval only")

    def _rows(self, pending: list[StepRow]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The /steps, /losses and /optimizers rows of the pending steps (one host read per
        device for all of their device values)."""
        rows = schema.empty("steps", len(pending))
        for name in HOST_FIELDS:
            rows[name] = [getattr(r, name) for r in pending]
        has_loss = np.array([r.has_loss for r in pending], bool)
        has_grad = np.array([r.has_grad for r in pending], bool)
        parted = [r for r in pending if r.parts is not None]
        read = fetch_all([r.values for r in pending] +
                         [r.parts.values for r in parted if r.parts is not None])
        values = columns(np.array(read[:len(pending)]).reshape(len(pending), len(VALUES)))
        losses, optimizers = _part_rows(parted, read[len(pending):],
                                        dict(zip(rows["step"], values["loss_mean"])))
        rows["dt"] = readback.StepClock.seconds([r.dt for r in pending])
        rows["peak_mem"] = peak_memory(self.watched.device)  # never reset: the run's peak so far
        rows["loss"] = values["loss_mean"]
        for name in ("scale", "scale_after", "grad_norm", "clip_norm"):
            rows[name] = values[name]
        found = values["found_inf"]
        rows["found_inf"] = np.where(np.isnan(found), -1, found > 0)
        with np.errstate(invalid="ignore"):
            by_scale = rows["scale_after"] < rows["scale"]
        skipped = np.where(rows["found_inf"] >= 0, rows["found_inf"] == 1, by_scale)
        scaled = ~np.isnan(rows["scale"])
        rows["skipped"] = np.where(scaled, skipped, rows["skipped"])
        with np.errstate(invalid="ignore"):
            own = values["own_found_inf"] > 0
        rows["flags"] |= (np.where(rows["skipped"] == 1, flag(Event.SKIPPED), 0)
                          | np.where(has_loss & ~np.isfinite(values["loss_mean"]),
                                     flag(Event.NONFINITE_LOSS), 0)
                          | np.where(has_grad & ~np.isfinite(values["grad_norm"]),
                                     flag(Event.NONFINITE_GRAD), 0)
                          | np.where(own, flag(Event.OWN_NONFINITE_GRAD), 0)  # NaN: unmeasured
                          ).astype(np.int32)
        return rows, losses, optimizers


def _part_rows(parted: list[StepRow], read: list[np.ndarray],
               step_loss: dict) -> tuple[np.ndarray, np.ndarray]:
    """/losses and /optimizers rows of the steps that have them (``read``: each one's values
    as fetched: its losses, then its optimizers' gradient norms, then their found_inf;
    ``step_loss``: each step's /steps loss, for a step whose one loss is the step's)."""
    losses, optimizers = [], []
    for r, got in zip(parted, read):
        p = r.parts
        if p is None:
            continue
        n, k = len(p.slots), len(p.optimizers)
        part = schema.empty("losses", n)
        part["step"], part["slot"], part["micro"] = r.step, p.slots, p.micro
        part["loss"] = [step_loss[r.step]] if p.step_loss else got[:n]
        losses.append(part)
        part = schema.empty("optimizers", k)
        part["step"], part["optimizer"] = r.step, p.optimizers
        part["lr"], part["stepped"] = p.lr, p.stepped
        part["grad_norm"] = got[n:n + k]
        found = got[n + k:n + 2 * k]
        part["found_inf"] = np.where(np.isnan(found), -1, found > 0)
        optimizers.append(part)
    return (np.concatenate(losses) if losses else schema.empty("losses"),
            np.concatenate(optimizers) if optimizers else schema.empty("optimizers"))
