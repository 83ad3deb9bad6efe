"""What a recorder watches: the model's root modules and their names, the optimizers, the
GradScaler, and the autocast state the model really runs in.

Each is given to ``watch()`` or discovered in the first step:

* **roots**: the outermost modules called with grad enabled that own trainable parameters,
  adopted before their forward runs (DDP/DataParallel wrappers looked through); at the end of
  the first step only those whose parameters an optimizer trains are kept (with the
  micro-batches only they ran: a model run and dropped before the real one). Never adopted: a
  module run on meta or fake tensors (a FLOP count, ``FakeTensorMode``), a module already
  left out because recording it failed (``skip``: the rest is recorded). The search, where
  no model was given, is ``discovery.RootDiscovery``'s. A compiled model is
  seen through an eager shim (``compiled.py``), a sharded one (FSDP2, FSDP1) is adopted with
  per-shard statistics and no replay (``sharding.py``).
* **optimizers**: those that step the roots' parameters (any optimizer, while no root is
  known), or, where none does, copies of them (fp32 master weights kept by hand:
  ``mirrors.py``; each copy named after its parameter); the list of trained parameters is
  cached until the param groups change.
* **scaler**: the first enabled GradScaler that scales a loss.
* **autocast**: read at the root's pre-hook each training call, and inside the forward on the
  steps that have module hooks anyway (``autocastnotes.AutocastNotes``); /meta ``autocast`` on
  a change.

What is adopted is written to /meta (roots, model, device, compiled, sharding, optimizer,
scaler). The forensic tier reads the model from here (roots, names, param_names, device,
sharding, autocast.seen, trained_params).

Example::

    watched = Watched(model, opt, None, journal=journal, forensics=True)
    watched.attach(hooks.model_door(), patches, log.follow)  # root hooks (or discovery's)
    watched.owns(opt), watched.trained_params()
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable, Optional

import torch

from ..errors import AmpDoctorError
from ..runfile.schema import Event
from . import buffers, compiled, handles, mirrors, patches, sharding
from .autocastnotes import AutocastNotes
from .discovery import RootDiscovery
from .environment import device_info, model_summary, optimizer_info, scaler_info
from .journal import Journal
from .listener import ModelDoor
from .replicas import Replicas
from .steps import Step
from .torchcompat import scaler_enabled, unwrap


class Watched:
    """The model, optimizers and scaler of one recorder, given or discovered."""

    def __init__(self, model: Any, optimizer: Any, scaler: Any, *, journal: Journal,
                 forensics: bool):
        self.journal = journal
        self.forensics_on = forensics
        self.roots: list[torch.nn.Module] = _checked(_as_list(model), "model", torch.nn.Module,
                                                     "a torch.nn.Module")
        self.optimizers: list[Any] = _checked(_as_list(optimizer), "optimizer",
                                              torch.optim.Optimizer, "a torch.optim.Optimizer")
        if scaler is not None and not all(callable(getattr(scaler, m, None)) for m in
                                          ("scale", "unscale_", "step", "update")):
            raise AmpDoctorError(f"watch(): scaler must be a torch.amp.GradScaler (or None), "
                                 f"not {type(scaler).__name__}")
        self.scaler = scaler
        self.given = {"model": bool(self.roots), "optimizer": bool(self.optimizers),
                      "scaler": scaler is not None}
        self.names: dict[torch.nn.Module, str] = {}
        self.param_names: dict[int, str] = {}
        self.device: Optional[torch.device] = None
        self.sharding: Optional[sharding.Sharding] = None
        self.replicas = Replicas()  # which ranks hold a weight whole (DDP): fp8 layers' meta
        self.autocast = AutocastNotes(journal)  # where autocast really runs
        self.root_ids: set[int] = set()
        self._unfound: set[int] = set()  # parameters looked for in the script, not found
        self.regions: list[tuple[str, str]] = []  # compiled regions in the roots
        self.eager: Optional[list[torch.nn.Module]] = None  # hookable modules, if compiled
        self._own_optimizer: dict[int, bool] = {}
        self.mirror_of: dict[int, int] = {}  # id(master copy) -> id(model parameter)
        self._optimizer_meta_done: set[int] = set()
        self._params_key: Optional[tuple] = None  # param_groups the cached list was made from
        self._params: list[torch.Tensor] = []
        self._door: Optional[ModelDoor] = None
        self._moved: Callable[[torch.device], None] = lambda device: None
        self._patches = patches.PatchSet()  # replaced in attach by the recorder's own set
        self.root_hooks = patches.PatchSet()
        self.discovery = RootDiscovery(self)  # the roots, where none were given
        self.side = buffers.SideModels()  # frozen models the step runs beside the roots
        self.buffer_start = buffers.BufferStart()  # buffers non-finite when first seen
        self._checked: set[int] = set()  # roots whose buffers were checked at the start

    def attach(self, door: ModelDoor, patch_set: patches.PatchSet,
               moved: Callable[[torch.device], None]) -> None:
        """Hook the given roots (or the global discovery hooks) and adopt the given scaler.
        ``patch_set``: the recorder's patches, which sharding and ``module.compile()`` add to;
        ``moved(device)``: told the model's device whenever roots are adopted."""
        self._door, self._patches, self._moved = door, patch_set, moved
        if self.roots:
            self.adopt_roots(self.roots)
        else:
            self.discovery.start(door)
        if self.scaler is not None:
            self.adopt_scaler(self.scaler)

    def detach(self) -> None:
        self.root_hooks.remove()
        self.discovery.remove()

    # -- the roots, adopted again ---------------------------------------------------------------

    def readopt(self, roots: list[torch.nn.Module]) -> None:
        """Hooks and names for ``roots`` again (after a failed adoption, or a skip); none left:
        discovery goes on looking."""
        if roots:
            self.adopt_roots(roots)
            return
        self.roots, self.root_ids, self.eager, self.regions = [], set(), None, []
        self.names.clear()
        self.param_names.clear()

    def name_handles(self, frame: Any) -> None:
        """What the training code calls the recorded modules (``handles.find`` over ``frame``
        and the frames below it), into /meta ``handles``; once, at the end of the first
        step."""
        if self.roots:
            found = handles.find(self.roots, _root_prefixes(self.roots), self.names, frame)
            if found:
                self.journal.meta("handles", found)
        if self.side.models:
            held = handles.held(self.side.models, frame)
            self.side.name(held, {n.split(".")[0] for n in self.names.values()},
                           self.buffer_start)
        self.journal.meta("buffers", self.buffer_start.meta())

    def on_module_compile(self, module: torch.nn.Module) -> None:
        """``module.compile()``: its calls (hooks included) are compiled from now on, so they
        are seen through an eager shim."""
        patches.shim_compiled_call(self._patches, self._listening(), module)
        if id(module) in self.root_ids:
            self.root_hooks.remove()
            self.adopt_roots(self.roots)

    # -- adoption ----------------------------------------------------------------------------

    def adopt_roots(self, roots: list[torch.nn.Module]) -> None:
        self.roots = roots
        self.root_ids = {id(r) for r in roots}
        self.names.clear()
        self.param_names.clear()
        prefixes = _root_prefixes(roots)
        device = self.device = _first_device(roots)
        amp = self.autocast.track(device.type)
        self.regions = []
        for root, prefix in zip(roots, prefixes):
            self.replicas.saw(root)
            inner = unwrap(root)
            self.names[root] = prefix.rstrip(".") or type(inner).__name__
            for name, m in inner.named_modules():
                name = sharding.clean_name(name)
                if name:
                    self.names[m] = prefix + name
            for name, p in inner.named_parameters():
                self.param_names[id(p)] = prefix + sharding.clean_name(name)
            self.regions += [(prefix + n if n else self.names[root], k)
                               for n, k in compiled.regions(root)]
            amp.declare(root)
            self._hook_root(root)
        self._name_mirrors()
        self.eager = [m for r in roots for m in compiled.eager_modules(r)] \
            if self.regions else None
        self._adopt_sharding(roots)
        self._moved(device)  # discovered: the device is known from now on
        self._check_buffers(roots)
        self.journal.meta("roots", [type(unwrap(r)).__name__ for r in roots])
        self.journal.meta("model", model_summary(roots))
        self.journal.meta("device", device_info(device))
        if self.eager is not None:
            self._note_compiled(self.eager)

    def _check_buffers(self, roots: list[torch.nn.Module]) -> None:
        """Each root's buffers, once, when it is first adopted (before its forward)."""
        for root in roots:
            if id(root) not in self._checked:
                self._checked.add(id(root))
                self.buffer_start.check(self.names[root], buffers.module_buffers(
                    self.names, unwrap(root).modules()))

    def _hook_root(self, root: torch.nn.Module) -> None:
        """The root's forward pre-hook and hook, or, for a ``module.compile()``'d root whose
        hooks would be compiled, the eager shim around its call."""
        door = self._listening()
        if compiled.kind(root) == compiled.CALL:
            patches.shim_compiled_call(self.root_hooks, door, root)
            return
        patches.hook_root(self.root_hooks, door, root)

    def _note_compiled(self, eager: list[torch.nn.Module]) -> None:
        """What a compiled model leaves out of the recording (module outputs inside its
        compiled regions), kept in /meta for ``diagnose`` to say."""
        shimmed = [r for r in self.roots if compiled.kind(r) == compiled.CALL]
        self.journal.meta("compiled", {
            "regions": [{"module": n, "kind": k} for n, k in self.regions],
            "hooked": sorted(self.names.get(m, "?") for m in eager + shimmed)})

    def _adopt_sharding(self, roots: list[torch.nn.Module]) -> None:
        """A sharded model (FSDP2, FSDP1): per-shard statistics, norms from shards, no
        replay (sharding.py); /meta says so."""
        found = sharding.detect(roots, self.journal.world_size)
        if found is None:
            return
        if self.sharding is None:
            door = self._listening()
            patches.patch_scaler(self._patches, door.scaler)  # ShardedGradScaler, loaded since
            patches.patch_own_found_inf(self._patches, door.fault, door.after_unscale_grads)
            if found.kind == "fsdp1":
                patches.patch_clip_method(self._patches, door.fault, door.before_clip,
                                          door.after_clip, sharding.fsdp1_class())
        self.sharding = found
        self.journal.meta("sharding", found.meta(self.forensics_on))

    def _listening(self) -> ModelDoor:
        if self._door is None:
            raise RuntimeError("Watched.attach has not been called")
        return self._door

    def adopt_scaler(self, scaler: Any) -> None:
        self.scaler = scaler
        self.journal.meta("scaler", scaler_info(scaler))

    def scaler_created(self, scaler: Any, step: Step) -> None:
        """A GradScaler was made: an event; a re-created scaler replaces the one adopted (from
        its first scaled loss on), unless the scaler was given."""
        self.journal.event(Event.SCALER_CREATED, step,
                           value=float(getattr(scaler, "_init_scale", math.nan)))
        if not self.given["scaler"] and self.scaler is not None and scaler is not self.scaler:
            self.scaler = None

    def uses_scaler(self, scaler: Any) -> bool:
        """Is this the watched scaler (adopted now, if none is yet and it is enabled)?"""
        if self.scaler is None and not self.given["scaler"] and scaler_enabled(scaler):
            self.adopt_scaler(scaler)
        return scaler is self.scaler

    def owns(self, optimizer: Any, through_scaler: bool = False) -> bool:
        """Is this an optimizer of the watched model? ``through_scaler``: it steps through
        the watched GradScaler (``scaler.step``): part of the training recorded, even where
        its model was never adopted (a GAN's generator, called first under no_grad)."""
        if self.optimizers and any(optimizer is o for o in self.optimizers):
            return True
        if self.given["optimizer"]:
            return False
        known = self._own_optimizer.get(id(optimizer))
        if known is None:
            if self.roots and self.param_names and not through_scaler:
                params = [p for g in optimizer.param_groups for p in g["params"]]
                known = self._adopt_mirror(params) or \
                    any(id(p) in self.param_names for p in params) or (
                    # the roots are frozen models a trained input flows through (a style
                    # transfer's image): the optimizer of a tensor outside them trains it
                    bool(self.discovery.by_input) and
                    any(id(p) not in self.param_names for p in params))
            else:
                known = True
            self._own_optimizer[id(optimizer)] = known
            if known:
                self.optimizers.append(optimizer)
                # Hyperparameters now (a run whose every step is skipped never steps);
                # the optimizer-state dtypes follow after its first step.
                self.journal.meta("optimizer", optimizer_info(self.optimizers))
        return known

    def _adopt_mirror(self, params: list) -> bool:
        """Does this optimizer step copies of the model's parameters (fp32 master weights
        kept by hand: ``mirrors.py``) while no optimizer adopted steps the model's own?
        Then its step is the model's: the model's gradients reach it through the copies'
        ``.grad``, its update comes back into the model, and a run recorded without it would
        hold no step at all. Each copy is named after the parameter it mirrors."""
        if any(id(p) in self.param_names for o in self.optimizers for g in o.param_groups
               for p in g["params"]):
            return False  # the run's optimizer is known: another's copies are not the run's
        pairs = mirrors.of_models(params, [list(unwrap(r).parameters()) for r in self.roots])
        self.mirror_of.update(pairs)
        self._name_mirrors()
        return bool(pairs)

    def _name_mirrors(self) -> None:
        """Each master copy under its parameter's name (again after the roots are named)."""
        for copy, param in self.mirror_of.items():
            name = self.param_names.get(param)
            if name is not None:
                self.param_names[copy] = name

    def adopt_optimizer(self, optimizer: Any) -> None:
        """An engine's optimizer (``engines.py``: a DeepSpeed engine's): its param groups' LRs
        are the run's, whatever tensors it steps (ZeRO's flat fp32 partitions). Not where the
        optimizers were given to ``watch()``."""
        if self.given["optimizer"] or any(optimizer is o for o in self.optimizers):
            return
        self._own_optimizer[id(optimizer)] = True
        self.optimizers.append(optimizer)
        self.journal.meta("optimizer", optimizer_info(self.optimizers))

    def stepped(self, optimizer: Any) -> None:
        """After an optimizer's first step: /meta ``optimizer`` again, with its state dtypes."""
        if id(optimizer) not in self._optimizer_meta_done:
            self._optimizer_meta_done.add(id(optimizer))
            self.journal.meta("optimizer", optimizer_info(self.optimizers))

    def primary(self, optimizer: Any) -> bool:
        """The first optimizer, whose step ends a step taken without a scaler."""
        return bool(self.optimizers) and optimizer is self.optimizers[0]

    def trained_params(self, fallback: Optional[list] = None) -> list[torch.Tensor]:
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

    def param_name(self, p: torch.Tensor) -> str:
        name = self.param_names.get(id(p))
        if name is None and id(p) not in self._unfound:
            self._name_strays(p)
            name = self.param_names.get(id(p))
        if name is None:
            name = self.param_names[id(p)] = f"param{len(self.param_names)}"
        return name

    def _name_strays(self, p: torch.Tensor) -> None:
        """Trained parameters of no adopted model (a GAN's generator, first called under
        no_grad, never adopted) are named after the script's variable that holds their module
        (``gen.0.weight``: ``handles.stray_names``); looked for once each."""
        wanted = {id(q) for q in self.trained_params() if id(q) not in self.param_names}
        wanted.add(id(p))
        found = handles.stray_names(wanted, {id(m) for m in self.names}, sys._getframe())
        self.param_names.update(found)
        self._unfound |= wanted - found.keys()

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


def _checked(values: list, what: str, kind: type, named: str) -> list:
    """``values`` when each is a ``kind``; else one sentence, before anything is armed."""
    for v in values:
        if not isinstance(v, kind):
            raise AmpDoctorError(f"watch(): {what} must be {named} (or a list of them, or "
                                 f"None), not {type(v).__name__}")
    return values


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
