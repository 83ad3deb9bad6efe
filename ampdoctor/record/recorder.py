"""The in-process recorder: ``watch()`` and what ``ampdoctor record`` starts in a child process.

Tiers (see docs/design.md):

1. **Sentinel, every step.** Loss (seen where backward starts, or at ``GradScaler.scale``),
   loss scale before and after ``update``, found_inf/skipped, LR of each group, global grad
   norm (unscaled, before clipping), step time (CUDA events on a GPU) and peak memory (read at
   the flush). Device values are stacked into one small tensor per step and fetched together
   at the next flush: one host read per device per flush. While forensic replays remain, the
   step's failure must be seen while its parameters are still in place: with a GradScaler,
   found_inf and the loss reach host mirrors by non-blocking copy (no sync of ours: see
   ``skips.py``, whose docstring lists every sync of a steady step); without one, one read of
   the loss and the grad norm before ``optimizer.step``.
2. **Sampled, every N steps.** ``sampler.Sampler``: per-module output and grad_output stats,
   per-parameter grad stats in scaled space, weight norms, update ratios, buffers, the batch.
   Module hooks exist only on these steps; sentinel steps run no Python per module.
3. **Forensic, on the event.** ``forensics.Forensics`` replays the failing micro-batch.

``Recorder`` is the facade: the settings, the lifecycle (``start``, ``flush``, ``close``),
what the user asks of a recording (``diagnose``, ``events``, ``replay``), and what happens when
ampdoctor itself fails (``fault``: save what can be saved, warn once, step aside). The work is
done by its parts, one module each:

========================  ===================================================================
``journal.Journal``       the run file and the rows every part adds (/events, /tensors, /meta);
                          the warnings, each once
``watched.Watched``       the model (given or discovered), optimizers, scaler, autocast state
``hooks.Hooks``           the hook callbacks, in groups (``stepflow``: the step boundaries)
``steplog.StepLog``       the step being recorded; finished steps' rows until the drain
``skips.Skips``           the skip decision and its syncs; the forensic tier's trigger
``forensics.Forensics``   tier 3: capture, replay, snapshot
``exits.ExitGuard``       SIGTERM, the interpreter's exit, a fork
========================  ===================================================================

Example::

    rec = Recorder(model, optimizer, scaler, RecorderConfig(path="run.h5")).start()  # watch()
    ...train...
    rec.close()
    rec.diagnose()
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from ..errors import AmpDoctorError, RecorderFault
from ..runfile import schema
from ..runfile.meta import AppliedFix
from ..runfile.schema import Event
from ..version import __version__
from . import exits, stats
from .exits import active
from .forensic.forensics import Forensics
from .forensic.fp8trial import BUDGET_SECONDS, TrialAtClose
from .hooks import Hooks
from .journal import Journal
from .sampler import Sampler
from .skips import Skips
from .steplog import StepLog
from .watched import Watched

DEFAULT_EVERY = 100  # sampled-tier interval; see benchmarks/overhead.py and docs/performance.md
FLUSH_SECONDS = 1.0  # at most this much recorded time is lost to a SIGKILL

__all__ = ["DEFAULT_EVERY", "FLUSH_SECONDS", "Recorder", "RecorderConfig", "active"]


@dataclass(frozen=True)
class RecorderConfig:
    """How a ``Recorder`` records: ``watch()``'s options, one field each.

    path: the run file to write (overwritten), or a function of (rank, world_size) that
        names it, called when the file is created.
    lazy: create the file only once training begins (the first backward, scaled loss or
        optimizer step); until then rows wait in memory, and ``close()`` of a recorder that
        never saw training writes nothing unless ``keep_empty=True``. This is what
        ``ampdoctor record`` uses, so that DataLoader workers leave no files, and so that
        the rank is read from ``torch.distributed`` once the process group exists.
    every: the sampled tier's interval in steps (default ``DEFAULT_EVERY``; 0 = never).
    forensics: replay a failing step to find the culprit (tier 3).
    max_replays: forensic replays per run. Events in one episode (a run of close bad
        steps) are replayed at the 1st, 2nd, 4th, 8th... event only, so a run that skips
        every step does not crawl; after the last replay the tier costs nothing.
    flush_seconds: the longest time between two flushes to the file.
    sample: elements gathered per tensor for range counts in the sampled tier.
    op_probe: on sampled steps, look at every op inside the model's forward for inf/NaN
        that never reaches a module's output (``opprobe.StepProbe``; not inside
        ``torch.compile`` regions nor on sharded models). Off: the sampled step costs
        what it did before (``benchmarks/probe_cost.py`` measures the difference).
    fp8: on sampled steps, what each fp8 recipe would do to every Linear's input, weight
        and output gradient (``fp8.Fp8Probe``, the /fp8 table; docs/fp8.md). Off: the
        sampled step costs what it did before (``benchmarks/fp8_cost.py``).
    fp8_trial: seconds for the fp8 trial at close (``forensic/fp8trial.py``): the last
        sampled step re-run with each Linear in emulated fp8, alone and together, to say
        which to keep in bf16 (needs ``fp8`` and ``forensics``; 0: off).
    strict: raise ``RecorderFault`` on an internal failure instead of stepping aside.
    rank, world_size: for distributed runs (read from the environment when None).
    replaceable: a recorder started later closes this one instead of failing (what
        ``ampdoctor record`` uses, so that a script calling ``watch()`` itself still works).
    """

    path: Union[str, os.PathLike, Callable[[int, int], str]] = "run.h5"
    every: Optional[int] = None
    forensics: bool = True
    lazy: bool = False
    max_replays: int = 8
    flush_seconds: float = FLUSH_SECONDS
    sample: int = stats.SAMPLE
    strict: bool = False
    rank: Optional[int] = None
    world_size: Optional[int] = None
    argv: Optional[list[str]] = None
    replaceable: bool = False
    op_probe: bool = True
    fp8: bool = True
    fp8_trial: float = BUDGET_SECONDS

    def interval(self) -> int:
        """``every``, checked: the sampled tier's interval (``DEFAULT_EVERY`` when None)."""
        try:
            every = DEFAULT_EVERY if self.every is None else int(self.every)
        except (TypeError, ValueError):
            raise AmpDoctorError(f"every must be 0 (never) or a positive step count, not "
                                 f"{self.every!r}") from None
        if every < 0:
            raise AmpDoctorError(f"every must be 0 (never) or a positive step count, not "
                                 f"{self.every}")
        return every


