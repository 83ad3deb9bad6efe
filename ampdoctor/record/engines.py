"""Optimizer steps an engine takes for the script, seen with no change to it: DeepSpeed's engine
and Megatron-core's grad scalers. Each fills the /steps columns a GradScaler fills (the loss
scale before and after, found_inf and so the skip, this rank's own found_inf before the ranks'
flags are combined, the global grad norm, the LR), so every verdict reads them unchanged.

Nothing here imports deepspeed or megatron: each is patched once the script has imported it
(``Engines.attach``, at the run's first loss, where the hooks look for libraries' clips too),
with the recorder's ``PatchSet``, so that closing the recorder puts everything back.

DeepSpeed (``deepspeed.runtime.engine.DeepSpeedEngine``):

* ``backward(loss)``: the loss as the script gave it is the step's loss. The tensor the engine
  backwards is it divided by the accumulation steps and, in fp16, times the loss scale;
  ``scaledloss`` maps it back (as it does ``scaler.scale(loss)``).
* ``_take_model_step``: the engine's optimizer step. The optimizers it steps inside are its
  own (the hooks leave them alone while ``stepping``). The step ends after the first torch
  optimizer step inside it (so the LR is the one it ran with, before the engine's scheduler
  steps), or, where the engine skipped it on an overflow (no optimizer step), as it returns.
* the overflow check each rank makes before the ranks' flags are all-reduced
  (``DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial`` and
  ``has_overflow_serial``, ``runtime.utils.CheckOverflow.has_overflow_serial``): this rank's
  own found_inf (``Event.OWN_NONFINITE_GRAD``).

A bf16 or fp32 engine has no loss scale (its static 1.0 is not one): the scale columns stay
NaN, and found_inf is its optimizer's overflow flag where it has one. An engine that scales
with torch's own GradScaler (``torch_autocast`` in fp16 without ZeRO) is recorded through the
GradScaler's doors, as any GradScaler is, and is left alone here.

Megatron-core (``megatron.core.optimizer``):

* ``MegatronGradScaler.update(found_inf)`` of every subclass (``DynamicGradScaler``,
  ``ConstantGradScaler``): the scale before and after, found_inf. A step it skips (no
  optimizer step follows) ends there; an applied one ends at its optimizer's step (below, or
  a torch optimizer's step over the model's parameters where no Megatron optimizer steps).
* ``MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan``: this rank's found_inf,
  copied as the method hands it to ``torch.distributed.all_reduce`` (put back on return).
* ``MegatronOptimizer.scale_loss``: the loss before it was scaled is the step's loss.
* ``MixedPrecisionOptimizer.step_with_ready_grads`` after an update that found no inf: the
  applied step, the engine's own (its inner torch optimizer steps fp32 main copies of the
  parameters, not the model's), ended as it returns; the grad norm is the main gradients'.

Every callback runs through ``_safely``: a failure of ours goes to the recorder's ``fault``
(which steps aside), never to the training loop.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Optional, Protocol

import torch
import torch.optim.optimizer as optimizer_hooks

from . import stats
from .listener import Fault
from .patches import Patch, PatchSet, subclasses
from .steplog import StepLog
from .steps import Step
from .watched import Watched

DEEPSPEED = "deepspeed.runtime.engine"
DEEPSPEED_OVERFLOW = (("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer",
                       ("has_overflow_partitioned_grads_serial", "has_overflow_serial")),
                      ("deepspeed.runtime.utils", "CheckOverflow", ("has_overflow_serial",)))
MEGATRON_SCALERS = "megatron.core.optimizer.grad_scaler"
MEGATRON_OPTIMIZER = "megatron.core.optimizer.optimizer"


class StepEnds(Protocol):
    """What the engines' doors need of the step log they fill (``stepflow.StepFlow``)."""

    log: StepLog
    watched: Watched
    fault: Fault

    def begin_engine_step(self, params: list) -> None: ...

    def end_engine_step(self, fill: Callable[[Step], None]) -> None: ...


