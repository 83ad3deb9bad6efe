"""``ampdoctor record --apply FIX[=VALUE]``: the fix applied to the command from its bootstrap,
with no change to its code.

Unlike the recorder, a treatment changes what the run computes, on purpose; it is installed
only when ``--apply`` is given (``record`` without it changes nothing), in each Python process
of the command, when torch is imported and before the recorder starts (``child.py``), with
the same undoable ``patches.Patch`` handles as the recorder's doors. What each form does:

* ``fp32_island=NAME,...``: the modules of those qualified names, looked up in each module
  called with grad enabled until all are found (the model's own call finds them, before their
  first call), get a forward pre-hook and hook that run them with autocast off on fp32 inputs
  (their output is fp32). A name under a class name, as a run of several models is recorded
  (``Disc.attn``, a parameter-free ``Gram``), is looked up in every call, under no_grad too,
  until the first optimizer step, and a module it names is an island from that very call. A
  name still missing at the first optimizer step is warned about and recorded (``missing``);
  a module with half weights is left alone (its inputs must match them: only
  ``model.float()`` in the code helps).
* ``use_bf16``: every autocast created as float16 (also by default, on CUDA) runs bfloat16;
  every GradScaler is disabled, as the fix says (bf16 has fp32's range: nothing to scale).
  Weights the code itself made half stay half.
* ``adam_eps=EPS``: every optimizer whose defaults have an ``eps`` is created with EPS (and
  every param group's eps set to it).
* ``init_scale=S``, ``growth_interval=N``: every enabled GradScaler starts at S / grows every N.
* ``lr_factor=F``, ``lr=LR``: each optimizer's step runs with every group's LR times F, put
  back after the step, so that schedulers (chainable ones included) and the script's own
  ``group["lr"] = ...`` keep working; ``lr=LR`` takes F = LR / the optimizer's constructor LR.
  The recorder writes the LR the step ran with (``lr_factor``).
* ``loss_in_fp32``: torch's loss functions (``torch.nn.functional``'s, which the ``nn`` loss
  modules call) get their floating inputs in fp32, autocast off. A hand-written loss is not
  reached.
* ``scheduler_per_step``: an LR scheduler's ``step`` runs at most once per optimizer step
  that ran (later calls before the next optimizer step are left out; a step GradScaler
  skipped does not count, as ``scheduler_after_real_step`` asks).
* ``fp8[=RECIPE][:keep=NAME,...]``: the model, the outermost module first called with grad
  enabled that trains parameters and holds a Linear (a copy on the meta device, or one called
  under no_grad, is not it), has its Linears converted by torchao's
  ``convert_to_float8_training`` with the recipe's ``Float8LinearConfig``, at that first call
  (the optimizer keeps the same parameters). Those named (a name keeps everything under it)
  and those whose sizes are not multiples of 16 (fp8 matmuls need it) stay as they are.
  ``emulate=True`` where the device has no fp8 matmul (CPU; CUDA below compute capability
  8.9). Off CUDA a converted Linear runs with autocast off on fp32 inputs: torchao's backward
  fails under CPU autocast ("expected m1 and m2 to have the same dtype"), and a training
  loop must not crash because it was treated.

What was applied (and what could not be) goes to ``/meta`` ``applied`` through ``note``.

Example::

    t = Treatment(prescription.parse_all(["use_bf16"]), note=print).install()
    ...train...
    t.remove()
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
import weakref
from dataclasses import replace
from typing import Any, Callable, Optional, cast

import torch
import torch.nn.functional as F
import torch.nn.modules.module as module_hooks
import torch.optim.optimizer as optimizer_hooks

from ...runfile.meta import AppliedFix
from .. import patches
from . import lrfactors
from .prescription import FORMS, Prescription

# torch.nn.functional's losses: the ones ``loss_in_fp32`` casts.
LOSSES = ("cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
          "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div",
          "poisson_nll_loss", "gaussian_nll_loss", "soft_margin_loss",
          "multilabel_soft_margin_loss", "hinge_embedding_loss", "cosine_embedding_loss",
          "margin_ranking_loss", "triplet_margin_loss", "multi_margin_loss",
          "multilabel_margin_loss", "ctc_loss")
_HALF = (torch.float16, torch.bfloat16)

class Treatment:
    """The prescriptions of one process, installed as patches (``install``, ``remove``).

    ``note(applied)`` is told what was applied, a list of dicts for /meta ``applied``, at
    install and whenever that changes (an island found, or missing at the first step).
    """

    def __init__(self, prescriptions: list[Prescription],
                 note: Callable[[list[AppliedFix]], None] = lambda applied: None):
        self.prescriptions = prescriptions
        self.note = note
        self.patches = patches.PatchSet()
        self.applied: list[AppliedFix] = []
        self._islands: Optional[_Islands] = None

    def install(self) -> "Treatment":
        by_name = {p.name: p.value for p in self.prescriptions}
        for p in self.prescriptions:
            try:
                entry = replace(self._install(p, by_name), fix=p.name, arg=p.arg)
            except Exception as exc:  # noqa: BLE001 - the command runs on, untreated by this
                entry = AppliedFix(fix=p.name, arg=p.arg, error=f"{type(exc).__name__}: {exc}")
                warnings.warn(f"ampdoctor: --apply {p.arg} could not be applied ({exc})",
                              RuntimeWarning, stacklevel=2)
            self.applied.append(entry)
        self._tell()
        return self

    def remove(self) -> None:
        self.patches.remove()

    def _tell(self) -> None:
        try:
            self.note(list(self.applied))
        except Exception:  # noqa: BLE001 - what is recorded never changes what is applied
            pass

    def _install(self, p: Prescription, by_name: dict) -> AppliedFix:
        if p.name not in INSTALL:
            raise ValueError(f"no treatment for {p.name}")
        return INSTALL[p.name](self, p, by_name)

    def _install_islands(self, p: Prescription, by_name: dict) -> AppliedFix:
        assert isinstance(p.value, tuple)
        self._islands = _Islands(p.value, self._found)
        self._islands.install(self.patches)
        return AppliedFix(modules=[], missing=list(p.value))

    def _found(self, found: list[str], missing: list[str], skipped: dict) -> None:
        """The islands' lookup progressed: /meta says which modules were wrapped."""
        self.applied = [
            replace(e, modules=list(found), missing=list(missing),
                    skipped=dict(skipped) if skipped else e.skipped)
            if e.fix == "fp32_island" else e for e in self.applied]
        self._tell()


