"""The step log the hook groups share, and the step boundaries between their callbacks.

Each hook group (``scalerhooks``, ``losshooks``, ``optimizerhooks``, ``modulehooks``) holds
one ``StepFlow``: the step being recorded and the finished steps' rows (``steplog``), the
model, optimizers and scaler (``watched``), the skip decision (``skips``), the sampled tier
(``sampledstep``), the gradients (``gradnorm``), each loss's and optimizer's own curve
(``objectives``) and the forensic tier (``forensics``). What changes a step's state beyond a
few lines lives in those parts; this module ends a step and begins the next.

Step boundaries: ``GradScaler.update`` when an enabled scaler scaled the loss this step (a
skipped step never calls ``optimizer.step``), else the step of the first optimizer seen.
Gradient accumulation: a step is an optimizer step; backward calls count micro-batches. A
scaled step whose ``update()`` never comes ends at the next loss (or at close).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Optional

import torch

from . import callorder, engines, patches
from .forensic.forensics import Forensics
from .gradnorm import GradNorms
from .journal import Journal
from .listener import Fault
from .objectives import Objectives
from .sampledstep import SampledStep
from .schedules import Schedules
from .skips import Skips
from .steplog import StepLog
from .steps import Step, drop_micro
from .watched import Watched


class StepFlow:
    """One recorder's shared step state and its boundaries (see the module docstring)."""

    def __init__(self, journal: Journal, watched: Watched, log: StepLog, skips: Skips, *,
                 sampled: SampledStep, grads: GradNorms, forensics: Optional[Forensics],
                 fault: Fault):
        self.journal = journal
        self.watched = watched
        self.log = log
        self.skips = skips
        self.sampled = sampled
        self.grads = grads
        self.forensics = forensics
        self.fault = fault
        self.patches = patches.PatchSet()  # torch's globals: scaler, backward, clip, optimizer
        self.schedules = Schedules(journal)
        # several losses or optimizers: each one's own curve (objectives.py)
        self.objectives = Objectives(journal, watched, log.constants)
        # optimizers that stepped inside a compiled region since the last eager hook
        self.compiled_steps: list = []
        # patch_clip's wrapper maker, until the first loss has looked for a library's clips
        self.clip_maker: Optional[Callable[[Callable, str], Callable]] = None
        self.engines = engines.Engines(self)  # DeepSpeed's, Megatron-core's optimizer steps

    def replaying(self) -> bool:
        """A forensic replay is re-running the model: none of its calls belong to the step."""
        return self.forensics is not None and self.forensics.replaying

    def capturing(self) -> Optional[Forensics]:
        """The forensic tier, if it captures this step."""
        return self.forensics if self.forensics is not None and self.forensics.armed else None

    def skip(self, module: torch.nn.Module, where: str, exc: BaseException) -> None:
        """A module failed to be recorded while discovered (no optimizer was seen training
        it yet): it is left out, the warning says so once, and the rest of the run is
        recorded. Strict mode raises, as ``fault`` does."""
        if self.journal.strict:
            raise exc
        self.watched.discovery.skip(module, where, exc)
        self.journal.warn_once("skipped", f"could not record {type(module).__name__} "
                               f"({where}: {type(exc).__name__}: {exc}); it is left out of "
                               "the recording, which goes on without it")

    def training(self) -> None:
        """A loss is seen: the previous step is decided, the file exists (lazy recorder), a
        step whose ``update()`` never came has ended."""
        self.skips.settle()
        if not self.journal.created:
            self.journal.create()
        if self.clip_maker is not None:  # a script imports its libraries before its first
            # loss: their clips are seen from now on
            patches.patch_library_clips(self.patches, self.clip_maker)
            self.engines.attach(self.patches)
            self.clip_maker = None
        self.end_step_without_update()

    # -- step boundaries ----------------------------------------------------------------------

    def begin_step(self, index: int) -> None:
        self.log.begin(index)
        self.watched.discovery.depth = 0
        if self.forensics is not None:
            self.forensics.capture.begin_step()
        if self.watched.roots:
            self.sampled.maybe_sample()

    def settle_discovery(self) -> None:
        """The first step's optimizers are known (its end, or the update or step that ends
        it, before the forensic tier looks at it): only the roots they train are kept
        (``RootDiscovery.finish``). A root dropped takes its micro-batches out of the step
        (a model built, run and dropped before the real one): the step's loss is the real
        one's, and its sampled statistics, named while that root was there, are not kept."""
        if not self.watched.discovery.open:
            return
        st = self.log.step
        losses = drop_micro(st, self.watched.discovery.finish())
        if losses is None:
            return
        self.objectives.rewind([(m.slot, m.value) for m in losses if m.value is not None])
        if self.forensics is not None:
            self.forensics.capture.keep_roots(self.watched.root_ids)
        if st.sampled and self.sampled.sampler is not None:
            self.sampled.unsample(st)

    def end_step_without_update(self, closing: bool = False) -> None:
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
            self.end_step()

    def end_step(self) -> None:
        st = self.log.step
        if self.skips.undecided is not None and self.skips.undecided is not st:
            self.skips.settle()  # a step with no hook of ours between: decided before this ends
        self.settle_discovery()
        if st.index == 0:
            self.watched.name_handles(sys._getframe())
        self.watched.autocast.fp16_without_scaler(st, self.watched.scaler)
        callorder.step_events(self.journal, st)
        self.schedules.end_step(st)
        now = time.perf_counter()
        self.log.finish(st, self.objectives.end_step(st))
        if st.sampled and self.sampled.sampler is not None:
            self.sampled.end(st)
            if self.sampled.fp8_trial is not None and self.forensics is not None:
                self.sampled.fp8_trial.keep(st.index, self.forensics.captures)
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

    # -- an engine's step (engines.py) --------------------------------------------------------

    def begin_engine_step(self, params: list) -> None:
        """An engine's optimizer step begins (``engines.py``): on a sampled step, the
        weights before it (``params``: the model's, not the engine's copies)."""
        sampler = self.sampled.sampler
        if self.log.step.sampled and sampler is not None:
            sampler.before_step([(self.watched.param_name(p), p) for p in params])

    def end_engine_step(self, fill: Callable[[Step], None]) -> None:
        """An engine's optimizer step has ended (``engines.py``: DeepSpeed's, a Megatron-core
        scaler's skip): ``fill(step)`` sets what it reported, and the step ends."""
        self.skips.settle()
        self.settle_discovery()
        st = self.log.step
        fill(st)
        sampler = self.sampled.sampler
        if st.sampled and sampler is not None and st.stepped:
            sampler.after_step()
        self.end_step()

    def sampler_on(self, st: Step) -> Any:
        """The sampler, if this step is sampled (else None)."""
        sampler = self.sampled.sampler
        return sampler if st.sampled and sampler is not None else None
