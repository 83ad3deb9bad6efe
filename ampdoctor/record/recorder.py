"""The in-process recorder: ``watch()`` and what ``ampdoctor record`` starts in a child process.

Tiers (see the README's design section):

1. **Sentinel, every step.** Loss (seen where backward starts, or at ``GradScaler.scale``),
   loss scale before and after ``update``, found_inf/skipped, LR of each group, global grad
   norm (unscaled, before clipping), step time (CUDA events on a GPU) and peak memory (read at
   the flush). Device values are stacked into one small tensor per step and fetched together
   at the next flush: one host read per device per flush. While forensic replays remain, the
   step's failure must be seen while its parameters are still in place: with a GradScaler,
   found_inf and the loss reach host mirrors by non-blocking copy (no sync of ours: see
   "The syncs of a steady step" below ``after_update``); without one, one read of the loss
   and the grad norm before ``optimizer.step``.
2. **Sampled, every N steps.** ``sampler.Sampler``: per-module output and grad_output stats,
   per-parameter grad stats in scaled space, weight norms, update ratios, buffers, the batch.
   Module hooks exist only on these steps; sentinel steps run no Python per module.
3. **Forensic, on the event.** ``forensics.Forensics`` replays the failing micro-batch.

Step boundaries: ``GradScaler.update`` when an enabled scaler scaled the loss this step (a
skipped step never calls ``optimizer.step``), else the step of the first optimizer seen.
Gradient accumulation: a step is an optimizer step; backward calls count micro-batches.
"""

from __future__ import annotations

import atexit
import math
import os
import signal
import sys
import threading
import time
import warnings
from typing import Any, Callable, Optional, Union

import numpy as np
import torch

from ..errors import AmpDoctorError, RecorderFault
from ..runfile import schema, store
from ..runfile.schema import Event, Kind, flag
from ..version import __version__
from . import amp_state, compiled, patches, readback, sharding, stats
from .environment import device_info, model_summary, optimizer_info, peak_memory, scaler_info
from .sampler import Sampler
from .steps import HOST, Constants, Step, device_values, fetch
from .torchcompat import is_wrapper, scaler_enabled, unscaled_already, unwrap

DEFAULT_EVERY = 100  # sampled-tier interval; see benchmarks/overhead.py and the README curve
FLUSH_SECONDS = 1.0  # at most this much recorded time is lost to a SIGKILL
STOP_SIGNALS = ("SIGTERM",)  # finish the file, then let the signal do what it did before
SIGNAL_PATIENCE = 10.0  # seconds a stop signal may wait for a write in progress to end

_ACTIVE: Optional["Recorder"] = None


class ForensicsHandle:
    """What the forensic tier may see of its recorder: settings, the state of the step being
    recorded, and the few calls it makes (write rows, name tensors, warn). Forensics gets this,
    not the Recorder, so that the recorder's internals stay its own.

    Example::

        Forensics(ForensicsHandle(recorder))
    """

    def __init__(self, rec: "Recorder") -> None:
        self._rec = rec

    # settings and the model, as given
    strict = property(lambda self: self._rec.strict)
    max_replays = property(lambda self: self._rec.max_replays)
    replays = property(lambda self: self._rec.replays)
    roots = property(lambda self: self._rec.roots)
    names = property(lambda self: self._rec.names)
    param_names = property(lambda self: self._rec.param_names)
    optimizers = property(lambda self: self._rec.optimizers)
    # state of the recording, read when forensics acts
    device = property(lambda self: self._rec._device)
    sharding = property(lambda self: self._rec._sharding)
    step = property(lambda self: self._rec._step)
    pending = property(lambda self: self._rec._pending)
    autocast_seen = property(lambda self: self._rec._autocast_seen)
    constants = property(lambda self: self._rec._constants)
    writer = property(lambda self: self._rec._writer)

    def trained_params(self) -> list[torch.Tensor]:
        return self._rec._trained_params()

    def tensor_id(self, kind: Kind, name: str, index: int, t: Any, owner_type: str) -> int:
        return self._rec._tensor_id(kind, name, index, t, owner_type)

    def warn_once(self, key: str, message: str) -> None:
        self._rec._warn_once(key, message)

    def event(self, kind: Event, *, text: str = "", step: Optional[Step] = None) -> None:
        """An /events row at ``step`` (a replay's findings: a bad batch, stale gradients)."""
        self._rec._event(kind, text=text, step=step)