class Recorder:
    """Records a training loop into an ampdoctor run file.

    Args:
        model: the model (or a list of root modules). None: discovered as the outermost
            modules called in the first step that own trained parameters.
        optimizer: an optimizer or a list. None: every optimizer that steps the model's
            parameters (or any optimizer, when the model is discovered too).
        scaler: the ``GradScaler``. None: the first enabled scaler that scales a loss.
        config: how it records (``RecorderConfig``: the file, the tiers, strict mode...).
    """

    def __init__(self, model: Any = None, optimizer: Any = None, scaler: Any = None,
                 config: RecorderConfig = RecorderConfig()):
        self.config = config
        self.every = config.interval()
        self.strict = config.strict
        self.replaceable = config.replaceable
        self.active = False
        self.closed = False
        self.faulted = False
        # told (why, steps kept) when a fault stops the recording: ``record`` hears of a full
        # disk this way, which the file itself cannot hold (child.py)
        self.on_stop: Optional[Callable[[str, int], None]] = None
        rank, world = config.rank, config.world_size
        self._journal = Journal(
            config.path, rank=int(os.environ.get("RANK", 0)) if rank is None else rank,
            world_size=int(os.environ.get("WORLD_SIZE", 1)) if world is None else world,
            argv=config.argv, strict=config.strict)
        self._watched = Watched(model, optimizer, scaler, journal=self._journal,
                                forensics=config.forensics)
        self._log = StepLog(self._journal, self._watched, config.flush_seconds)
        self.forensics = Forensics(self._watched, self._journal, self._log,
                                   max_replays=config.max_replays, strict=config.strict) \
            if config.forensics else None
        self._sampler = Sampler(self._watched.names, self._journal.tensor_id,
                                self._journal.warn_tensor, sample=config.sample,
                                fp8=config.fp8) if self.every else None
        if self._sampler is not None and self._sampler.fp8 is not None:
            self._sampler.fp8.replicas = self._watched.replicas
        self._skips = Skips(self._journal, self._watched, self._log, self.forensics)
        self._hooks = Hooks(self._journal, self._watched, self._log, self._skips,
                            sampler=self._sampler, forensics=self.forensics, every=self.every,
                            fault=self.fault, op_probe=config.op_probe)
        self._exits = exits.ExitGuard(self)
        trial = config.fp8_trial
        self._fp8_trial = TrialAtClose(self.forensics, self._journal.tensor_id, trial) \
            if config.fp8 and trial > 0 and self._sampler is not None and self.forensics else None
        self._hooks.fp8_trial = self._fp8_trial

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> "Recorder":
        current = active()
        if current is not None and not current.closed and current.replaceable:
            current.close()  # ampdoctor record's own recorder yields to the script's watch()
        if current is not None and not current.closed:
            raise AmpDoctorError(
                f"ampdoctor is already recording into {current.path}; close that recorder first")
        try:
            self._journal.open(self.config.lazy)
            exits.hold(self)
            self.active = True
            self._exits.catch()
            self._write_start_meta()
            self._hooks.attach()
            self._journal.file.flush()
        except BaseException as exc:
            self._undo_start(exc)
            raise
        return self

    def _undo_start(self, exc: BaseException) -> None:
        """A start that failed leaves nothing armed: every patch and hook removed, the
        process free to record again, the file (if made) closed with the failure as its
        status."""
        try:
            self.close(f"{schema.STATUS_EXCEPTION}{type(exc).__name__}")
        except Exception:  # noqa: BLE001 - the first failure is the one to report
            self.closed, self.active = True, False
            self._detach()
            exits.let_go(self)
            self._exits.release()

    def close(self, status: str = schema.STATUS_FINISHED, *, keep_empty: bool = False) -> None:
        """Stop recording, put back every hook and patch, and finish the file. Idempotent.

        ``keep_empty``: a lazy recorder that never saw training still writes its (stepless)
        file, so that ``diagnose`` can say the script never trained.
        """
        if self.closed:
            return
        try:
            if self.active:
                self._hooks.wind_up()  # the step in progress ends; a skip in flight is decided
                if status == schema.STATUS_FINISHED and self.active:
                    self._run_fp8_trial()
        finally:  # closed even when that raised (strict mode): never left half-attached
            self.closed = True
            self.active = False
            self._detach()
            exits.let_go(self)
            try:
                self._finish(status, keep_empty)
            finally:
                self._exits.release()  # only now: a SIGTERM during close still waits for it

    def _run_fp8_trial(self) -> None:
        """The fp8 trial on the last sampled step kept (a run that finished only), its
        result one /events row; a failure in it is the trial's, never the run's."""
        trial, self._fp8_trial = self._fp8_trial, None
        if trial is None or not self._journal.open_for_rows:
            return
        try:
            result = trial.run(self._log.steps - 1)
            if result is not None:
                self._journal.event(Event.FP8_TRIAL, None, value=float(result.runs or 0),
                                    text=result.to_text())
        except Exception as exc:  # noqa: BLE001
            if self.strict:
                raise
            self._journal.warn_once("fp8_trial", f"the fp8 trial stopped ({type(exc).__name__}:"
                                    f" {exc})")

    def _finish(self, status: str, keep_empty: bool) -> None:
        w = self._journal.writer
        if w is None or w.closed:
            return
        status = self._exits.status(status)
        try:
            if keep_empty and not w.created:
                self._journal.create()
            self._log.drain()
            w.close(status)
        except Exception as exc:  # noqa: BLE001
            w.abandon()
            self._journal.warn_once("close", self._journal.lost(exc, "close"))
            self._tell_stop(exc, "close")
            if self.strict:
                raise RecorderFault(str(exc)) from exc

    def _detach(self) -> None:
        self._hooks.detach()
        self._skips.undecided = None  # (close decides it first; a fault or a fork drops it)
        if self.forensics is not None:
            self.forensics.capture.release_held()

    def disown(self) -> None:
        """This is a forked child's copy (a DataLoader worker, see ``exits``): it records
        nothing and can never write into the parent's file (``store.Writer.disown``)."""
        self.closed = True
        self.active = False
        try:
            self._detach()
        finally:
            if self._journal.writer is not None:
                self._journal.writer.disown()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.record_exception(exc_type, exc)
            self.close(schema.STATUS_EXCEPTION + exc_type.__name__)

    @property
    def path(self) -> str:
        """The run file (empty until a lazy recorder's file is named)."""
        return self._journal.path

    @property
    def rank(self) -> int:
        return self._journal.rank

    @property
    def world_size(self) -> int:
        return self._journal.world_size

    @property
    def trained(self) -> bool:
        """Has training begun (and, for a lazy recorder, the file been created)?"""
        return self._journal.created

    @property
    def steps(self) -> int:
        """Steps recorded so far."""
        return self._log.steps

    @property
    def replays(self) -> int:
        """Forensic replays run so far (each wrote a snapshot)."""
        return self.forensics.replays if self.forensics is not None else 0

    def note_applied(self, applied: list[AppliedFix]) -> None:
        """``record --apply``: the fixes the treatment applied, into /meta ``applied``."""
        if self._journal.open_for_rows:
            try:
                self._journal.meta("applied", applied, self._log.step.index)
            except Exception as exc:  # noqa: BLE001
                self.fault(exc, "note_applied")

    def record_exception(self, exc_type: Any, exc: Any) -> None:
        if self._journal.open_for_rows:
            self._journal.event(Event.EXCEPTION, self._log.step,
                                text=f"{exc_type.__name__}: {exc}"[:2000])

    def flush(self) -> None:
        """Write everything recorded so far to the file (the training loop may go on)."""
        if self.active and self._journal.writer is not None:
            try:
                self._log.drain()
            except Exception as exc:  # noqa: BLE001
                self.fault(exc, "flush")

    def diagnose(self, **options: Any) -> Any:
        """Diagnose what was recorded so far (same result as ``ampdoctor diagnose <path>``)."""
        from ..diagnosis.engine import diagnose

        if not self.closed:
            self.flush()
        return diagnose(self.path, **options)

    # -- fault handling: a debugger must never break the training run it watches --------------

    def fault(self, exc: BaseException, where: str) -> None:
        """An internal failure: save what can be saved, warn once, step aside for good."""
        if self.strict:
            raise RecorderFault(f"{where}: {type(exc).__name__}: {exc}") from exc
        if self.faulted:
            return
        self.faulted = True
        self._detach()
        self.active = False
        self._save_after_fault(exc, where)
        self._journal.warn_once("fault", self._journal.lost(exc, where))
        self._tell_stop(exc, where)

    def _tell_stop(self, exc: BaseException, where: str) -> None:
        """``on_stop``, if set, hears why the recording stopped and what the file keeps."""
        if self.on_stop is None:
            return
        what, kept = self._journal.stopped(exc, where)
        try:
            self.on_stop(what, kept or 0)
        except Exception:  # noqa: BLE001 - telling is a courtesy, never a failure
            pass

    def _save_after_fault(self, exc: BaseException, where: str) -> None:
        """Steps already taken, and a RECORDER_ERROR event, reach the file if it still works."""
        w = self._journal.writer
        if w is None or w.closed:
            return
        try:
            self._journal.event(Event.RECORDER_ERROR, self._log.step,
                                text=f"{where}: {type(exc).__name__}: {exc}"[:2000])
            self._log.drain()
        except Exception:  # noqa: BLE001 - the file itself may be what failed
            try:
                w.flush()
            except Exception:  # noqa: BLE001
                w.abandon()

    def _write_start_meta(self) -> None:
        meta = self._journal.meta
        meta("status", schema.STATUS_RUNNING)
        c = self.config
        meta("recorder", {"every": self.every, "sample": c.sample, "op_probe": c.op_probe,
                          "fp8": c.fp8,
                          "forensics": c.forensics, "max_replays": c.max_replays,
                          "flush_seconds": c.flush_seconds, "version": __version__,
                          "given": self._watched.given})
        meta("torch", {"version": torch.__version__,
                       "cuda": getattr(torch.version, "cuda", None),
                       "threads": torch.get_num_threads()})

    # -- what the forensic tier caught ---------------------------------------------------------

    @property
    def events(self) -> list:
        """What the forensic tier caught, as ``forensics.ForensicEvent`` (step, trigger,
        phase, module, fp32 verdict); empty with ``forensics=False``."""
        return list(self.forensics.events) if self.forensics is not None else []

    def replay(self, step: int) -> Any:
        """Re-run a replayed event's micro-batches, instrumented; a ``ReplayResult``.

        Runs against the model's current weights with the batch, RNG state and output
        gradient kept from the event; ``result.faithful`` says whether the weights are still
        those of the event. Works after the recorder is closed; writes nothing to the file.
        """
        if self.forensics is None:
            raise AmpDoctorError("this recorder was started with forensics=False: "
                                 "nothing was captured to replay")
        return self.forensics.replay(step)