def _install_bf16(t: Treatment, p: Prescription, by_name: dict) -> AppliedFix:
    _bf16_autocast(t.patches)
    if "init_scale" not in by_name and "growth_interval" not in by_name:
        _scaler_settings(t.patches, disable=True)
    return AppliedFix(scaler="disabled")


def _install_scaler(t: Treatment, p: Prescription, by_name: dict) -> AppliedFix:
    if p.name == "growth_interval" and "init_scale" in by_name:
        return AppliedFix()  # installed with init_scale
    _scaler_settings(t.patches, init_scale=by_name.get("init_scale"),
                     growth_interval=by_name.get("growth_interval"),
                     disable="use_bf16" in by_name)
    return AppliedFix()


def _install_eps(t: Treatment, p: Prescription, by_name: dict) -> AppliedFix:
    _eps(t.patches, float(p.value))  # type: ignore[arg-type]
    return AppliedFix()


def _install_lr(t: Treatment, p: Prescription, by_name: dict) -> AppliedFix:
    _lr(t.patches, float(p.value), relative=p.name == "lr_factor")  # type: ignore
    return AppliedFix()


def _install_losses(t: Treatment, p: Prescription, by_name: dict) -> AppliedFix:
    _losses(t.patches)
    return AppliedFix(functions=len(LOSSES))


def _install_scheduler_gate(t: Treatment, p: Prescription, by_name: dict) -> AppliedFix:
    _scheduler_gate(t.patches)
    return AppliedFix()


# Forms installed together with another form, by that form's installer.
_install_fp32_island = Treatment._install_islands
_install_use_bf16 = _install_bf16
_install_adam_eps = _install_eps
_install_init_scale = _install_growth_interval = _install_scaler
_install_lr_factor = _install_lr
_install_loss_in_fp32 = _install_losses
_install_scheduler_per_step = _install_scheduler_gate


# ---------------------------------------------------------------------------------------------
# fp32 islands


_ISLAND_STACK = threading.local()


def _island_pre(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
    """Before an island's forward: autocast off on its inputs' devices, inputs in fp32.
    Module-level (no closure over the module): a deep copy of the model shares these hooks
    and they work on the copy too."""
    devices = {t.device.type for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)}
    stack = contextlib.ExitStack()
    for device in sorted(devices or {"cpu"}):
        if torch.amp.is_autocast_available(device):
            stack.enter_context(torch.autocast(device, enabled=False))
    _opened().append(stack)
    return tuple(_up(a) for a in args), {k: _up(v) for k, v in kwargs.items()}


def _opened() -> list:
    """This thread's open islands' autocast stacks (``_island_post`` closes the last)."""
    opened = getattr(_ISLAND_STACK, "open", None)
    if opened is None:
        opened = _ISLAND_STACK.open = []
    return opened