class Engines:
    """The engines' doors of one recorder's step log (``stepflow.StepFlow``, which ends their
    steps: ``end_engine_step``)."""

    def __init__(self, hooks: StepEnds):
        self.hooks = hooks
        self._stepping = False  # inside a DeepSpeed engine's optimizer step
        self._patched: set[str] = set()
        self._engine: Any = None
        self._ended = False  # the engine's step has ended already (its inner optimizer step)
        self._grad_norm: Optional[torch.Tensor] = None  # of a plain torch optimizer's gradients
        self._own: Optional[torch.Tensor] = None  # this rank's own found_inf, this step
        self._applying = False  # a Megatron scaler's update found no inf: the step applies

    @property
    def stepping(self) -> bool:
        """Is an optimizer stepping now the engine's own? Inside its step, and before the
        run's first loss inside DeepSpeed's own code (``deepspeed.initialize`` steps its
        optimizer once on zero gradients to make its state)."""
        log = self.hooks.log
        return self._stepping or (log.steps == 0 and not log.step.micro
                                  and DEEPSPEED in sys.modules and _inside_deepspeed())

    def attach(self, patch_set: PatchSet) -> None:
        """Patch the engines whose modules the script has imported (each once)."""
        for name, patch in ((DEEPSPEED, self._patch_deepspeed),
                            (MEGATRON_SCALERS, self._patch_megatron_scalers),
                            (MEGATRON_OPTIMIZER, self._patch_megatron_optimizer)):
            module = sys.modules.get(name)
            if module is not None and name not in self._patched:
                self._patched.add(name)
                patch(patch_set, module)

    def _safely(self, where: str, fn: Callable, *args: Any) -> Any:
        if torch.compiler.is_compiling():
            return None
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - a debugger must never break the run it watches
            self.hooks.fault(exc, where)
            return None

    # -- DeepSpeed ----------------------------------------------------------------------------

    def _patch_deepspeed(self, patch_set: PatchSet, module: Any) -> None:
        cls = getattr(module, "DeepSpeedEngine", None)
        if cls is None or "_take_model_step" not in cls.__dict__:
            return
        tap = self

        def backward(orig):
            @functools.wraps(orig)
            def wrapper(engine, loss, *args, **kwargs):
                if not _autocast_scaler(engine):
                    tap._safely("deepspeed_backward", tap._given_loss, loss)
                return orig(engine, loss, *args, **kwargs)
            return wrapper

        def take_model_step(orig):
            @functools.wraps(orig)
            def wrapper(engine, *args, **kwargs):
                if _autocast_scaler(engine) or tap._stepping:  # (torch's GradScaler: its doors)
                    return orig(engine, *args, **kwargs)
                tap._safely("deepspeed_step", tap._begin, engine)
                try:
                    return orig(engine, *args, **kwargs)
                finally:
                    tap._stepping = False
                    tap._safely("deepspeed_step", tap._end, engine)
            return wrapper

        patch_set.add(Patch(cls, "backward", backward))
        patch_set.add(Patch(cls, "_take_model_step", take_model_step))
        patch_set.add(optimizer_hooks.register_optimizer_step_post_hook(
            lambda optimizer, args, kwargs: self._safely("deepspeed_step", self._inner_stepped)))
        for name, cls_name, methods in DEEPSPEED_OVERFLOW:
            owner = getattr(sys.modules.get(name), cls_name, None)
            for method in methods:
                if owner is not None and method in owner.__dict__:
                    patch_set.add(Patch(owner, method, self._own_check))

    def _own_check(self, orig: Callable) -> Callable:
        """A rank's overflow check before the all-reduce: its result is this rank's own."""
        tap = self

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            out = orig(*args, **kwargs)
            if tap._stepping:
                tap._safely("deepspeed_overflow", tap._own_found, out)
            return out
        return wrapper

    def _given_loss(self, loss: Any) -> None:
        """``engine.backward(loss)``: the loss to count for what the engine backwards."""
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.grad_fn is not None:
            st = self.hooks.log.step
            st.keep.append(loss)
            st.unscaled_of.append(loss)

    def _begin(self, engine: Any) -> None:
        """The engine's optimizer step begins: its optimizer adopted (the LR), the loss scale
        the step's gradients carry, the gradient norm of a plain torch optimizer's
        parameters (the engine zeroes them before it returns)."""
        self._stepping, self._engine, self._ended, self._own = True, engine, False, None
        self._grad_norm = None
        optimizer = _torch_optimizer(engine)
        if optimizer is not None:
            self.hooks.watched.adopt_optimizer(optimizer)
        self.hooks.begin_engine_step([p for p in engine.module.parameters() if p.requires_grad])
        st = self.hooks.log.step
        scale = _loss_scale(engine)
        st.scale = None if scale is None else torch.tensor(scale, dtype=torch.float32)
        if not hasattr(engine.optimizer, "_global_grad_norm"):
            grads = [p.grad for p in engine.module.parameters()
                     if p.grad is not None and stats.measurable(p.grad)]
            self._grad_norm = stats.global_norm(grads) if grads else None

    def _inner_stepped(self) -> None:
        """A torch optimizer stepped inside the engine's step: the step applied, ended now
        (before the engine's LR scheduler steps)."""
        if self._stepping and not self._ended and self._engine is not None:
            self._ended = True
            self.hooks.end_engine_step(functools.partial(self._fill, self._engine, True))

    def _end(self, engine: Any) -> None:
        """The engine's step returned: ended here if no optimizer stepped inside it."""
        if not self._ended:
            self._ended = True
            self.hooks.end_engine_step(functools.partial(self._fill, engine, False))
        self._engine = None

    def _fill(self, engine: Any, applied: bool, st: Step) -> None:
        optimizer = engine.optimizer
        overflow = getattr(optimizer, "overflow", None)
        if isinstance(overflow, bool):
            st.found_inf = torch.tensor(float(overflow))
        if st.scale is not None:
            scale = _loss_scale(engine)
            st.scale_after = None if scale is None else torch.tensor(scale, dtype=torch.float32)
        norm = getattr(optimizer, "_global_grad_norm", None)
        norm = self._grad_norm if norm is None else norm
        if isinstance(norm, (int, float)):
            norm = torch.tensor(float(norm))
        if isinstance(norm, torch.Tensor):
            st.grad_norm = norm.detach().reshape(-1)[0].float()
        if self._own is not None:
            st.own_found_inf = self._own
        st.stepped = applied and not overflow

    def _own_found(self, flag: Any) -> None:
        """This rank's overflow flag (a tensor, or a bool the check has read), summed over
        the checks of the step."""
        if isinstance(flag, torch.Tensor):
            own = flag.detach().reshape(-1).float().sum()  # (a new tensor: no read)
        elif isinstance(flag, bool):
            own = torch.tensor(float(flag))
        else:
            return
        self._own = own if self._own is None else self._own + own.to(self._own.device)

    # -- Megatron-core ------------------------------------------------------------------------

    def _patch_megatron_scalers(self, patch_set: PatchSet, module: Any) -> None:
        base = getattr(module, "MegatronGradScaler", None)
        if base is None:
            return
        tap = self

        def update(orig):
            @functools.wraps(orig)
            def wrapper(scaler, found_inf, *args, **kwargs):
                before = tap._safely("megatron_update", _scale_of, scaler)
                out = orig(scaler, found_inf, *args, **kwargs)
                tap._safely("megatron_update", tap._updated, scaler, before, found_inf)
                return out
            return wrapper

        for cls in subclasses(base):
            if "update" in cls.__dict__:
                patch_set.add(Patch(cls, "update", update))

    def _updated(self, scaler: Any, before: Optional[torch.Tensor], found_inf: Any) -> None:
        """A Megatron scaler's ``update(found_inf)``: the step's scale and found_inf; a
        skipped step ends now (no optimizer step follows)."""
        def fill(st: Step) -> None:
            st.scale, st.scale_after = before, _scale_of(scaler)
            st.found_inf = found_inf.detach().reshape(-1)[0].float() if isinstance(
                found_inf, torch.Tensor) else torch.tensor(float(bool(found_inf)))
            if self._own is not None:
                st.own_found_inf, self._own = self._own, None

        if found_inf is True:
            self.hooks.end_engine_step(fill)
        else:
            fill(self.hooks.log.step)
            self._applying = True

    def _patch_megatron_optimizer(self, patch_set: PatchSet, module: Any) -> None:
        mixed = getattr(module, "MixedPrecisionOptimizer", None)
        base = getattr(module, "MegatronOptimizer", None)
        tap = self

        def check(orig):
            @functools.wraps(orig)
            def wrapper(optimizer, *args, **kwargs):
                dist = torch.distributed
                reduce = dist.all_reduce

                @functools.wraps(reduce)
                def copying(tensor, *a, **k):
                    if tensor is getattr(optimizer, "found_inf", None):
                        tap._safely("megatron_found_inf", tap._own_found, tensor.clone())
                    return reduce(tensor, *a, **k)

                dist.all_reduce = copying
                try:
                    return orig(optimizer, *args, **kwargs)
                finally:
                    if dist.all_reduce is copying:
                        dist.all_reduce = reduce
            return wrapper

        def scale_loss(orig):
            @functools.wraps(orig)
            def wrapper(optimizer, loss, *args, **kwargs):
                out = orig(optimizer, loss, *args, **kwargs)
                tap._safely("megatron_scale_loss", tap._scaled_loss, loss, out)
                return out
            return wrapper

        def ready(orig):
            @functools.wraps(orig)
            def wrapper(optimizer, *args, **kwargs):
                if not tap._applying or tap._stepping:
                    return orig(optimizer, *args, **kwargs)
                tap._safely("megatron_step", tap._begin_megatron, optimizer)
                try:
                    return orig(optimizer, *args, **kwargs)
                finally:
                    tap._stepping = False
                    tap._safely("megatron_step", tap._end_megatron)
            return wrapper

        method = "_unscale_main_grads_and_check_for_nan"
        if mixed is not None and method in mixed.__dict__:
            patch_set.add(Patch(mixed, method, check))
        if mixed is not None and "step_with_ready_grads" in mixed.__dict__:
            patch_set.add(Patch(mixed, "step_with_ready_grads", ready))
        if base is not None and "scale_loss" in base.__dict__:
            patch_set.add(Patch(base, "scale_loss", scale_loss))

    def _begin_megatron(self, optimizer: Any) -> None:
        """A Megatron optimizer's applied step begins (``step_with_ready_grads``): its inner
        torch optimizer steps the fp32 main parameters (copies of fp16 ones), not the model's,
        so the step is the engine's, ended as it returns; the norm of the main gradients,
        unscaled by now."""
        self._stepping, self._applying = True, False
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            self.hooks.watched.adopt_optimizer(inner)
        self.hooks.begin_engine_step(_megatron_model_params(optimizer))
        grads = [p.grad for g in getattr(inner, "param_groups", []) for p in g["params"]
                 if p.grad is not None and stats.measurable(p.grad)]
        self._grad_norm = stats.global_norm(grads) if grads else None

    def _end_megatron(self) -> None:
        def fill(st: Step) -> None:
            if self._grad_norm is not None:
                st.grad_norm = self._grad_norm.float()
            st.stepped = True
        self.hooks.end_engine_step(fill)

    def _scaled_loss(self, loss: Any, out: Any) -> None:
        if isinstance(loss, torch.Tensor) and isinstance(out, torch.Tensor):
            st = self.hooks.log.step
            st.keep.append(out)
            st.unscaled_of.append(loss)