class Recorder:
    """Records a training loop into an ampdoctor run file.

    Args:
        model: the model (or a list of root modules). None: discovered as the outermost
            modules called in the first step that own trained parameters.
        optimizer: an optimizer or a list. None: every optimizer that steps the model's
            parameters (or any optimizer, when the model is discovered too).
        scaler: the ``GradScaler``. None: the first enabled scaler that scales a loss.
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
        strict: raise ``RecorderFault`` on an internal failure instead of stepping aside.
        rank, world_size: for distributed runs (read from the environment when None).
        replaceable: a recorder started later closes this one instead of failing (what
            ``ampdoctor record`` uses, so that a script calling ``watch()`` itself still works).
    """

    def __init__(self, model: Any = None, optimizer: Any = None, scaler: Any = None, *,
                 path: Union[str, os.PathLike, Callable[[int, int], str]] = "run.h5",
                 every: Optional[int] = None, forensics: bool = True, lazy: bool = False,
                 max_replays: int = 8, flush_seconds: float = FLUSH_SECONDS,
                 sample: int = stats.SAMPLE, strict: bool = False, rank: Optional[int] = None,
                 world_size: Optional[int] = None, argv: Optional[list[str]] = None,
                 replaceable: bool = False):
        self.every = DEFAULT_EVERY if every is None else int(every)
        if self.every < 0:
            raise AmpDoctorError(f"every must be 0 (never) or a positive step count, not {every}")
        self.forensics_on = forensics
        self.max_replays = max_replays
        self.flush_seconds = flush_seconds
        self.sample = sample
        self.strict = strict
        self.rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        self.world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        self._name = path if callable(path) else (lambda rank, world, p=os.fspath(path): p)  # noqa: B008
        # A function names the file only when it is created: the rank may not be known before.
        self.path = "" if callable(path) else os.fspath(path)
        self.lazy = lazy
        self.replaceable = replaceable
        self._argv = argv
        self.roots: list[torch.nn.Module] = _as_list(model)
        self.optimizers: list[Any] = _as_list(optimizer)
        self.scaler = scaler
        self._given = {"model": bool(self.roots), "optimizer": bool(self.optimizers),
                       "scaler": scaler is not None}
        self.names: dict[torch.nn.Module, str] = {}
        self.param_names: dict[int, str] = {}
        self._clip_config: Optional[dict] = None  # clip_grad_norm_'s arguments, last written
        self._tensor_ids: dict[tuple[int, str, int], int] = {}
        self._writer: Optional[store.Writer] = None
        self._patches = patches.PatchSet()
        self._root_hooks = patches.PatchSet()
        self._sample_hooks = patches.PatchSet()
        self._discovery = patches.PatchSet()
        self._depth = 0
        self._discovering: Optional[torch.nn.Module] = None  # root adopted in this very call
        self._discovery_open = False  # global module hooks looking for roots (first step)
        self._pending: list[tuple[tuple, torch.Tensor]] = []  # host fields, device values
        self._constants = Constants()
        self._pending_groups: list[tuple] = []
        self._last_flush = 0.0
        self._clock = readback.StepClock(None)
        self._pools: dict[torch.device, readback.MirrorPool] = {}
        self._undecided: Optional[Step] = None  # a scaled step whose skip is not known yet
        self._params_key: Optional[tuple] = None  # param_groups the cached list was made from
        self._params: list[torch.Tensor] = []
        self._step: Optional[Step] = None
        self._sampler: Optional[Sampler] = None
        self._autocast_seen: Optional[tuple] = None  # at the root's pre-hook (forensics)
        self._amp: Optional[amp_state.Tracker] = None  # where autocast really runs
        self._autocast_meta: Optional[dict] = None
        self._fp16_noted = False  # FP16_WITHOUT_SCALER written (once per run)
        self._compiled: list[tuple[str, str]] = []  # compiled regions in the roots
        self._eager: Optional[list[torch.nn.Module]] = None  # hookable modules, if compiled
        self._root_ids: set[int] = set()
        self._discovery_hooked = False  # the global discovery hooks are installed
        self._optimizer_meta_done: set[int] = set()
        self._own_optimizer: dict[int, bool] = {}
        self._warned: set[str] = set()
        self._device: Optional[torch.device] = None
        self._sharding: Optional[sharding.Sharding] = None
        self.forensics = None
        self.replays = 0
        self.active = False
        self.closed = False
        self.faulted = False
        self.steps = 0

    # ---------------------------------------------------------------------------------------
    # lifecycle

    def start(self) -> "Recorder":
        global _ACTIVE
        if _ACTIVE is not None and not _ACTIVE.closed and _ACTIVE.replaceable:
            _ACTIVE.close()  # ampdoctor record's own recorder yields to the script's watch()
        if _ACTIVE is not None and not _ACTIVE.closed:
            raise AmpDoctorError(
                f"ampdoctor is already recording into {_ACTIVE.path}; close that recorder first")
        if not self.lazy and not self.path:
            self.path = os.fspath(self._name(self.rank, self.world_size))
        self._writer = store.Writer(self.path, rank=self.rank, world_size=self.world_size,
                                    argv=self._argv, create=not self.lazy)
        _ACTIVE = self
        self.active = True
        self._pid = os.getpid()
        self._catch_exit()
        self._write_start_meta()
        patches.patch_scaler(self._patches, self)
        patches.patch_backward(self._patches, self)
        patches.patch_clip(self._patches, self)
        patches.hook_optimizers(self._patches, self)
        patches.patch_module_compile(self._patches, self)
        if self.roots:
            self._adopt_roots(self.roots)
        else:
            self._discovery.add(compiled.QuietGlobalHookWarning())
            patches.hook_modules(self._discovery, self, "discover_pre", "discover_post",
                                 post_kwargs=True)
            self._discovery_open = self._discovery_hooked = True
        if self.scaler is not None:
            self._adopt_scaler(self.scaler)
        if self.forensics_on:
            from .forensics import Forensics

            self.forensics = Forensics(ForensicsHandle(self))
        self._last_flush = time.perf_counter()
        self._clock = readback.StepClock(self._device)
        self._begin_step(0)
        self._writer.flush()
        return self

    def close(self, status: str = schema.STATUS_FINISHED, *, keep_empty: bool = False) -> None:
        """Stop recording, put back every hook and patch, and finish the file. Idempotent.

        ``keep_empty``: a lazy recorder that never saw training still writes its (stepless)
        file, so that ``diagnose`` can say the script never trained.
        """
        global _ACTIVE
        if self.closed:
            return
        try:
            if self.active and self._step is not None:
                patches.guard(self, "_end_step_without_update")  # its update() never came
                patches.guard(self, "_settle")  # a skip still in flight is decided now
        finally:  # closed even when that raised (strict mode): never left half-attached
            self.closed = True
            self.active = False
            self._detach()
            if _ACTIVE is self:
                _ACTIVE = None
            try:
                self._finish(status, keep_empty)
            finally:
                self._release_exit()  # only now: a SIGTERM during close still waits for it

    def _finish(self, status: str, keep_empty: bool) -> None:
        if self._writer is None or self._writer.closed:
            return
        status = self._status_if_signalled(status)
        try:
            if keep_empty and not self._writer.created:
                self._create_file()
            self._drain()
            self._writer.close(status)
        except Exception as exc:  # noqa: BLE001
            self._writer.abandon()
            self._warn_once("close", self._lost(exc, "close"))
            if self.strict:
                raise RecorderFault(str(exc)) from exc

    def _detach(self) -> None:
        for handles in (self._sample_hooks, self._root_hooks, self._discovery, self._patches):
            handles.remove()
        if self._sampler is not None:
            self._sampler.active = False
        self._undecided = None  # (close decides it first; a fault or a fork drops it)
        if self.forensics is not None:
            self.forensics.release_held()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.record_exception(exc_type, exc)
            self.close(schema.STATUS_EXCEPTION + exc_type.__name__)

    @property
    def trained(self) -> bool:
        """Has training begun (and, for a lazy recorder, the file been created)?"""
        return self._writer is not None and self._writer.created

    def _create_file(self) -> None:
        """Training begins (lazy mode): name the file now that the rank is known, create it."""
        self.rank, self.world_size = _rank_and_world(self.rank, self.world_size)
        self.path = os.fspath(self._name(self.rank, self.world_size))
        self._writer.create(self.path, rank=self.rank, world_size=self.world_size)
        self._writer.flush()

    def record_exception(self, exc_type: Any, exc: Any) -> None:
        if self._writer is not None and not self._writer.closed:
            self._event(Event.EXCEPTION, text=f"{exc_type.__name__}: {exc}"[:2000])

    def flush(self) -> None:
        """Write everything recorded so far to the file (the training loop may go on)."""
        if self.active and self._writer is not None:
            try:
                self._drain()
            except Exception as exc:  # noqa: BLE001
                self.fault(exc, "flush")

    def diagnose(self, **options: Any):
        """Diagnose what was recorded so far (same result as ``ampdoctor diagnose <path>``)."""
        from ..diagnosis.engine import diagnose

        if not self.closed:
            self.flush()
        return diagnose(self.path, **options)

    # ---------------------------------------------------------------------------------------
    # fault handling: a debugger must never break the training run it watches

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
        self._warn_once("fault", self._lost(exc, where))

    def _save_after_fault(self, exc: BaseException, where: str) -> None:
        """Steps already taken, and a RECORDER_ERROR event, reach the file if it still works."""
        w = self._writer
        if w is None or w.closed:
            return
        try:
            self._event(Event.RECORDER_ERROR, text=f"{where}: {type(exc).__name__}: {exc}"[:2000])
            self._drain()
        except Exception:  # noqa: BLE001 - the file itself may be what failed
            try:
                w.flush()
            except Exception:  # noqa: BLE001
                w.abandon()

    def _lost(self, exc: BaseException, where: str) -> str:
        """The warning after a failure: what happened, and what the file does and does not hold."""
        w = self._writer
        kept = w.committed["steps"] if w is not None else 0
        if isinstance(exc, FileNotFoundError) and "deleted" in str(exc):
            return (f"{self.path} was deleted while recording (its directory removed?): "
                    "recording stopped and what the file held is gone; training continues")
        if isinstance(exc, OSError):
            what = f"could not write {self.path} ({store._reason(exc)})"
        else:
            what = f"internal error in {where} ({type(exc).__name__}: {exc})"
        held = f"steps 0-{kept - 1}" if kept else "no step"
        return f"{what}; recording stopped, {self.path} keeps {held}; training continues"

    def warn_tensor(self, what: str, exc: BaseException) -> None:
        """A tensor that could not be measured: skipped, reported once."""
        if self.strict:
            raise RecorderFault(f"{what}: {exc}") from exc
        self._warn_once(what, f"could not measure {what} ({type(exc).__name__}: {exc}); "
                              "it is left out of the sampled statistics")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"ampdoctor: {message}", RuntimeWarning, stacklevel=3)

    # ---------------------------------------------------------------------------------------
    # how the process ends: SIGTERM, an uncaught exception, a fork

    def _catch_exit(self) -> None:
        """Finish the file however the process ends, without changing how it ends."""
        self._signal_previous: dict[int, Any] = {}
        self._signal_deadline = 0.0
        self._signal_pending: Optional[int] = None
        self._last_value_at_start = getattr(sys, "last_value", None)
        atexit.register(self._at_exit)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for name in STOP_SIGNALS:
            signum = getattr(signal, name, None)
            try:
                previous = signal.getsignal(signum) if signum is not None else None
                if previous is None or previous == signal.SIG_IGN:
                    continue  # ignored, or a handler set outside Python: left alone
                signal.signal(signum, self._on_stop_signal)
            except (ValueError, OSError):
                continue
            self._signal_previous[signum] = previous

    def _release_exit(self) -> None:
        if not hasattr(self, "_signal_previous"):
            return
        try:
            atexit.unregister(self._at_exit)
        except Exception:  # noqa: BLE001 - interpreter shutting down
            pass
        for signum, previous in self._signal_previous.items():
            try:
                if signal.getsignal(signum) == self._on_stop_signal:  # not replaced since
                    signal.signal(signum, previous)
            except (ValueError, OSError):
                pass  # closed from another thread: the handler passes signals on

    def _on_stop_signal(self, signum: int, frame: Any) -> None:
        """SIGTERM: flush, record ``signal:SIGTERM`` and close, then do what was set before
        (by default, end the process by that same signal). A handler the script set itself
        is called instead, after a flush: the script decides what SIGTERM means."""
        previous = self._signal_previous.get(signum, signal.SIG_DFL)
        mine = os.getpid() == self._pid  # not a forked child (a DataLoader worker)
        if mine and _inside_recorder(frame) and self._wait_for_signal(signum, frame):
            return  # half-way through a write, or through close: back when that is done
        self._signal_pending = None
        if mine and not self.closed:
            if callable(previous):
                self.flush()
            else:
                self.close(schema.STATUS_SIGNAL + signal.Signals(signum).name)
        _pass_on(signum, frame, previous)

    def _wait_for_signal(self, signum: int, frame: Any) -> bool:
        """Take ``signum`` again as soon as ampdoctor's code on the stack has returned.

        The outermost such frame gets a local trace function (``_Retake``) that re-sends the
        signal once that frame has returned. Under a debugger or coverage,
        which own the trace function, the signal is re-sent every 10 ms instead. Either way
        it waits SIGNAL_PATIENCE seconds at most.
        """
        self._signal_pending = signum
        now = time.monotonic()
        if not self._signal_deadline:
            self._signal_deadline = now + SIGNAL_PATIENCE
        if now > self._signal_deadline:
            return False
        outer = _outermost_recorder_frame(frame)
        if sys.gettrace() is None and outer is not None:
            _Retake(outer, self._pid, signum)
        else:
            timer = threading.Timer(0.01, _resend, (self._pid, signum))
            timer.daemon = True
            timer.start()
        return True

    def _status_if_signalled(self, status: str) -> str:
        """Closing while a stop signal waits to be taken again: the process is ending by it."""
        signum = getattr(self, "_signal_pending", None)
        if signum is None or status != schema.STATUS_FINISHED or \
                callable(self._signal_previous.get(signum)):
            return status
        return schema.STATUS_SIGNAL + signal.Signals(signum).name

    def _at_exit(self) -> None:
        """The interpreter is exiting with the recorder still open (no ``with``, no close)."""
        if os.getpid() != self._pid or self.closed:
            return
        exc = getattr(sys, "last_value", None)  # set when Python printed an uncaught one
        if exc is not None and exc is not self._last_value_at_start and \
                not isinstance(exc, SystemExit):  # an exit, not a failure
            self.record_exception(type(exc), exc)
            self.close(schema.STATUS_EXCEPTION + type(exc).__name__)
        else:
            self.close()

    # ---------------------------------------------------------------------------------------
    # discovery of roots, optimizers, scaler

    def discover_pre(self, module: torch.nn.Module, args: tuple) -> None:
        """First step of a recorder given no model: the outermost module called with grad
        enabled that owns trainable parameters is a root, adopted before its forward runs.

        DDP/DataParallel wrappers are looked through: the module they wrap is the root, so that
        a forensic replay never runs the wrapper's collectives on one rank alone."""
        if is_wrapper(module):
            return
        self._depth += 1
        if self._depth > 1:
            self._note_inner_autocast()
        if self._depth != 1 or module in self.names or not torch.is_grad_enabled():
            return
        self._adopt_discovered(module, args, {})

    def _adopt_discovered(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
        """A module called at the top with grad enabled becomes a root (unless it trains
        nothing); this call is seen from here, the root's own hooks see the next ones."""
        if not any(p.requires_grad for p in module.parameters()):
            return False  # a loss module, a frozen model, a parameter-free transform
        self._root_hooks.remove()
        self._adopt_roots(self.roots + [module])
        # A global pre-hook gets no kwargs: the root's own post-hook fills them in.
        self._discovering = module
        if self._compiled and self._discovery_hooked:
            # Global hooks must not exist while a compiled region is traced: discovery ends
            # at this root (its own hooks run outside the compiled region).
            self._discovery.remove()
            self._discovery_hooked = False
        self._maybe_sample()  # the first step is sampled, as with a model given to watch()
        self.root_pre(module, args, kwargs)
        return True

    def discover_post(self, module: torch.nn.Module, args: tuple, kwargs: dict,
                      output: Any) -> None:
        if not is_wrapper(module):
            self._depth = max(0, self._depth - 1)

    def on_module_compile(self, module: torch.nn.Module) -> None:
        """``module.compile()``: its calls (hooks included) are compiled from now on, so the
        recorder sees them through an eager shim."""
        patches.shim_compiled_call(self._patches, self, module)
        if id(module) in self._root_ids:
            self._root_hooks.remove()
            self._adopt_roots(self.roots)

    def compiled_pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Before a ``module.compile()``'d call (its forward pre-hooks would be compiled)."""
        if self._replaying():
            return
        if id(module) in self._root_ids:
            self.root_pre(module, args, kwargs)
        elif self._discovery_open and self._depth == 0 and module not in self.names and \
                torch.is_grad_enabled():
            self._adopt_discovered(module, args, kwargs)

    def compiled_post(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if id(module) not in self._root_ids or self._replaying():
            return
        if self._step.sampled and self._sampler is not None and self._sampler.active:
            self._sampler.on_forward(module, output)
        self.root_post(module, args, output)

    def _finish_discovery(self) -> None:
        """End of the first step: keep the roots whose parameters an optimizer trains."""
        self._discovery.remove()
        self._discovery_open = self._discovery_hooked = False
        self._discovering = None
        trained = {id(p) for opt in self.optimizers for g in opt.param_groups
                   for p in g["params"]}
        keep = [m for m in self.roots if any(id(p) in trained for p in m.parameters())]
        if trained and keep and len(keep) < len(self.roots):
            self._root_hooks.remove()
            self._adopt_roots(keep)

    def _adopt_roots(self, roots: list[torch.nn.Module]) -> None:
        self.roots = roots
        self._root_ids = {id(r) for r in roots}
        self.names.clear()
        self.param_names.clear()
        prefixes = _root_prefixes(roots)
        self._device = _first_device(roots)
        if self._amp is None or self._amp.device_type != self._device.type:
            self._amp = amp_state.Tracker(self._device.type)
        self._compiled = []
        for root, prefix in zip(roots, prefixes):
            inner = unwrap(root)
            self.names[root] = prefix.rstrip(".") or type(inner).__name__
            for name, m in inner.named_modules():
                name = sharding.clean_name(name)
                if name:
                    self.names[m] = prefix + name
            for name, p in inner.named_parameters():
                self.param_names[id(p)] = prefix + sharding.clean_name(name)
            self._compiled += [(prefix + n if n else self.names[root], k)
                               for n, k in compiled.regions(root)]
            self._amp.declare(root)
            self._hook_root(root)
        self._eager = [m for r in roots for m in compiled.eager_modules(r)] \
            if self._compiled else None
        self._adopt_sharding(roots)
        if self._clock.device != self._device:  # discovered: the device is known from now on
            self._clock = readback.StepClock(self._device)
        self._meta("roots", [type(unwrap(r)).__name__ for r in roots])
        self._meta("model", model_summary(roots))
        self._meta("device", device_info(self._device))
        if self._compiled:
            self._note_compiled()

    def _hook_root(self, root: torch.nn.Module) -> None:
        """The root's forward pre-hook and hook, or, for a ``module.compile()``'d root whose
        hooks would be compiled, the eager shim around its call."""
        if compiled.kind(root) == compiled.CALL:
            patches.shim_compiled_call(self._root_hooks, self, root)
            return
        self._root_hooks.add(root.register_forward_pre_hook(
            lambda m, a, k: patches.guard(self, "root_pre", m, a, k), with_kwargs=True))
        self._root_hooks.add(root.register_forward_hook(
            lambda m, a, k, o: patches.guard(self, "root_post", m, a, o, k), with_kwargs=True))

    def _note_compiled(self) -> None:
        """What a compiled model leaves out of the recording (module outputs inside its
        compiled regions), kept in /meta for ``diagnose`` to say."""
        shimmed = [r for r in self.roots if compiled.kind(r) == compiled.CALL]
        self._meta("compiled", {"regions": [{"module": n, "kind": k} for n, k in self._compiled],
                                "hooked": sorted(self.names.get(m, "?")
                                                 for m in self._eager + shimmed)})

    def _adopt_sharding(self, roots: list[torch.nn.Module]) -> None:
        """A sharded model (FSDP2, FSDP1): per-shard statistics, norms from shards, no
        replay (sharding.py); /meta says so."""
        found = sharding.detect(roots, self.world_size)
        if found is None:
            return
        if self._sharding is None:
            patches.patch_scaler(self._patches, self)  # ShardedGradScaler, loaded since
            if found.kind == "fsdp1":
                patches.patch_clip_method(self._patches, self, sharding.fsdp1_class())
        self._sharding = found
        self._meta("sharding", found.meta(self.forensics_on))

    def _adopt_scaler(self, scaler: Any) -> None:
        self.scaler = scaler
        self._meta("scaler", scaler_info(scaler))

    def on_scaler_init(self, scaler: Any) -> None:
        self._event(Event.SCALER_CREATED, value=float(getattr(scaler, "_init_scale", math.nan)))
        if not self._given["scaler"] and self.scaler is not None and scaler is not self.scaler:
            self.scaler = None  # a re-created scaler replaces the old one once it scales a loss

    def _owns(self, optimizer: Any) -> bool:
        """Is this an optimizer of the watched model?"""
        if self.optimizers and any(optimizer is o for o in self.optimizers):
            return True
        if self._given["optimizer"]:
            return False
        known = self._own_optimizer.get(id(optimizer))
        if known is None:
            if self.roots and self.param_names:
                known = any(id(p) in self.param_names for g in optimizer.param_groups
                            for p in g["params"])
            else:
                known = True
            self._own_optimizer[id(optimizer)] = known
            if known:
                self.optimizers.append(optimizer)
                # Hyperparameters now (a run whose every step is skipped never steps);
                # the optimizer-state dtypes follow after its first step.
                self._meta("optimizer", optimizer_info(self.optimizers))
        return known

    def _uses_scaler(self, scaler: Any) -> bool:
        if self.scaler is None and not self._given["scaler"] and scaler_enabled(scaler):
            self._adopt_scaler(scaler)
        return scaler is self.scaler

    # ---------------------------------------------------------------------------------------
    # root module: autocast state, the batch (forensics, input audit)

    def root_pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._replaying():
            return
        if self._undecided is not None and torch.is_grad_enabled():
            self._settle()  # before this forward allocates, or changes a BatchNorm buffer
        if torch.is_grad_enabled():  # an evaluation call says nothing of the training dtype
            self._note_autocast()
        if self._step.sampled and self._sampler is not None:
            self._sampler.on_inputs(self.names.get(module, ""), args, kwargs)
        if self.forensics is not None and self.forensics.armed:
            self.forensics.capture_inputs(module, args, kwargs)

    def root_post(self, module: torch.nn.Module, args: tuple, output: Any,
                  kwargs: Optional[dict] = None) -> None:
        if module is self._discovering:  # the discovery call: its kwargs are known only now
            self._discovering = None
            if not self._discovery_hooked:
                self._depth = 0  # nothing counted the calls inside it
            if self.forensics is not None and kwargs:
                self.forensics.capture_kwargs(module, kwargs)
        if self.forensics is not None and self.forensics.armed:
            self.forensics.capture_output(module, output)

    def _replaying(self) -> bool:
        """A forensic replay is re-running the model: none of its calls belong to the step."""
        return self.forensics is not None and self.forensics.replaying

    def _note_autocast(self) -> None:
        """At the root's pre-hook, every training call: one read, a /meta row on a change."""
        state = self._amp.outer()
        if state != self._autocast_seen:
            self._autocast_seen = state
            self._write_autocast()

    def _note_inner_autocast(self) -> None:
        """Inside the root's forward (steps with module hooks only): autocast entered there,
        by accelerate's wrapped forward or a decorator, is what the model's ops ran in."""
        amp = self._amp
        if amp is not None and amp.entered != amp_state.INSIDE and self.roots and \
                torch.is_grad_enabled():
            amp.inner()
            if amp.entered == amp_state.INSIDE:
                self._write_autocast()

    def _write_autocast(self) -> None:
        state = self._amp.effective()
        if state != self._autocast_meta:
            self._autocast_meta = state
            self._meta("autocast", state, step=self._step.index)

    # ---------------------------------------------------------------------------------------
    # loss and backward

    def on_scale(self, scaler: Any, outputs: Any, out: Any) -> None:
        if not self._uses_scaler(scaler) or not scaler_enabled(scaler):
            return
        self._settle()
        if not self._writer.created:
            self._create_file()
        self._end_step_without_update()
        self._step.scaled = True
        if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
            self._add_loss(outputs, scaled=True)
            self._step.keep.append(out)

    def before_backward(self, tensors: Any) -> None:
        self._settle()
        if not self._writer.created:
            self._create_file()
        self._end_step_without_update()
        st = self._step
        st.micro += 1
        items = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        for t in items:
            if isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point():
                if not any(t is k for k in st.keep):
                    self._add_loss(t)
                break

    def _add_loss(self, loss: torch.Tensor, scaled: bool = False) -> None:
        st = self._step
        # A DTensor loss (loss_parallel): its local value; reading the DTensor would be a
        # collective that a rank whose replay budget ran out earlier would not join.
        value = sharding.local(loss.detach()).reshape(()).float()
        st.loss_sum = value if st.loss_sum is None else st.loss_sum + value
        st.loss_n += 1
        if not st.loss_dtype:
            st.loss_dtype = stats.dtype_code(loss.dtype)
        if self.forensics is not None and self.forensics.armed:
            self.forensics.capture_loss(loss, scaled)

    # ---------------------------------------------------------------------------------------
    # gradients: the moment they are complete (before unscale_, clip or step)

    def _trained_params(self, fallback: Optional[list] = None) -> list[torch.Tensor]:
        """Parameters of the watched optimizers, each once; those ``clip_grad_norm_`` saw
        while no optimizer is known yet. The list is made again only when the param groups
        change (``add_param_group``, ``load_state_dict``, a new optimizer): the key is each
        group's params list and its length, read in a few microseconds."""
        groups = [g["params"] for o in self.optimizers for g in o.param_groups]
        if not groups:
            return _unique([fallback] if fallback is not None else [])
        key = tuple((id(params), len(params)) for params in groups)
        if key != self._params_key:
            self._params_key, self._params = key, _unique(groups)
        return self._params

    def _grads_ready(self, fallback: Optional[list] = None) -> None:
        """Gradients are complete (first of unscale_, clip, step): sampled grad statistics,
        in scaled space under a scaler."""
        st = self._step
        if st.grads_ready:
            return
        st.grads_ready = True
        st.fallback = fallback
        if st.sampled and self._sampler is not None:
            params = self._trained_params(fallback)
            self._sampler.on_grads_ready([(self._param_name(p), p) for p in params])

    def _ensure_grad_norm(self) -> None:
        """The global grad norm, unscaled, computed as late as possible: when clip_grad_norm_
        ran, its own pre-clip norm is taken instead of a second pass over the gradients."""
        st = self._step
        if st.grad_norm is not None:
            return
        params = self._trained_params(st.fallback)
        if self._sharding is not None:  # no rank holds the whole gradient: its share
            share = self._sharding.norm_share(params)
            if share is not None:
                st.grad_norm = self._unscaled(share)
                st.flags |= flag(Event.GRAD_NORM_LOCAL)
            return
        grads = [p.grad for p in params if p.grad is not None and stats.measurable(p.grad)]
        if grads:
            st.grad_norm = self._unscaled(_global_norm(grads))

    def _unscaled(self, norm: torch.Tensor) -> torch.Tensor:
        st = self._step
        if st.scaled and not st.unscaled and self.scaler is not None:
            scale = self.scaler._scale
            if scale is not None:
                return norm / scale.to(norm.device).reshape(())
        return norm

    def _param_name(self, p: torch.Tensor) -> str:
        name = self.param_names.get(id(p))
        if name is None:
            name = self.param_names[id(p)] = f"param{len(self.param_names)}"
        return name

    def before_unscale(self, scaler: Any, optimizer: Any) -> None:
        if self._uses_scaler(scaler):
            self._settle()
            self._owns(optimizer)
            if unscaled_already(scaler, optimizer) and \
                    not self._step.flags & flag(Event.UNSCALE_TWICE):
                self._event(Event.UNSCALE_TWICE)  # GradScaler raises next; this says why
            self._grads_ready()

    def after_unscale(self, scaler: Any, optimizer: Any) -> None:
        if self._uses_scaler(scaler):
            self._step.unscaled = True
            if self._armed() and scaler_enabled(scaler):
                # Queued before GradScaler.step reads found_inf (non-fused optimizers):
                # its own sync lands this copy too.
                self._stage_found(scaler, optimizer)

    def before_clip(self, parameters: Any, config: Optional[dict] = None) -> None:
        """``config``: max_norm, norm_type, foreach as called (``patches.clip_config``), kept
        in /meta ``clip`` whenever it changes (Python values only: no host read)."""
        self._settle()
        if config is not None and config != self._clip_config:
            self._clip_config = config
            self._meta("clip", config, self._step.index if self._step is not None else -1)
        st = self._step
        if st.scaled and not st.unscaled and scaler_enabled(self.scaler):
            if not st.flags & flag(Event.CLIP_BEFORE_UNSCALE):  # one event row per step
                self._event(Event.CLIP_BEFORE_UNSCALE)
        params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
        self._grads_ready(fallback=params)

    def after_clip(self, total_norm: Any, combined: bool = False) -> None:
        """``combined``: FSDP1's ``model.clip_grad_norm_`` returned it (a global norm)."""
        if isinstance(total_norm, torch.Tensor):
            st = self._step
            st.clip_norm, whole = sharding.clip_result(total_norm, self._sharding, combined)
            share = flag(Event.GRAD_NORM_LOCAL)
            if st.grad_norm is None or (whole and st.flags & share):  # a global norm wins
                st.grad_norm = self._unscaled(st.clip_norm)
                st.flags = (st.flags & ~share) | (0 if whole else share)

    # ---------------------------------------------------------------------------------------
    # optimizer and scaler steps

    def enter_scaler_step(self, scaler: Any, optimizer: Any) -> None:
        if self._uses_scaler(scaler):
            self._settle()
            self._owns(optimizer)
            self._step.in_scaler_step = True
            self._grads_ready()

    def exit_scaler_step(self, scaler: Any, optimizer: Any) -> None:
        if scaler is self.scaler:
            self._step.in_scaler_step = False

    def before_optimizer_step(self, optimizer: Any) -> None:
        if not self._owns(optimizer):
            return
        self._settle()
        if not self._writer.created:
            self._create_file()
        st = self._step
        if st.scaled and not st.in_scaler_step:
            st.flags |= flag(Event.STEP_BYPASSES_SCALER)
            self._event(Event.STEP_BYPASSES_SCALER, text=type(optimizer).__name__)
        elif st.in_scaler_step and self._armed() and scaler_enabled(self.scaler):
            # A fused optimizer: GradScaler checked found_inf and syncs on nothing; the copy
            # is queued ahead of the fused step's kernels.
            self._stage_found(self.scaler, optimizer)
        self._grads_ready()
        self._ensure_grad_norm()
        if not st.scaled and self._primary(optimizer):
            self._check_before_step()
        if st.sampled and self._sampler is not None:
            self._sampler.before_step([(self._param_name(p), p)
                                       for p in self._trained_params()])

    def after_optimizer_step(self, optimizer: Any) -> None:
        if not self._owns(optimizer):
            return
        st = self._step
        st.stepped = True
        if id(optimizer) not in self._optimizer_meta_done:
            self._optimizer_meta_done.add(id(optimizer))
            self._meta("optimizer", optimizer_info(self.optimizers))
        if not st.scaled and self._primary(optimizer):
            if st.sampled and self._sampler is not None:
                self._sampler.after_step()
            self._end_step()
        elif st.sampled and self._sampler is not None:
            self._sampler.after_step()

    def _end_step_without_update(self) -> None:
        """A scaled step whose optimizer stepped but whose ``scaler.update()`` never came (a
        loop that calls ``optimizer.step()`` itself): the next loss closes it."""
        st = self._step
        if st.scaled and st.stepped and not st.in_scaler_step:
            scale = getattr(self.scaler, "_scale", None)
            if scale is not None and st.scale is None:
                st.scale = st.scale_after = scale.detach().reshape(()).clone()
            self._end_step()

    def _primary(self, optimizer: Any) -> bool:
        return bool(self.optimizers) and optimizer is self.optimizers[0]

    def before_update(self, scaler: Any) -> None:
        if not self._uses_scaler(scaler) or not scaler_enabled(scaler):
            return
        self._settle()
        st = self._step
        self._ensure_grad_norm()
        if scaler._scale is not None:
            st.scale = scaler._scale.detach().reshape(()).clone()  # update() changes it in place
        found = [v for s in scaler._per_optimizer_states.values()
                 for v in s["found_inf_per_device"].values()]
        if len(found) == 1:  # made fresh by each unscale and never written after: no copy
            st.found_inf = found[0].reshape(())
        elif found:
            dev = found[0].device
            st.found_inf = torch.stack([f.to(dev).reshape(()) for f in found]).sum()
        if self._armed():
            self._stage_found(scaler)  # optimizers no hook has staged yet
            skipped = self._decide(st, wait=False)
            if skipped is None:
                st.undecided = True  # a fused optimizer on a device still running the step
            elif skipped:
                self._trigger(Event.SKIPPED)

    def after_update(self, scaler: Any) -> None:
        if scaler is not self.scaler or not scaler_enabled(scaler) or not self._step.scaled:
            return
        if scaler._scale is not None:  # stacked by _end_step right away: a view is enough
            self._step.scale_after = scaler._scale.detach().reshape(())
        self._end_step()

    # ---------------------------------------------------------------------------------------
    # the forensic tier's trigger: is this step failing, while its parameters are in place?
    #
    # The syncs of a steady step, all of them (tests/test_host_reads.py counts them):
    # - GradScaler, any optimizer: none of ampdoctor's own. found_inf and the loss are copied
    #   into host mirrors (readback.HostMirror) with non-blocking copies. A non-fused optimizer
    #   makes GradScaler.step sync on found_inf (``.item()``) after the copy was queued, so the
    #   mirror has landed by update(): decided there, as before. A fused one makes GradScaler
    #   sync on nothing: decided at the next step's start (``_settle``), if need be after a wait
    #   for that copy alone, queued a step earlier (the device still has the step's optimizer
    #   kernels queued behind it, so it never runs dry).
    # - No scaler, forensics armed: one read before optimizer.step (``_check_before_step``).
    # - Every flush (about once a second): one read per device of all pending steps' values.

    def _armed(self) -> bool:
        return self.forensics is not None and self.forensics.armed

    def _pool(self, device: torch.device) -> readback.MirrorPool:
        pool = self._pools.get(device)
        if pool is None:
            pool = self._pools[device] = readback.MirrorPool(device)
        return pool

    def _stage_found(self, scaler: Any, optimizer: Any = None) -> None:
        """Queue found_inf of ``optimizer`` (default: every optimizer GradScaler has checked
        this step and no hook has staged), with the step's loss, into a host mirror. Two
        small kernels (a stack, a non-blocking copy) and no wait."""
        st = self._step
        states = scaler._per_optimizer_states
        keys = [id(optimizer)] if optimizer is not None else list(states)
        for key in keys:
            if key in st.staged or key not in states:  # a defaultdict: never index a new key
                continue
            found = list(states[key]["found_inf_per_device"].values())
            if not found:
                continue
            dev = found[0].device
            total = found[0] if len(found) == 1 else sum(f.to(dev) for f in found)
            loss = st.loss_sum.to(dev) if st.loss_sum is not None else self._constants.nan(dev)
            mirror = self._pool(dev).take()
            mirror.stage(torch.stack([total.reshape(()).float(), loss.reshape(())]))
            st.staged[key] = mirror

    def _decide(self, st: Step, wait: bool) -> Optional[bool]:
        """Was the scaled step ``st`` skipped? From its mirrors: True or False (and
        ``st.loss_nonfinite``), or None while a copy is in flight and ``wait`` is False."""
        mirrors = list(st.staged.values())
        if not all(m.ready() for m in mirrors):
            if not wait:
                return None
            for m in mirrors:
                m.wait()
        values = [m.read() for m in mirrors]
        self._give_back(st)
        if not values:
            return False  # GradScaler checked no optimizer of ours: nothing to decide
        st.loss_nonfinite = st.loss_sum is not None and not math.isfinite(values[0][1])
        return any(v[0] > 0 for v in values)

    def _give_back(self, st: Step) -> None:
        for mirror in st.staged.values():
            self._pool(mirror.device).give(mirror)
        st.staged.clear()

    def _settle(self, wait: bool = True) -> None:
        """The previous step's skip, decided now (its mirrors landed, or ``wait``): at the
        first hook of the next step, before its forward allocates anything or any weight
        changes. Until then the forensic tier holds that step's captures (see
        ``forensics.Forensics.end_step``); they are released here, replayed or not."""
        st = self._undecided
        if st is None:
            return
        skipped = self._decide(st, wait)
        if skipped is None:
            return
        self._undecided = None
        try:
            if skipped and self._armed():
                self._trigger(Event.SKIPPED, st)
        finally:
            if self.forensics is not None:
                self.forensics.release_held()

    def _check_before_step(self) -> None:
        """Without a scaler: is this step about to apply non-finite values?

        The one sync of such a step, made only while the forensic tier is armed: one read of
        the loss and the grad norm stacked together, just before ``optimizer.step``. It waits
        for backward (and clipping) to finish on the device, so the host launches the
        optimizer step only then. A faithful replay needs it: without a scaler a non-finite
        step writes NaN into the weights, so a decision one step later would replay against
        the poisoned weights. ``forensics=False``, or ``max_replays`` used up, removes it.
        """
        if not self._armed():
            return
        st = self._step
        values = [v for v in (st.loss_sum, st.grad_norm) if v is not None]
        if not values:
            return
        dev = values[0].device
        read = torch.stack([v.to(dev).reshape(()) for v in values]).tolist()  # the sync
        loss_ok = st.loss_sum is None or math.isfinite(read[0])
        if not loss_ok or (st.grad_norm is not None and not math.isfinite(read[-1])):
            self._trigger(Event.NONFINITE_GRAD if loss_ok else Event.NONFINITE_LOSS)

    def _trigger(self, why: Event, st: Optional[Step] = None) -> None:
        """Parameters are still those that failed: hand the step to the forensic tier.
        ``st``: a step already ended, whose skip was decided at the next step's start."""
        st = st if st is not None else self._step
        self._drain()  # the steps up to the event reach the file before anything else
        snapshot = self.forensics.on_event(st, why, held=st is not self._step)
        if snapshot is not None:
            self.replays += 1
            self._event(Event.FORENSICS, value=float(snapshot), step=st)
            self._writer.flush()  # the snapshot survives a crash that may follow the event
            self._flush_now = True  # and the event's own step row is written at its end
        self._audit_buffers(st)

    def _audit_buffers(self, st: Step) -> None:
        """On a failing step: module buffers the forward made non-finite (BatchNorm statistics
        are updated before GradScaler skips the step, and stay poisoned). One host sync."""
        buffers = [(f"{self.names[m]}.{n}", b, type(m).__name__) for m in list(self.names)
                   for n, b in m.named_buffers(recurse=False) if stats.measurable(b)]
        if not buffers:
            return
        dev = buffers[0][1].device
        finite = torch.stack([torch.isfinite(sharding.local(b)).all().to(dev)
                              for _, b, _ in buffers]).tolist()
        for (name, b, owner), ok in zip(buffers, finite):
            if not ok:
                tid = self._tensor_id(Kind.BUFFER, name, 0, b, owner)
                self._event(Event.NONFINITE_BUFFER, tensor=tid, step=st)

    @property
    def events(self) -> list:
        """What the forensic tier caught, as ``forensics.ForensicEvent`` (step, trigger,
        phase, module, fp32 verdict); empty with ``forensics=False``."""
        return list(self.forensics.events) if self.forensics is not None else []

    def replay(self, step: int):
        """Re-run a replayed event's micro-batches, instrumented; a ``ReplayResult``.

        Runs against the model's current weights with the batch, RNG state and output
        gradient kept from the event; ``result.faithful`` says whether the weights are still
        those of the event. Works after the recorder is closed; writes nothing to the file.
        """
        if self.forensics is None:
            raise AmpDoctorError("this recorder was started with forensics=False: "
                                 "nothing was captured to replay")
        return self.forensics.replay(step)

    # ---------------------------------------------------------------------------------------
    # step boundaries

    def _begin_step(self, index: int) -> None:
        self._step = Step(index=index, t0=time.time())
        self._depth = 0
        if self.forensics is not None:
            self.forensics.begin_step()
        if self.roots:
            self._maybe_sample()
        self._flush_now = False

    def _maybe_sample(self) -> None:
        """Turn the sampled tier on for this step if it is due (before its first forward)."""
        st = self._step
        if st.sampled or self.every <= 0 or st.index % self.every or st.micro:
            return
        st.sampled = True
        if self._sampler is None:
            self._sampler = Sampler(self.names, self._tensor_id, self.warn_tensor,
                                    sample=self.sample)
        self._sampler.active = True
        if self._eager is None:
            patches.hook_modules(self._sample_hooks, self, None, "sample_post")
            return
        for m in self._eager:  # a compiled model: only modules that run outside its regions
            self._sample_hooks.add(m.register_forward_hook(
                lambda m, a, o: patches.guard(self, "sample_post", m, a, o)))

    def sample_post(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if not self._replaying():
            if id(module) not in self._root_ids and module in self.names:
                self._note_inner_autocast()
            self._sampler.on_forward(module, output)

    def _end_step(self) -> None:
        st = self._step
        if self._undecided is not None and self._undecided is not st:
            self._settle()  # a step with no hook of ours between: decided before this one ends
        if self._discovery_open:
            self._finish_discovery()
        self._note_fp16_without_scaler(st)
        now = time.perf_counter()
        lrs = self._write_groups(st.index)
        # Host fields as a plain tuple (order: HOST); device values stay on the device. The
        # step time is a CUDA event span on CUDA, and the peak memory is read at the flush.
        self._pending.append(((st.index, time.time(), self._clock.mark(), st.loss_dtype,
                               st.micro, int(st.sampled), st.flags, 0,
                               0 if st.stepped or st.scaled else 1,
                               max(lrs) if lrs else math.nan,
                               st.loss_sum is not None, st.grad_norm is not None),
                              device_values(st, self._constants)))
        if st.sampled and self._sampler is not None:
            self._sample_hooks.remove()
            self._sampler.active = False
            self._sample_rows(st.index)
        self._after_step_audit()
        st.keep.clear()
        st.fallback = None
        if st.undecided:
            self._undecided = st  # its captures stay with the forensic tier until then
        elif st.staged:
            self._give_back(st)  # staged, never decided (no update(), or disarmed since)
        self.steps = st.index + 1
        if self._flush_now or now - self._last_flush >= self.flush_seconds:
            self._drain()
        self._begin_step(st.index + 1)
        if self._undecided is not None:
            self._settle(wait=False)  # landed already: release its captures at once

    def _note_fp16_without_scaler(self, st: Step) -> None:
        """FP16_WITHOUT_SCALER, once, at the end of the first step whose model ran under fp16
        autocast with no enabled GradScaler scaling the loss (host state only)."""
        ac = self._autocast_meta
        if self._fp16_noted or not ac or ac.get("dtype") != "float16" or st.scaled or \
                scaler_enabled(self.scaler):
            return
        self._fp16_noted = True
        self._event(Event.FP16_WITHOUT_SCALER, text="fp16 autocast, no GradScaler", step=st)

    def _after_step_audit(self) -> None:
        if self.forensics is not None:
            self.forensics.end_step(self._step, hold=self._step.undecided)

    def _sample_rows(self, step: int) -> None:
        buffers = [(f"{self.names[m]}.{n}", b) for m in list(self.names)
                   for n, b in m.named_buffers(recurse=False)]
        self._sampler.on_buffers(buffers)
        rows = self._sampler.finish(step)
        self._writer.append("stats", rows)

    def _write_groups(self, step: int) -> list[float]:
        lrs = []
        rows = []
        for opt in self.optimizers:
            for g in opt.param_groups:
                lr = g.get("lr", math.nan)
                lr = float(lr) if not isinstance(lr, torch.Tensor) or lr.device.type == "cpu" \
                    else math.nan
                lrs.append(lr)
                wd = g.get("weight_decay", math.nan)
                rows.append((step, len(rows), lr, float(wd) if isinstance(wd, (int, float))
                             else math.nan))
        self._pending_groups.extend(rows)
        return lrs

    def _drain(self) -> None:
        """Fetch the pending steps' device values (the documented sync: one read per device)
        and flush the file. Step times (CUDA events) and the peak memory are read here too."""
        if self._pending:
            # Taken first: an interrupt below can lose these steps but never write them twice.
            pending, self._pending = self._pending, []
            host = [h for h, _ in pending]
            rows = schema.empty("steps", len(host))
            for i, name in enumerate(HOST):
                if name != "dt":
                    rows[name] = [h[i] for h in host]
            has_loss = np.array([h[-2] for h in host], bool)
            has_grad = np.array([h[-1] for h in host], bool)
            values = fetch([v for _, v in pending])
            rows["dt"] = readback.StepClock.seconds([h[HOST.index("dt")] for h in host])
            rows["peak_mem"] = peak_memory(self._device)  # never reset: the run's peak so far
            rows["loss"] = values[:, 0]
            rows["scale"] = values[:, 1]
            rows["scale_after"] = values[:, 2]
            found = values[:, 3]
            rows["found_inf"] = np.where(np.isnan(found), -1, found > 0)
            rows["grad_norm"] = values[:, 4]
            rows["clip_norm"] = values[:, 5]
            with np.errstate(invalid="ignore"):
                by_scale = rows["scale_after"] < rows["scale"]
            skipped = np.where(rows["found_inf"] >= 0, rows["found_inf"] == 1, by_scale)
            scaled = ~np.isnan(rows["scale"])
            rows["skipped"] = np.where(scaled, skipped, rows["skipped"])
            rows["flags"] |= (np.where(rows["skipped"] == 1, flag(Event.SKIPPED), 0)
                              | np.where(has_loss & ~np.isfinite(values[:, 0]),
                                         flag(Event.NONFINITE_LOSS), 0)
                              | np.where(has_grad & ~np.isfinite(values[:, 4]),
                                         flag(Event.NONFINITE_GRAD), 0)
                              ).astype(np.int32)
            self._writer.append("steps", rows)
        if self._pending_groups:
            groups, self._pending_groups = self._pending_groups, []
            self._writer.append("groups", np.array(groups, schema.GROUPS))
        self._writer.flush()
        self._last_flush = time.perf_counter()

    # ---------------------------------------------------------------------------------------
    # the file

    def _tensor_id(self, kind: Kind, name: str, index: int, t: Any, owner_type: str) -> int:
        key = (int(kind), name, index)
        tid = self._tensor_ids.get(key)
        if tid is None:
            tid = self._tensor_ids[key] = len(self._tensor_ids)
            row = schema.empty("tensors", 1)
            row["id"] = tid
            row["kind"] = int(kind)
            row["index"] = index
            if isinstance(t, torch.Tensor):
                row["dtype"] = stats.dtype_code(t.dtype)
                row["numel"] = t.numel()
            row["name_off"], row["name_len"] = self._writer.text(name)
            row["type_off"], row["type_len"] = self._writer.text(owner_type)
            self._writer.append("tensors", row)
        return tid

    def _event(self, kind: Event, *, tensor: int = -1, value: float = math.nan,
               text: str = "", step: Optional[Step] = None) -> None:
        """An /events row, at ``step`` (default: the current one). A step already ended (a
        skip decided at the next step's start) keeps its event rows; its /steps flags were
        written without these bits."""
        row = schema.empty("events", 1)
        step = step if step is not None else self._step
        row["step"] = step.index if step is not None else 0
        row["kind"] = int(kind)
        row["tensor"] = tensor
        row["value"] = value
        if text:
            row["text_off"], row["text_len"] = self._writer.text(text)
        self._writer.append("events", row)
        if step is not None:
            step.flags |= flag(kind)

    def _meta(self, key: str, value: Any, step: int = -1) -> None:
        self._writer.meta(key, value, step)

    def _write_start_meta(self) -> None:
        self._meta("status", schema.STATUS_RUNNING)
        self._meta("recorder", {"every": self.every, "sample": self.sample,
                                "forensics": self.forensics_on, "max_replays": self.max_replays,
                                "flush_seconds": self.flush_seconds, "version": __version__,
                                "given": self._given})
        self._meta("torch", {"version": torch.__version__,
                             "cuda": getattr(torch.version, "cuda", None),
                             "threads": torch.get_num_threads()})


# ---------------------------------------------------------------------------------------------
# helpers (no state)


def _unique(groups: list) -> list[torch.Tensor]:
    """The tensors of several lists, each once, in order."""
    seen: set[int] = set()
    out = []
    for params in groups:
        for p in params:
            if id(p) not in seen and isinstance(p, torch.Tensor):
                seen.add(id(p))
                out.append(p)
    return out


def _as_list(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _root_prefixes(roots: list[torch.nn.Module]) -> list[str]:
    if len(roots) == 1:
        return [""]
    names = [type(unwrap(r)).__name__ for r in roots]
    return [f"{n}{i}." if names.count(n) > 1 else f"{n}." for i, n in enumerate(names)]


def _first_device(roots: list[torch.nn.Module]) -> torch.device:
    for root in roots:
        for p in root.parameters():
            return p.device
    return torch.device("cpu")


def _rank_and_world(rank: int, world_size: int) -> tuple[int, int]:
    """This process's rank: torch.distributed's once a process group exists (mp.spawn sets no
    RANK variable), else what the environment said (torchrun)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return rank, world_size


def _global_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all gradients, accumulated in fp32, batched per (device, dtype)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g.detach())
    parts = []
    dev = grads[0].device
    for members in groups.values():
        norms = torch._foreach_norm(members, 2.0, dtype=torch.float32)
        parts.append(torch.linalg.vector_norm(torch.stack(norms)).to(dev))
    return torch.linalg.vector_norm(torch.stack(parts)) if len(parts) > 1 else parts[0]


def active() -> Optional[Recorder]:
    """The recorder currently recording in this process, if any."""
    return _ACTIVE


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) inherits the active recorder: there it records
    nothing and can never write into the parent's file (see ``store.Writer.disown``)."""
    global _ACTIVE
    rec, _ACTIVE = _ACTIVE, None
    if rec is None or rec.closed:
        return
    rec.closed = True
    rec.active = False
    try:
        rec._detach()
    finally:
        if rec._writer is not None:
            rec._writer.disown()


os.register_at_fork(after_in_child=_after_fork_in_child)


# Code that changes the recorder's or the writer's state. A signal that lands in it is held
# back until that code is done, so the file is never finished from half-made state.
# That is record/ (the recorder and its helpers), runfile/ (the writer) and what they call:
# the package's own modules, its numpy side; not live/ or preflight/, which run around
# training code.
_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGE = os.path.dirname(_HERE)
_RECORDING_DIRS = (_PACKAGE, _HERE) + tuple(
    os.path.join(_PACKAGE, sub) for sub in ("runfile", "diagnosis", "release", "render"))
_RECORDING_CODE = frozenset(
    os.path.join(folder, name) for folder in _RECORDING_DIRS for name in os.listdir(folder)
    if name.endswith(".py")
    # patches.py only holds the wrappers that call into the recorder and then the original
    # (user-facing) function; the launcher and the CLI never run around training code.
    and name not in ("patches.py", "launch.py", "cli.py", "__init__.py", "__main__.py"))


def _inside_recorder(frame: Any) -> bool:
    return _outermost_recorder_frame(frame) is not None


def _outermost_recorder_frame(frame: Any) -> Any:
    outer = None
    while frame is not None:
        if frame.f_code not in _RETAKE_CODE and \
                os.path.abspath(frame.f_code.co_filename) in _RECORDING_CODE:
            outer = frame
        frame = frame.f_back
    return outer


class _Retake:
    """Sends a held-back signal again once ``outer`` has returned, as a debugger stops at a
    return: a local trace function on ``outer``, then one on its caller, whose first event
    comes after ``outer`` is off the stack. Tracing is on only until then."""

    def __init__(self, outer: Any, pid: int, signum: int):
        self.outer, self.pid, self.signum = outer, pid, signum
        outer.f_trace_lines = False
        outer.f_trace = self.on_outer
        sys.settrace(_untraced)

    def on_outer(self, frame: Any, event: str, arg: Any) -> Any:
        if frame is self.outer and event == "return":
            caller = frame.f_back
            if caller is None:
                self.fire()
                return None
            caller.f_trace_lines = True
            caller.f_trace = self.on_caller
        return self.on_outer

    def on_caller(self, frame: Any, event: str, arg: Any) -> None:
        frame.f_trace = None
        self.fire()

    def fire(self) -> None:
        sys.settrace(None)
        _resend(self.pid, self.signum)


def _untraced(frame: Any, event: str, arg: Any) -> None:
    return None  # a global trace function that traces no new frame


def _resend(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:
        pass


# The signal machinery's own frames do not count as "inside the recorder".
_RETAKE_CODE = frozenset(f.__code__ for f in (_Retake.on_outer, _Retake.on_caller, _Retake.fire,
                                              _resend, _untraced))


def _pass_on(signum: int, frame: Any, previous: Any) -> None:
    """Do with a signal what would have been done without ampdoctor."""
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