def _island_post(module: torch.nn.Module, args: tuple, output: Any) -> None:
    """After it (also when the forward raised: the hook is ``always_call``): autocast back."""
    opened = getattr(_ISLAND_STACK, "open", None)
    if opened:
        opened.pop().close()


def _up(x: Any) -> Any:
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in _HALF else x


class _Islands:
    """Finds the named modules as the model is first called, and hooks each once. A path is
    looked up in each module called with grad enabled (the model's own call finds it, before
    its first call; an EMA copy called under no_grad first does not take it). A name under a
    class name, as the recorder names the modules of a run of several models (``Disc.attn``,
    a parameter-free ``Gram``), is looked up in every call until the first optimizer step, and
    every module it names gets the island: the first call of ``Gram`` may be under no_grad (a
    style's Gram matrix, the loss's target), and it too runs in fp32 with the fix."""

    def __init__(self, names: tuple[str, ...],
                 found: Callable[[list[str], list[str], dict], None]):
        self.names = list(names)
        self.wanted = list(names)
        self.found: list[str] = []
        self.skipped: dict[str, str] = {}
        self.tell = found
        self._seen: set[tuple[int, bool]] = set()
        self._hooked: set[int] = set()
        self._search = patches.PatchSet()
        self._done = False  # the first optimizer step has been seen

    def install(self, patch_set: patches.PatchSet) -> None:
        self.patch_set = patch_set
        # A global pre-hook may return the call's new inputs, as a module's may (the stubs
        # say None only).
        look = cast(Callable[..., None], self._look)
        self._search.add(module_hooks.register_module_forward_pre_hook(look))
        patch_set.add(self._search)
        # Left in place once done (removing it from inside the optimizer's own loop over its
        # post hooks would break that loop): it does nothing after the first step.
        patch_set.add(optimizer_hooks.register_optimizer_step_post_hook(self._give_up))

    def _look(self, module: torch.nn.Module, args: tuple) -> Optional[tuple]:
        """Island the modules this call names; the called module itself at once (its own
        pre-hooks for this call are already chosen, its post-hooks not yet)."""
        grad = torch.is_grad_enabled()
        if (id(module), grad) in self._seen:
            return None
        self._seen.add((id(module), grad))
        changed, now = False, None
        for name in self.names:
            target = _by_class(module, name)
            if target is None and grad and name in self.wanted:
                target = _by_path(module, name)
            if target is None or id(target) in self._hooked:
                continue
            self._hooked.add(id(target))
            changed = True
            if name in self.wanted:
                self.wanted.remove(name)
            half = {str(p.dtype).replace("torch.", "") for p in target.parameters()
                    if p.dtype in _HALF}
            if half:
                self.skipped[name] = f"its weights are {', '.join(sorted(half))}"
                continue
            self.patch_set.add(target.register_forward_pre_hook(_island_pre, with_kwargs=True))
            self.patch_set.add(target.register_forward_hook(_island_post, always_call=True))
            if target is module:
                now = _island_pre(module, args, {})[0]
            if name not in self.found:
                self.found.append(name)
        if changed:
            self.tell(self.found, self.wanted, self.skipped)
        return now

    def _give_up(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The first optimizer step: a name not found by now is not in the model."""
        if self._done:
            return
        self._search.remove()
        if self.wanted:
            warnings.warn(f"ampdoctor: --apply fp32_island: no module named "
                          f"{', '.join(self.wanted)} in the model; those are not islands",
                          RuntimeWarning, stacklevel=2)
            self.tell(self.found, self.wanted, self.skipped)
        self._done = True


def _by_path(module: torch.nn.Module, path: str) -> Optional[torch.nn.Module]:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _by_class(module: torch.nn.Module, name: str) -> Optional[torch.nn.Module]:
    """What ``name`` names under ``module``'s class name (``Disc.attn`` from a ``Disc``,
    ``Gram`` the module itself). A class name the recorder numbered (``Sequential1``: two
    models of one class) is not matched: which one it was is not known here."""
    head, _, rest = name.partition(".")
    return _by_path(module, rest) if head == type(module).__name__ else None


# ---------------------------------------------------------------------------------------------
# autocast and GradScaler


def _bf16_autocast(patch_set: patches.PatchSet) -> None:
    def make(orig: Callable) -> Callable:
        @functools.wraps(orig)
        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            orig(self, *args, **kwargs)
            if getattr(self, "fast_dtype", None) == torch.float16:
                self.fast_dtype = torch.bfloat16
        return init

    patch_set.add(patches.Patch(torch.amp.autocast_mode.autocast, "__init__", make))


def _scaler_settings(patch_set: patches.PatchSet, *, init_scale: Any = None,
                     growth_interval: Any = None, disable: bool = False) -> None:
    def make(orig: Callable) -> Callable:
        @functools.wraps(orig)
        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            orig(self, *args, **kwargs)
            if not getattr(self, "_enabled", False):
                return
            if disable:
                self._enabled = False
                return
            if init_scale is not None:
                self._init_scale = float(init_scale)
            if growth_interval is not None:
                self._growth_interval = int(growth_interval)
        return init

    patch_set.add(patches.Patch(torch.amp.GradScaler, "__init__", make))


# ---------------------------------------------------------------------------------------------
# the optimizer: eps and the learning rate


def _eps(patch_set: patches.PatchSet, eps: float) -> None:
    def make(orig: Callable) -> Callable:
        @functools.wraps(orig)
        def init(self: Any, params: Any, defaults: dict, *args: Any, **kwargs: Any) -> None:
            has = isinstance(defaults, dict) and "eps" in defaults
            orig(self, params, dict(defaults, eps=eps) if has else defaults, *args, **kwargs)
            if has:
                for group in self.param_groups:
                    if "eps" in group:
                        group["eps"] = eps
        return init

    patch_set.add(patches.Patch(torch.optim.Optimizer, "__init__", make))


def _lr(patch_set: patches.PatchSet, value: float, relative: bool) -> None:
    """Each step runs with every group's LR times the factor, put back after it."""
    held: dict[int, list[tuple[dict, Any]]] = {}

    def factor(optimizer: Any) -> float:
        f = lrfactors.get(optimizer)
        if f is None:
            base = (getattr(optimizer, "defaults", None) or {}).get("lr")
            base = float(base) if base is not None else 0.0
            f = value if relative else (value / base if base > 0 else 1.0)
            lrfactors.set(optimizer, f)
        return f

    def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        f = factor(optimizer)
        saved = held[id(optimizer)] = []
        for group in optimizer.param_groups:
            lr = group.get("lr")
            if lr is not None:
                saved.append((group, lr))
                group["lr"] = lr * f
        return None

    def post(optimizer: Any, args: Any, kwargs: Any) -> None:
        for group, lr in held.pop(id(optimizer), []):
            group["lr"] = lr

    patch_set.add(optimizer_hooks.register_optimizer_step_pre_hook(pre))
    patch_set.add(optimizer_hooks.register_optimizer_step_post_hook(post))