def _autocast_scaler(engine: Any) -> bool:
    """Does the engine scale with torch's GradScaler (``torch_autocast`` fp16, no ZeRO)?"""
    return getattr(engine, "torch_autocast_z0_gradscaler", None) is not None


def _inside_deepspeed(depth: int = 64) -> bool:
    """Is DeepSpeed's code on the stack (within ``depth`` frames)?"""
    frame: Any = sys._getframe(1)
    while frame is not None and depth:
        if str(frame.f_globals.get("__name__", "")).startswith("deepspeed."):
            return True
        frame, depth = frame.f_back, depth - 1
    return False


def _torch_optimizer(engine: Any) -> Optional[torch.optim.Optimizer]:
    """The torch optimizer whose param groups hold the engine's LRs: the one it wraps
    (``basic_optimizer``), or its optimizer itself where it wraps none."""
    for candidate in (getattr(engine, "basic_optimizer", None), engine.optimizer):
        if isinstance(candidate, torch.optim.Optimizer):
            return candidate
    return None


def _loss_scale(engine: Any) -> Optional[float]:
    """The fp16 engine's current loss scale; None for bf16 and fp32 (a static 1.0 scales
    nothing)."""
    fp16 = getattr(engine, "fp16_enabled", None)
    if not callable(fp16) or not fp16():
        return None
    optimizer = engine.optimizer
    config = getattr(optimizer, "loss_scale_config", None)
    scale = getattr(config, "cur_scale", None) if config is not None else None
    if scale is None:
        scale = getattr(optimizer, "loss_scale", getattr(optimizer, "cur_scale", None))
    return None if scale is None else float(scale)


def _megatron_model_params(optimizer: Any) -> list:
    """The model's parameters a Megatron optimizer updates: its fp16 groups and fp32 groups
    where it keeps main copies (``Float16OptimizerWithFloat16Params``), else its own."""
    groups = getattr(optimizer, "float16_groups", None)
    if isinstance(groups, list):
        groups = groups + list(getattr(optimizer, "fp32_from_fp32_groups", []))
        return [p for g in groups for p in g]
    return [p for g in optimizer.param_groups for p in g["params"]]


def _scale_of(scaler: Any) -> Optional[torch.Tensor]:
    """A Megatron scaler's scale (a 1-element tensor), copied as a 0-dim float: no read."""
    scale = getattr(scaler, "_scale", None)
    return scale.detach().reshape(-1)[0].float().clone() if isinstance(
        scale, torch.Tensor) else None


__all__ = ["Engines"]
