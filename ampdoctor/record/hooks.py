"""The recorder's listener (a ``listener.Listener``): every hook callback, in the order a step
calls them, and the step boundaries between them.

What each hook does is small; the state it changes belongs to the parts: the step being
recorded and the finished steps' rows (``steplog``), the model, optimizers and scaler
(``watched``), the skip decision (``skips``), the sampled tier (``sampler``) and the forensic
tier (``forensics``). ``patches`` calls the hooks through ``guard``: an exception in one goes
to ``fault`` (the recorder steps aside), never to the training loop; one raised by a module
while the model is discovered (no optimizer seen training it yet) skips only that module
(``_skip``), and the rest is recorded.

Step boundaries: ``GradScaler.update`` when an enabled scaler scaled the loss this step (a
skipped step never calls ``optimizer.step``), else the step of the first optimizer seen.
Gradient accumulation: a step is an optimizer step; backward calls count micro-batches. A
scaled step whose ``update()`` never comes ends at the next loss (or at close).

The order of one scaled step, and what each hook adds::

    root_pre         autocast state; the batch (sampled tier, forensic capture)
    after_loss       a torch loss function's call after the model (forensic capture)
    on_scale         the loss as given to scale(); the file created (lazy recorder)
    before_backward  a micro-batch (and the loss, without a scaler)
    before_unscale   gradients complete: sampled gradient statistics
    after_unscale_grads  this rank's own found_inf copied (ShardedGradScaler, before its
                     all-reduce)
    after_unscale    found_inf staged for the skip decision (non-fused optimizers)
    before_clip / after_clip         the clip config, the pre-clip norm (every clip of
                                     torch.nn.utils, the split API's included)
    enter_scaler_step / before_optimizer_step / after_optimizer_step / exit_scaler_step
    before_update    scale, found_inf, grad norm; the skip decided (or deferred)
    after_update     the scale after; the step ends

Why one module: it is one class, ``Hooks``, the ``listener.Listener`` protocol implemented
once. Its callbacks run in the order above and share one step's state (the step being
recorded, the sampled step's hooks and op probe, a skip decision in flight), so splitting it
would cut a step's order across files, or into mixins reaching into each other's attributes;
the work beyond a few lines already lives in the parts it calls.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Optional

import torch

from ..runfile.payloads import FlatLossProbe, HiddenNonfinite
from ..runfile.schema import Event, Kind, flag
from . import callorder, engines, flatloss, patches, scaledloss, sharding, stats
from .forensic import losscall
from .forensic.forensics import Forensics
from .journal import Journal
from .objectives import Objectives
from .opprobe import StepProbe
from .readback import HostRead
from .sampler import Sampler
from .schedules import Schedules
from .skips import Skips
from .steplog import StepLog
from .steps import Micro, Step, drop_micro
from .torchcompat import found_inf, placeholder, scaler_enabled, unscaled_already
from .watched import Watched


class Hooks:
    """The hook callbacks of one recorder (see the module docstring); ``fault(exc, where)``
    is the recorder's."""

    def __init__(self, journal: Journal, watched: Watched, log: StepLog, skips: Skips, *,
                 sampler: Optional[Sampler], forensics: Optional[Forensics], every: int,
                 fault: Callable[[BaseException, str], None], op_probe: bool = True):
        self.journal = journal
        self.watched = watched
        self.log = log
        self.skips = skips
        self.forensics = forensics
        self.every = every  # the sampled tier's interval (0: never)
        self._fault = fault
        self.patches = patches.PatchSet()  # torch's globals: scaler, backward, clip, optimizer
        self._sample_hooks = patches.PatchSet()
        self._sampler = sampler
        # the sampled step's op probe: overflows hidden inside a module (opprobe.StepProbe)
        self._probe = StepProbe() if sampler is not None and op_probe else None
        self._probing = False  # its hooks are in place this step
        # ... and once more when the loss stops falling (flatloss.py): where the interval is
        # longer than the watch's first mark, so that a flat stretch may hold no sampled step
        if self._probe is not None and every > flatloss.FIRST:
            log.flat = flatloss.FlatLoss()
        self._clip_config: Optional[dict] = None  # the last clip's call, as last written
        # patch_clip's wrapper maker, until the first loss has looked for a library's clips
        self._clip_maker: Optional[Callable[[Callable, str], Callable]] = None
        self._schedules = Schedules(journal)
        # several losses or optimizers: each one's own curve (objectives.py)
        self.objectives = Objectives(journal, watched, log.constants)
        # optimizers that stepped inside a compiled region since the last eager hook
        self._compiled_steps: list = []
        self.fp8_trial: Any = None  # forensic/fp8trial.TrialAtClose: keeps each sampled step
        self.engines = engines.Engines(self)  # DeepSpeed's, Megatron-core's optimizer steps

    def fault(self, exc: BaseException, where: str) -> None:
        self._fault(exc, where)

    # -- attached, detached -------------------------------------------------------------------

    def attach(self) -> None:
        """Open every door (``patches``), hook the model (or discover it), begin step 0."""
        patches.patch_scaler(self.patches, self)
        patches.patch_own_found_inf(self.patches, self)
        patches.patch_backward(self.patches, self)
        patches.patch_autograd_grad(self.patches, self)
        self._clip_maker = patches.patch_clip(self.patches, self)
        patches.patch_library_clips(self.patches, self, self._clip_maker)
        patches.hook_optimizers(self.patches, self, self._compiled_steps)
        patches.patch_zero_grad(self.patches, self)
        patches.patch_module_compile(self.patches, self)
        patches.patch_module_state(self.patches)
        if self.forensics is not None:
            patches.patch_losses(self.patches, self, losscall.LOSSES)
        patches.patch_schedulers(self.patches, self)
        self.watched.attach(self, self.patches, self.log.follow)
        self.log.open(self.watched.device)
        self.begin_step(0)

    def detach(self) -> None:
        """Every hook and patch removed (twice is harmless)."""
        self._sample_hooks.remove()
        self._probing = False
        if self._probe is not None:
            self._probe.abort()  # (a fault inside a probed forward: the mode goes too)
        self.watched.detach()
        self.patches.remove()
        if self._sampler is not None:
            self._sampler.active = False

    def wind_up(self) -> None:
        """``close()``: a step whose ``update()`` never came ends now, and a skip still in
        flight is decided; a failure goes to ``fault``, as in a hook."""
        for where, finish in (("_catch_up", self._catch_up),
                              ("_end_step_without_update",
                               lambda: self._end_step_without_update(closing=True)),
                              ("_settle", self.skips.settle)):
            try:
                finish()
            except Exception as exc:  # noqa: BLE001 - as patches.guard
                self.fault(exc, where)

    # -- the model: discovery, root calls, module.compile() -----------------------------------

    def discover_pre(self, module: torch.nn.Module, args: tuple) -> None:
        """First step of a recorder given no model: the outermost module called with grad
        enabled that owns trainable parameters becomes a root (``Watched.enter``). A module
        whose recording fails here is skipped, not the recording (``_skip``)."""
        try:
            if self.watched.enter(module, self.log.step, args):
                self._discovered(module, args, {})
        except Exception as exc:  # noqa: BLE001 - one module's failure is not the run's
            self._skip(module, "discover_pre", exc)

    def _skip(self, module: torch.nn.Module, where: str, exc: BaseException) -> None:
        """A module failed to be recorded while discovered (no optimizer was seen training
        it yet): it is left out, the warning says so once, and the rest of the run is
        recorded. Strict mode raises, as ``fault`` does."""
        if self.journal.strict:
            raise exc
        self.watched.skip(module, where, exc)
        self.journal.warn_once("skipped", f"could not record {type(module).__name__} "
                               f"({where}: {type(exc).__name__}: {exc}); it is left out of "
                               "the recording, which goes on without it")

    def discover_post(self, module: torch.nn.Module, args: tuple, kwargs: dict,
                      output: Any) -> None:
        self.watched.leave(module)

    def _discovered(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """A root adopted in its own call: this call is seen from here."""
        self.engines.attach(self.patches)  # (an engine's backward comes next)
        self._maybe_sample()  # the first step is sampled, as with a model given to watch()
        self.root_pre(module, args, kwargs)

    def on_module_compile(self, module: torch.nn.Module) -> None:
        """``module.compile()``: its calls (hooks included) are compiled from now on, so the
        recorder sees them through an eager shim."""
        self.watched.on_module_compile(module)

    def compiled_pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Before a ``module.compile()``'d call (its forward pre-hooks would be compiled)."""
        if self._replaying():
            return
        if id(module) in self.watched.root_ids:
            self.root_pre(module, args, kwargs)
        elif self.watched.may_adopt(module, args) and self.watched.adopt_discovered(module):
            self._discovered(module, args, kwargs)

    def compiled_post(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if id(module) not in self.watched.root_ids or self._replaying():
            return
        sampler = self._sampler
        if self.log.step.sampled and sampler is not None and sampler.active:
            sampler.on_forward(module, output, args)
        self.root_post(module, args, output)

    def root_pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if id(module) not in self.watched.root_ids or self._replaying():
            return  # a copy of a root that kept our hooks (not copied by deepcopy): not it
        try:
            self._root_pre(module, args, kwargs)
        except Exception as exc:
            if not self.watched.discovery_open:
                raise
            # a root no optimizer was seen training yet: skipped, the recording goes on
            self._skip(module, "root_pre", exc)

    def _root_pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._compiled_steps and torch.is_grad_enabled():
            self._catch_up()
        if self.skips.undecided is not None and torch.is_grad_enabled():
            self.skips.settle()  # before this forward allocates, or changes a BatchNorm buffer
        if torch.is_grad_enabled():  # an evaluation call says nothing of the training dtype
            self.watched.note_autocast(self.log.step)
        if self.log.step.sampled and self._sampler is not None:
            self._sampler.on_inputs(self.watched.names.get(module, ""), args, kwargs)
        if self.forensics is not None and self.forensics.armed:
            self.forensics.capture_inputs(module, args, kwargs)
        probe = self._probe
        if probe is not None and self._probing and id(module) in self.watched.root_ids and \
                torch.is_grad_enabled():
            probe.enter(module, self.watched.names.get(module, ""))  # last: ours is done

    def root_post(self, module: torch.nn.Module, args: tuple, output: Any,
                  kwargs: Optional[dict] = None) -> None:
        if id(module) not in self.watched.root_ids:
            return
        if self.watched.ends_discovery_call(module) and self.forensics is not None and kwargs:
            self.forensics.capture_kwargs(module, kwargs)
        if self.forensics is not None and self.forensics.armed:
            self.forensics.capture_output(module, output)

    def after_loss(self, name: str, fn: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """A torch loss function returned (``patches.patch_losses``): the forensic tier holds
        the call for a replay to compute it again (references only, dropped at the step's
        end)."""
        if self.forensics is not None and self.forensics.armed:
            self.forensics.capture_loss_call(name, fn, args, kwargs, out)

    def _replaying(self) -> bool:
        """A forensic replay is re-running the model: none of its calls belong to the step."""
        return self.forensics is not None and self.forensics.replaying

    def on_scaler_init(self, scaler: Any) -> None:
        self.watched.scaler_created(scaler, self.log.step)

    def before_scheduler_step(self, scheduler: Any) -> None:
        """An LR scheduler steps: counted per optimizer step (``schedules.py``; no host read)."""
        self._schedules.seen(scheduler)

    # -- loss and backward --------------------------------------------------------------------

    def on_scale(self, scaler: Any, outputs: Any, out: Any) -> None:
        if not self.watched.uses_scaler(scaler) or not scaler_enabled(scaler):
            return
        self._catch_up()
        self._training()
        self._penalty_unscaled(self.log.step)
        self.log.step.scaled = True
        if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
            # counted as the step's loss when it is backwarded (before_backward): a scaled
            # output taken only through torch.autograd.grad (a gradient penalty's) is not one
            self.log.step.keep.append(out)
            self.log.step.unscaled_of.append(outputs)

    def after_autograd_grad(self, outputs: Any, create_graph: bool) -> None:
        """``torch.autograd.grad`` returned: of a scaled loss, with a graph to build a loss
        on (a gradient penalty), its gradients must be unscaled before that loss."""
        st = self.log.step
        if create_graph and any(scaledloss.from_any_scaled(t, st.keep)
                                for t in scaledloss.tensors(outputs)):
            st.flags |= flag(Event.PENALTY_AT_SCALE)
            if not st.scale_read:
                st.scaled_grads_pending = True

    def on_get_scale(self, scaler: Any) -> None:
        """The docs' ``g * (1. / scaler.get_scale())``, read after the step's first scaled
        loss: before or after ``autograd.grad``, the gradients can be unscaled with it."""
        if self.watched.uses_scaler(scaler):
            st = self.log.step
            st.scaled_grads_pending = False
            st.scale_read = st.scale_read or st.scaled

    def _penalty_unscaled(self, st: Step) -> None:
        """The step scales a loss after a penalty's gradients were taken of the scaled loss and
        never unscaled (no ``get_scale()`` since ``autograd.grad``): that penalty is the scale
        (squared, for a squared norm) times too large."""
        if st.scaled_grads_pending and not st.flags & flag(Event.SCALED_GRADS_IN_LOSS):
            self.journal.event(Event.SCALED_GRADS_IN_LOSS, st)
        st.scaled_grads_pending = False

    def before_backward(self, tensors: Any) -> None:
        items = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if any(placeholder(t) for t in items):
            return  # a copy on meta or fake tensors (a FLOP count): no micro-batch, no values
        self._catch_up()
        self._training()
        st = self.log.step
        st.micro += 1
        micro = Micro(self.watched.take_called()) if self.watched.discovery_open else None
        for t in items:
            if isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point():
                origin = scaledloss.origin(t, st.keep)  # (scaler.scale(loss), or that / n)
                if origin is not None:
                    loss = st.unscaled_of[origin]
                    if loss is not None:  # (backwarded twice, retain_graph: counted once)
                        st.unscaled_of[origin] = None
                        self._add_loss(loss, micro, scaled=True)
                    break
                self._add_loss(t, micro)
                if scaler_enabled(self.watched.scaler) and \
                        torch._C._current_graph_task_id() == -1:  # (not from a backward)
                    st.unscaled_backwards += 1
                break
        if micro is not None:
            st.ledger.append(micro)

    def _training(self) -> None:
        """A loss is seen: the previous step is decided, the file exists (lazy recorder), a
        step whose ``update()`` never came has ended."""
        self.skips.settle()
        if not self.journal.created:
            self.journal.create()
        if self._clip_maker is not None:  # a script imports its libraries before its first
            # loss: their clips are seen from now on
            patches.patch_library_clips(self.patches, self, self._clip_maker)
            self.engines.attach(self.patches)
            self._clip_maker = None
        self._end_step_without_update()

    def _add_loss(self, loss: torch.Tensor, micro: Optional[Micro],
                  scaled: bool = False) -> None:
        st = self.log.step
        # A DTensor loss (loss_parallel): its local value; reading the DTensor would be a
        # collective that a rank whose replay budget ran out earlier would not join.
        value = sharding.local(loss.detach()).reshape(()).float()
        st.loss_sum = value if st.loss_sum is None else st.loss_sum + value
        st.loss_n += 1
        slot = self.objectives.loss(value, loss)
        callorder.late_backward(st, scaled)
        if not st.loss_dtype:
            st.loss_dtype = stats.dtype_code(loss.dtype)
        if micro is not None:
            micro.value, micro.dtype, micro.slot = value, stats.dtype_code(loss.dtype), slot
        if self.forensics is not None and self.forensics.armed:
            self.forensics.capture_loss(loss, scaled)

    # -- gradients: the moment they are complete (before unscale_, clip or step) -------------

    def _grads_ready(self, fallback: Optional[list] = None) -> None:
        """Gradients are complete (first of unscale_, clip, step): sampled grad statistics,
        in scaled space under a scaler."""
        st = self.log.step
        if st.grads_ready:
            return
        st.grads_ready = True
        st.fallback = fallback
        if st.sampled and self._sampler is not None:
            params = self.watched.trained_params(fallback)
            self._sampler.on_grads_ready([(self.watched.param_name(p), p) for p in params])

    def _ensure_grad_norm(self) -> None:
        """The global grad norm, unscaled, computed as late as possible: when clip_grad_norm_
        ran, its own pre-clip norm is taken instead of a second pass over the gradients."""
        st = self.log.step
        if st.grad_norm is not None:
            return
        params = self.watched.trained_params(st.fallback)
        if self.watched.sharding is not None:  # no rank holds the whole gradient: its share
            share = self.watched.sharding.norm_share(params)
            if share is not None:
                st.grad_norm = self._unscaled(share)
                st.flags |= flag(Event.GRAD_NORM_LOCAL)
            return
        still = self._still_scaled(params)
        grads = [p.grad for p in params if p.grad is not None and stats.measurable(p.grad)
                 and id(p) not in still]
        left = [p.grad for p in params if id(p) in still and p.grad is not None
                and stats.measurable(p.grad)]
        if grads and left:  # several optimizers, some unscaled: each part in its own space
            scale = self.watched.scaler._scale
            rest = stats.global_norm(left) / scale.to(left[0].device).reshape(())
            st.grad_norm = torch.linalg.vector_norm(torch.stack(
                [stats.global_norm(grads), rest.to(grads[0].device)]))
        elif grads or left:
            st.grad_norm = self._unscaled(stats.global_norm(grads or left), scaled=bool(left))

    def _still_scaled(self, params: list[torch.Tensor]) -> set[int]:
        """ids of the parameters whose gradients are still scaled while another optimizer's
        were unscaled (``unscale_`` is per optimizer: the AMP docs' several-optimizers recipe
        unscales one, then steps each). Empty in the common case (one optimizer, or none or
        every one unscaled): Python sets only, no tensor read."""
        st = self.log.step
        opts = self.watched.optimizers
        if not st.unscaled or len(opts) < 2 or getattr(self.watched.scaler, "_scale", None) is None:
            return set()
        waiting = [o for o in opts if id(o) not in st.unscaled_by]
        if not waiting:
            return set()
        done = {id(p) for o in opts if id(o) in st.unscaled_by
                for g in o.param_groups for p in g["params"]}
        ours = {id(p) for p in params}
        return {id(p) for o in waiting for g in o.param_groups for p in g["params"]
                if id(p) not in done and id(p) in ours}

    def _unscaled(self, norm: torch.Tensor, scaled: bool = False) -> torch.Tensor:
        """``scaled``: the norm's gradients are known to be still scaled (``_still_scaled``)."""
        st = self.log.step
        scaler = self.watched.scaler
        if st.scaled and (scaled or not st.unscaled) and scaler is not None:
            scale = scaler._scale
            if scale is not None:
                return norm / scale.to(norm.device).reshape(())
        return norm

    def before_unscale(self, scaler: Any, optimizer: Any) -> None:
        if self.watched.uses_scaler(scaler):
            self.skips.settle()
            self.watched.owns(optimizer, through_scaler=True)
            st = self.log.step
            if unscaled_already(scaler, optimizer) and not st.flags & flag(Event.UNSCALE_TWICE):
                self.journal.event(Event.UNSCALE_TWICE, st)  # GradScaler raises next; this says why
            self._grads_ready()
            self.objectives.norm(optimizer, st, scaler)

    def after_unscale(self, scaler: Any, optimizer: Any) -> None:
        if self.watched.uses_scaler(scaler):
            self.log.step.unscaled = True
            callorder.unscaled(self.log.step, optimizer)
            if self.skips.armed and scaler_enabled(scaler):
                # Queued before GradScaler.step reads found_inf (non-fused optimizers):
                # its own sync lands this copy too.
                self.skips.stage_found(scaler, optimizer)

    def after_unscale_grads(self, scaler: Any, optimizer: Any, found: Any) -> None:
        """``_unscale_grads_`` returned this rank's found_inf per device. A scaler that
        combines it across ranks (``sharding.combines_found_inf``: ShardedGradScaler's
        ``unscale_`` all-reduces it in place next) has it copied now, on the device; the
        drain reads it with the step's other values (``Event.OWN_NONFINITE_GRAD``)."""
        if not isinstance(found, dict) or not found or not self.watched.uses_scaler(scaler) \
                or not sharding.combines_found_inf(scaler):
            return
        flags = list(found.values())
        dev = flags[0].device
        own = torch.stack([f.to(dev).reshape(()).float() for f in flags]).sum()  # a copy
        st = self.log.step
        st.own_found_inf = own if st.own_found_inf is None else st.own_found_inf + own.to(
            st.own_found_inf.device)

    def before_clip(self, parameters: Any, config: Optional[dict] = None) -> None:
        """``config``: the clip function, max_norm (or clip_value), norm_type, foreach as
        called (``patches.clip_config``), kept in /meta ``clip`` whenever it changes (Python
        values only: no host read)."""
        self.skips.settle()
        st = self.log.step
        if config is not None and config != self._clip_config:
            self._clip_config = config
            self.journal.meta("clip", config, st.index)
        if st.scaled and not st.unscaled and scaler_enabled(self.watched.scaler):
            if not st.flags & flag(Event.CLIP_BEFORE_UNSCALE):  # one event row per step
                self.journal.event(Event.CLIP_BEFORE_UNSCALE, st)
        params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
        self._grads_ready(fallback=params)
        self.objectives.norms_before_clip(params, st, self.watched.scaler)
        if config is not None and config.get("how") in ("clip_grad_value_",
                                                         "adaptive_clip_grad"):
            self._ensure_grad_norm()  # it returns no norm: the pre-clip one is taken now

    def after_clip(self, total_norm: Any, combined: bool = False) -> None:
        """``total_norm``: the pre-clip norm (``clip_grad_norm_``'s result, the ``total_norm``
        given to ``clip_grads_with_norm_``); ``combined``: FSDP1's ``model.clip_grad_norm_``
        returned it (a global norm)."""
        if isinstance(total_norm, torch.Tensor):
            st = self.log.step
            st.clip_norm, whole = sharding.clip_result(total_norm, self.watched.sharding,
                                                       combined)
            share = flag(Event.GRAD_NORM_LOCAL)
            if st.grad_norm is None or (whole and st.flags & share):  # a global norm wins
                st.grad_norm = self._unscaled(st.clip_norm)
                st.flags = (st.flags & ~share) | (0 if whole else share)

    # -- optimizer and scaler steps -----------------------------------------------------------

    def enter_scaler_step(self, scaler: Any, optimizer: Any) -> None:
        if self.watched.uses_scaler(scaler):
            self.skips.settle()
            self.watched.owns(optimizer, through_scaler=True)
            callorder.stepping(self.log.step, optimizer)
            self._grads_ready()
            self.objectives.stepping(optimizer)

    def exit_scaler_step(self, scaler: Any, optimizer: Any) -> None:
        if scaler is self.watched.scaler:
            self.log.step.in_scaler_step = False

    def before_optimizer_step(self, optimizer: Any) -> None:
        if self.engines.stepping or not self.watched.owns(optimizer):  # (an engine's: its own)
            return
        self.skips.settle()
        if not self.journal.created:
            self.journal.create()
        st = self.log.step
        scaler = self.watched.scaler
        if not st.scaled and self.watched.primary(optimizer):
            self._settle_discovery()  # (this step ends the step)
        if st.scaled and not st.in_scaler_step:
            st.flags |= flag(Event.STEP_BYPASSES_SCALER)
            self.journal.event(Event.STEP_BYPASSES_SCALER, st, text=type(optimizer).__name__)
        elif st.in_scaler_step and self.skips.armed and scaler_enabled(scaler):
            # A fused optimizer: GradScaler checked found_inf and syncs on nothing; the copy
            # is queued ahead of the fused step's kernels.
            self.skips.stage_found(scaler, optimizer)
        self._grads_ready()
        self._ensure_grad_norm()
        self.objectives.norm(optimizer, st, scaler)
        self.objectives.stepping(optimizer)
        if not st.scaled and self.watched.primary(optimizer):
            self.skips.check_before_step()
        elif st.in_scaler_step and self.skips.armed and scaler_enabled(scaler):
            self.skips.check_applied_loss()
        if st.sampled and self._sampler is not None:
            self._sampler.before_step([(self.watched.param_name(p), p)
                                       for p in self.watched.trained_params()])
        if self.forensics is not None and self.forensics.armed and \
                self.watched.primary(optimizer):
            self.forensics.lrrange.before_step(optimizer, st.index, self._clip_config)

    def after_optimizer_step(self, optimizer: Any) -> None:
        if self.engines.stepping or not self.watched.owns(optimizer):
            return
        st = self.log.step
        st.stepped = True
        st.bypassed = st.bypassed or not st.in_scaler_step
        self.watched.stepped(optimizer)
        self.objectives.stepped(optimizer)
        if not st.scaled and self.watched.primary(optimizer):
            if st.sampled and self._sampler is not None:
                self._sampler.after_step()
            self._end_step()
        elif st.sampled and self._sampler is not None:
            self._sampler.after_step()

    def before_zero_grad(self, optimizer: Any) -> None:
        """``optimizer.zero_grad()``: the last eager moment at which a step taken inside a
        compiled region still has its gradients."""
        self._catch_up()
        self.objectives.zeroed_optimizer(optimizer)

    def before_module_zero_grad(self, module: torch.nn.Module) -> None:
        """``module.zero_grad()``: the gradients of a loss backwarded before it do not reach
        an optimizer that steps after it (objectives.py)."""
        self.objectives.zeroed_module(module)

    def _catch_up(self) -> None:
        """Optimizer steps taken inside a compiled region (``patches.hook_optimizers``), told
        now: the step's gradient norm from the gradients as they still are, and its end. No
        forensic check: the weights have already moved, a replay would not be faithful."""
        while self._compiled_steps:
            optimizer = self._compiled_steps.pop(0)
            if not self.watched.owns(optimizer):
                continue
            if not self.journal.created:
                self.journal.create()
            st = self.log.step
            if not st.scaled:
                self._grads_ready()
                self._ensure_grad_norm()
            self.after_optimizer_step(optimizer)

    def _end_step_without_update(self, closing: bool = False) -> None:
        """A scaled step whose optimizer stepped but whose ``scaler.update()`` never came (a
        loop that calls ``optimizer.step()`` itself): the next loss closes it. A step taken
        through ``scaler.step`` waits for its ``update()``: the AMP docs' several-optimizers
        loop (a GAN: the discriminator's loss and step, then the generator's, one update) is
        one step, not one per optimizer. ``closing``: the recorder closes, and a step that
        stepped ends whichever way it stepped."""
        st = self.log.step
        if st.scaled and st.stepped and (st.bypassed or closing) and not st.in_scaler_step:
            scale = getattr(self.watched.scaler, "_scale", None)
            if scale is not None and st.scale is None:
                st.scale = st.scale_after = scale.detach().reshape(()).clone()
            self._end_step()

    def before_update(self, scaler: Any) -> None:
        if not self.watched.uses_scaler(scaler) or not scaler_enabled(scaler):
            return
        self._settle_discovery()  # (every optimizer of the step has been through the scaler)
        self.skips.settle()
        st = self.log.step
        self._ensure_grad_norm()
        if scaler._scale is not None:
            st.scale = scaler._scale.detach().reshape(()).clone()  # update() changes it in place
        found = found_inf(scaler)
        if found is not None:
            st.found_inf = found
        self.objectives.found(scaler)
        if self.skips.armed:
            self.skips.at_update(scaler, st)

    def after_update(self, scaler: Any) -> None:
        st = self.log.step
        if scaler is not self.watched.scaler or not scaler_enabled(scaler) or not st.scaled:
            return
        if scaler._scale is not None:  # stacked by _end_step right away: a view is enough
            st.scale_after = scaler._scale.detach().reshape(())
        self._end_step()

    # -- step boundaries ----------------------------------------------------------------------

    def begin_engine_step(self, params: list) -> None:
        """An engine's optimizer step begins (``engines.py``): on a sampled step, the
        weights before it (``params``: the model's, not the engine's copies)."""
        if self.log.step.sampled and self._sampler is not None:
            self._sampler.before_step([(self.watched.param_name(p), p) for p in params])

    def end_engine_step(self, fill: Callable[[Step], None]) -> None:
        """An engine's optimizer step has ended (``engines.py``: DeepSpeed's, a Megatron-core
        scaler's skip): ``fill(step)`` sets what it reported, and the step ends."""
        self.skips.settle()
        self._settle_discovery()
        st = self.log.step
        fill(st)
        if st.sampled and self._sampler is not None and st.stepped:
            self._sampler.after_step()
        self._end_step()

    def begin_step(self, index: int) -> None:
        self.log.begin(index)
        self.watched.depth = 0
        if self.forensics is not None:
            self.forensics.begin_step()
        if self.watched.roots:
            self._maybe_sample()

    def _maybe_sample(self) -> None:
        """Turn the sampled tier on for this step if it is due (before its first forward): at
        the interval, or because the loss has not fallen for a while (``_flat_due``)."""
        st = self.log.step
        sampler = self._sampler
        if sampler is None or st.sampled or self.every <= 0 or st.micro:
            return
        flat = self._flat_due()
        if st.index % self.every and flat is None:
            return
        st.sampled = True
        if flat is not None:  # (a step due at the interval anyway is probed for both reasons)
            self.journal.event(Event.FLAT_LOSS_PROBE, st, value=flat["recent"] / flat["start"],
                               text=FlatLossProbe(flat).to_json())
        sampler.active = True
        eager = self.watched.eager
        if eager is None:
            patches.hook_modules(self._sample_hooks, self, None, "sample_post")
            if self._probe is not None and self.watched.sharding is None:
                # (not inside compiled regions, nor on a DTensor's shards)
                patches.hook_module_calls(self._sample_hooks, self, "probe_pre", "probe_post")
                self._probing = True
            return
        for m in eager:  # a compiled model: only modules that run outside its regions
            self._sample_hooks.add(m.register_forward_hook(
                lambda m, a, o: patches.guard(self, "sample_post", m, a, o)))

    def _flat_due(self) -> Optional[dict]:
        """The flat-loss watch's probe, if one is armed and the op probe can run this step
        (not on a compiled model's regions nor on a DTensor's shards: there it is dropped)."""
        watch = self.log.flat
        if watch is None or watch.due is None:
            return None
        due = watch.take()
        if self._probe is None or self.watched.eager is not None or \
                self.watched.sharding is not None:
            return None
        return due

    def sample_post(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._replaying() or self._sampler is None:
            return
        probe = self._probe
        if probe is not None:
            probe.busy += 1  # our own work inside a probed forward is not the model's
        try:
            if id(module) not in self.watched.root_ids and module in self.watched.names:
                self.watched.note_inner_autocast(self.log.step)
            self._sampler.on_forward(module, output, args)
        finally:
            if probe is not None:
                probe.busy -= 1

    def probe_pre(self, module: torch.nn.Module, args: tuple) -> None:
        name = self.watched.names.get(module)
        if self._probe is not None and name is not None and not self._replaying():
            self._probe.open_call(module, name)

    def probe_post(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._probe is not None and module in self.watched.names and not self._replaying():
            self._probe.close_call(module, output)
            self._probe.leave(module)

    def _settle_discovery(self) -> None:
        """The first step's optimizers are known (its end, or the update or step that ends
        it, before the forensic tier looks at it): only the roots they train are kept
        (``Watched.finish_discovery``). A root dropped takes its micro-batches out of the step
        (a model built, run and dropped before the real one): the step's loss is the real
        one's, and its sampled statistics, named while that root was there, are not kept."""
        if not self.watched.discovery_open:
            return
        st = self.log.step
        losses = drop_micro(st, self.watched.finish_discovery())
        if losses is None:
            return
        self.objectives.rewind([(m.slot, m.value) for m in losses if m.value is not None])
        if self.forensics is not None:
            self.forensics.keep_roots(self.watched.root_ids)
        if st.sampled and self._sampler is not None:
            self._unsample(st, self._sampler)

    def _unsample(self, st: Step, sampler: Sampler) -> None:
        """The step is not sampled after all: its statistics so far are dropped."""
        self._sample_hooks.remove()
        sampler.active = False
        sampler.reset()
        st.sampled = False
        if self._probe is not None and self._probing:
            self._probe.abort()
        self._probing = False

    def _end_step(self) -> None:
        st = self.log.step
        if self.skips.undecided is not None and self.skips.undecided is not st:
            self.skips.settle()  # a step with no hook of ours between: decided before this ends
        self._settle_discovery()
        if st.index == 0:
            self.watched.name_handles(sys._getframe())
        self.watched.fp16_without_scaler(st)
        callorder.step_events(self.journal, st)
        self._schedules.end_step(st)
        now = time.perf_counter()
        self.log.finish(st, self.objectives.end_step(st))
        if st.sampled and self._sampler is not None:
            self._sample_hooks.remove()
            self._sampler.active = False
            self._drain_sampled(self._sampler, st)
            if self.fp8_trial is not None and self.forensics is not None:
                self.fp8_trial.keep(st.index, self.forensics.captures)
        if self.forensics is not None:
            self.forensics.end_step(st, hold=st.undecided)
        st.keep.clear()
        st.unscaled_of.clear()
        st.fallback = None
        self.skips.ended(st)
        if self.log.due(now):
            self.log.drain()
        self.begin_step(st.index + 1)
        if self.skips.undecided is not None:
            self.skips.settle(wait=False)  # landed already: release its captures at once

    def _drain_sampled(self, sampler: Sampler, st: Any) -> None:
        """The sampled step's drain: its statistics, its parameter probe and the op probe's
        measurements read in one copy per device (``readback.HostRead``), then written: the
        /stats rows, and one /events row per module whose output stayed finite although an op
        inside it made inf/NaN."""
        names = self.watched.names
        sampler.on_buffers([(f"{names[m]}.{n}", b) for m in list(names)
                            for n, b in m.named_buffers(recurse=False)])
        read = HostRead()
        fp8 = self._stage_fp8(sampler, st.index, read)
        rows = sampler.stage(st.index, read)
        probe, self._probing = self._probe, False
        hidden = None
        if probe is not None:
            probe.abort()
            if probe.error is None:
                hidden = probe.stage(read)
        read.run()
        self.journal.file.append("stats", rows())
        if fp8 is not None:
            fp8_rows = fp8()
            self.journal.file.append("fp8", fp8_rows)
            if self.fp8_trial is not None:
                self.fp8_trial.rank(fp8_rows)
            if sampler.fp8 is not None and sampler.fp8.layers_changed:
                sampler.fp8.layers_changed = False
                self.journal.meta("fp8_layers", dict(sampler.fp8.layers), st.index)
        if probe is not None and probe.error is not None:  # the probe stepped aside; the
            self._probe = None                              # recorder goes on
            if self.journal.strict:
                raise probe.error
            why = f"{type(probe.error).__name__}: {probe.error}"
            self.journal.warn_once("op_probe", f"the op probe stopped ({why}); sampled steps go "
                                   "on without it")
        for h in hidden() if hidden is not None else []:
            tid = self.journal.tensor_id(Kind.OUTPUT, h.name, 0, None, type(h.module).__name__)
            self.journal.event(Event.HIDDEN_NONFINITE, st, tensor=tid, value=float(h.created),
                               text=HiddenNonfinite(op=h.op, dtype=h.dtype, inner=h.inner,
                                                    index=h.index, ops=h.ops).to_json())

    def _stage_fp8(self, sampler: Sampler, step: int, read: HostRead) -> Any:
        """The /fp8 rows of the step staged in ``read``; None where the fp8 counts are off or
        stepped aside (an internal failure: warned once, the sampled tier goes on)."""
        if sampler.fp8 is None:
            return None
        try:
            return sampler.fp8.stage(step, read)
        except Exception as exc:  # noqa: BLE001 - the fp8 counts must never stop the recording
            sampler.fp8 = None
            if self.journal.strict:
                raise
            self.journal.warn_once("fp8", f"the fp8 counts stopped ({type(exc).__name__}: "
                                   f"{exc}); sampled steps go on without them")
            return None