# ---------------------------------------------------------------------------------------------
# losses, schedulers


def _losses(patch_set: patches.PatchSet) -> None:
    def make(orig: Callable) -> Callable:
        @functools.wraps(orig)
        def in_fp32(*args: Any, **kwargs: Any) -> Any:
            devices = {t.device.type for t in (*args, *kwargs.values())
                       if isinstance(t, torch.Tensor)}
            with contextlib.ExitStack() as stack:
                for device in sorted(devices):
                    if torch.amp.is_autocast_available(device):
                        stack.enter_context(torch.autocast(device, enabled=False))
                return orig(*map(_up, args), **{k: _up(v) for k, v in kwargs.items()})
        return in_fp32

    for name in LOSSES:
        if hasattr(F, name):
            patch_set.add(patches.Patch(F, name, make))


def _scheduler_gate(patch_set: patches.PatchSet) -> None:
    """A scheduler's step runs once per optimizer step that ran: optimizer steps are counted
    by a global post-hook; a scheduler remembers the count at its last step."""
    counts: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
    last: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()

    def counted(optimizer: Any, args: Any, kwargs: Any) -> None:
        counts[optimizer] = counts.get(optimizer, 0) + 1

    def make(orig: Callable) -> Callable:
        @functools.wraps(orig)
        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            opt = getattr(self, "optimizer", None)
            now = counts.get(opt, 0) if opt is not None else 0
            if getattr(self, "_step_count", 0) and last.get(self, -1) == now:
                return None  # stepped already since the last optimizer step
            out = orig(self, *args, **kwargs)
            last[self] = now
            return out
        return step

    patch_set.add(optimizer_hooks.register_optimizer_step_post_hook(counted))
    for cls in patches.scheduler_classes():
        if "step" in cls.__dict__:
            patch_set.add(patches.Patch(cls, "step", make))


# ---------------------------------------------------------------------------------------------
# fp8 training (torchao)


