"""The recorder's hooks: small callbacks in four groups over one shared step log, each handed to
the door that calls it (``patches``) as torch's ``register_*_hook(fn)`` takes a hook.

The groups, each a class of its own module:

- ``scalerhooks.ScalerHooks``: GradScaler's methods (``patch_scaler``, ``patch_own_found_inf``,
  ``get_scale``);
- ``modulehooks.ModuleHooks``: module calls (discovery, each root's own hooks, compiled roots);
- ``losshooks.LossHooks``: backward, the torch loss functions, ``torch.autograd.grad``;
- ``optimizerhooks.OptimizerHooks``: the optimizer step, the clips, ``zero_grad``, the LR
  schedulers;

over ``stepflow.StepFlow`` (the step log they share, and the step boundaries), with the sampled
step's own hooks in ``sampledstep.SampledStep`` and the gradients in ``gradnorm.GradNorms``.
``patches`` calls each callback through ``guard``: an exception in one goes to ``fault`` (the
recorder steps aside), never to the training loop.

The order of one scaled step, and the group of each hook::

    root_pre             module   autocast state; the batch (sampled tier, forensic capture)
    after_loss           loss     a torch loss function's call (forensic capture)
    on_scale             scaler   the loss as given to scale(); the file created (lazy)
    before_backward      loss     a micro-batch (and the loss, without a scaler)
    before_unscale       scaler   gradients complete: sampled gradient statistics
    after_unscale_grads  scaler   this rank's own found_inf (ShardedGradScaler)
    after_unscale        scaler   found_inf staged for the skip decision
    before_clip / after_clip                 optimizer   the clip config, the pre-clip norm
    enter_scaler_step / exit_scaler_step     scaler
    before_optimizer_step / after_optimizer_step  optimizer
    before_update        scaler   scale, found_inf, grad norm; the skip decided (or deferred)
    after_update         scaler   the scale after; the step ends
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from . import patches
from .forensic import losscall
from .forensic.forensics import Forensics
from .gradnorm import GradNorms
from .journal import Journal
from .listener import ModelDoor
from .losshooks import LossHooks
from .modulehooks import ModuleHooks
from .optimizerhooks import OptimizerHooks
from .sampledstep import SampledStep
from .sampler import Sampler
from .scalerhooks import ScalerHooks
from .skips import Skips
from .stepflow import StepFlow
from .steplog import StepLog
from .watched import Watched


class Hooks:
    """The hook groups of one recorder, attached and detached together; ``fault(exc, where)``
    is the recorder's."""

    def __init__(self, journal: Journal, watched: Watched, log: StepLog, skips: Skips, *,
                 sampler: Optional[Sampler], forensics: Optional[Forensics], every: int,
                 fault: Callable[[BaseException, str], None], op_probe: bool = True):
        self.log = log
        self.fault = fault
        grads = GradNorms(watched, log, sampler)
        self.sampled = SampledStep(journal, watched, log, sampler, every=every, fault=fault,
                                   replaying=self._replaying, op_probe=op_probe)
        self.flow = StepFlow(journal, watched, log, skips, sampled=self.sampled, grads=grads,
                             forensics=forensics, fault=fault)
        self.optimizer = OptimizerHooks(self.flow)
        self.scaler = ScalerHooks(self.flow, self.optimizer)
        self.loss = LossHooks(self.flow, self.optimizer)
        self.modules = ModuleHooks(self.flow, self.optimizer)

    def _replaying(self) -> bool:
        return self.flow.replaying()

    @property
    def fp8_trial(self) -> Any:
        """``forensic/fp8trial.TrialAtClose``: keeps each sampled step (None: no trial)."""
        return self.sampled.fp8_trial

    @fp8_trial.setter
    def fp8_trial(self, trial: Any) -> None:
        self.sampled.fp8_trial = trial

    def model_door(self) -> ModelDoor:
        """The callbacks ``Watched`` hooks as it finds the model."""
        m, o = self.modules, self.optimizer
        return ModelDoor(fault=self.fault, discover_pre=m.discover_pre,
                         discover_post=m.discover_post, root_pre=m.root_pre,
                         root_post=m.root_post, compiled_pre=m.compiled_pre,
                         compiled_post=m.compiled_post, scaler=self.scaler.door,
                         after_unscale_grads=self.scaler.after_unscale_grads,
                         before_clip=o.before_clip, after_clip=o.after_clip)

    def attach(self) -> None:
        """Open every door (``patches``), hook the model (or discover it), begin step 0."""
        flow, fault = self.flow, self.fault
        ps, scaler, loss, opt = flow.patches, self.scaler, self.loss, self.optimizer
        patches.patch_scaler(ps, scaler.door)
        patches.patch_own_found_inf(ps, fault, scaler.after_unscale_grads)
        patches.patch_backward(ps, fault, loss.before_backward)
        patches.patch_autograd_grad(ps, fault, loss.after_autograd_grad, scaler.on_get_scale)
        flow.clip_maker = patches.patch_clip(ps, fault, opt.before_clip, opt.after_clip)
        patches.patch_library_clips(ps, flow.clip_maker)
        patches.hook_optimizers(ps, fault, opt.before_optimizer_step, opt.after_optimizer_step,
                                flow.compiled_steps)
        patches.patch_zero_grad(ps, fault, opt.before_zero_grad, opt.before_module_zero_grad)
        patches.patch_module_compile(ps, fault, self.modules.on_module_compile)
        patches.patch_module_state(ps)
        if flow.forensics is not None:
            patches.patch_losses(ps, fault, loss.after_loss, losscall.LOSSES)
        patches.patch_schedulers(ps, fault, opt.before_scheduler_step)
        flow.watched.attach(self.model_door(), ps, self.log.follow)
        self.log.open(flow.watched.device)
        flow.begin_step(0)

    def detach(self) -> None:
        """Every hook and patch removed (twice is harmless)."""
        self.sampled.detach()
        self.flow.watched.detach()
        self.flow.patches.remove()

    def wind_up(self) -> None:
        """``close()``: a step whose ``update()`` never came ends now, and a skip still in
        flight is decided; a failure goes to ``fault``, as in a hook."""
        flow = self.flow
        for where, finish in (("_catch_up", self.optimizer.catch_up),
                              ("_end_step_without_update",
                               lambda: flow.end_step_without_update(closing=True)),
                              ("_settle", flow.skips.settle)):
            try:
                finish()
            except Exception as exc:  # noqa: BLE001 - as patches.guard
                self.fault(exc, where)