class _Fp8:
    """Converts the model's Linears to torchao's ``Float8Linear`` at the model's first call
    (this module's docstring says which module is the model)."""

    def __init__(self, value: Any, treatment: Treatment):
        from .prescription import FP8_RECIPES

        value = tuple(value or ())
        self.recipe = value[0] if value else FP8_RECIPES[0]
        self.keep = value[1:]
        self.treatment = treatment
        self._search = patches.PatchSet()
        self._depth = 0

    def install(self) -> AppliedFix:
        import torchao.float8  # noqa: F401 - a missing torchao fails here, at install

        look = cast(Callable[..., None], self._look)
        self._search.add(module_hooks.register_module_forward_pre_hook(look))
        self._search.add(module_hooks.register_module_forward_hook(self._left, always_call=True))
        self.treatment.patches.add(self._search)
        return AppliedFix(recipe=self.recipe, keep=list(self.keep), converted=[])

    def _left(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self._depth = max(0, self._depth - 1)

    def _look(self, module: torch.nn.Module, args: tuple) -> None:
        self._depth += 1
        if self._depth > 1 or not torch.is_grad_enabled() or not _trains_linears(module):
            return
        self._search.remove()
        self._depth = 0
        self._tell(self.convert(module))

    def convert(self, model: torch.nn.Module) -> Callable[[AppliedFix], AppliedFix]:
        """Convert ``model``'s Linears in place (its parameters stay the optimizer's); what
        /meta ``applied`` adds (converted, kept: name -> why, emulated, model), as the change
        it makes to the fp8 entry."""
        import dataclasses

        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        device = next(model.parameters()).device
        emulate = not (device.type == "cuda" and
                       torch.cuda.get_device_capability(device) >= (8, 9))
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(self.recipe),
                                     emulate=emulate)
        kept: dict[str, str] = {}

        def chosen(mod: torch.nn.Module, fqn: str) -> bool:
            if not isinstance(mod, torch.nn.Linear):
                return True  # a container: its Linears are asked one by one
            if any(fqn == k or fqn.startswith(k + ".") for k in self.keep):
                kept[fqn] = "named with keep="
            elif mod.in_features % 16 or mod.out_features % 16:
                kept[fqn] = "its sizes are not multiples of 16"
            return fqn not in kept

        before = {id(m) for m in model.modules()}
        convert_to_float8_training(model, config=config, module_filter_fn=chosen)
        converted = [n for n, m in model.named_modules() if id(m) not in before]
        for name in converted:
            target = model.get_submodule(name)
            self.treatment.patches.add(
                target.register_forward_pre_hook(_fp8_pre, with_kwargs=True))
            self.treatment.patches.add(
                target.register_forward_hook(_island_post, always_call=True))
        model_name = type(model).__name__
        return lambda e: replace(e, converted=converted, kept=kept, emulated=emulate,
                                 model=model_name)

    def _tell(self, done: Callable[[AppliedFix], AppliedFix]) -> None:
        t = self.treatment
        t.applied = [done(e) if e.fix == "fp8" else e for e in t.applied]
        t._tell()


def _install_fp8(t: Treatment, p: Prescription, by_name: dict) -> AppliedFix:
    return _Fp8(p.value, t).install()


def _trains_linears(module: torch.nn.Module) -> bool:
    """A model fp8 can treat: it trains parameters (none on the meta device: a FLOP count's
    copy) and holds a Linear below it."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params or any(p.device.type == "meta" for p in params):
        return False
    return any(isinstance(m, torch.nn.Linear) for m in module.modules() if m is not module)


def _fp8_pre(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
    """A converted Linear off CUDA: autocast off, fp32 inputs (as an island), so that torchao's
    backward sees one dtype; on CUDA torchao handles autocast itself."""
    if any(isinstance(a, torch.Tensor) and a.is_cuda for a in (*args, *kwargs.values())):
        _opened().append(contextlib.ExitStack())  # _island_post closes one per call
        return args, kwargs
    return _island_pre(module, args, kwargs)


Installer = Callable[[Treatment, Prescription, dict], AppliedFix]


def _installers() -> dict[str, Installer]:
    """One installer per form of ``prescription.FORMS``, derived from that one declaration:
    the function ``_install_<form>`` of this module, which patches and returns what /meta
    ``applied`` adds for the form. A form without one fails this module's import."""
    found = {name: globals().get(f"_install_{name}") for name in FORMS}
    missing = sorted(name for name, fn in found.items() if not callable(fn))
    if missing:
        raise ImportError(f"treatment.py has no _install_<form> for {', '.join(missing)}")
    return {name: fn for name, fn in found.items() if fn is not None}


INSTALL: dict[str, Installer] = _installers()
