"""The fixes a diagnosis will name, tried on the saved failing step at the event.

Once a replay has located a failure (a module's forward or backward, or the loss), the fixes
that one step can test are applied to the step's micro-batches and it is re-run
(``trial.rerun_step``, with a replay's guarantees): the outcome of each, by fix id, goes
into the snapshot's detail (``detail.trials``) for the diagnosis to rank the fixes by.

========================= ===================================================================
fix id                    trial
========================= ===================================================================
``fp32_island``           the culprit module, and the same module in every block of its
                          ModuleList (what the fix wraps), with autocast off on fp32 inputs
``use_bf16``              bfloat16 autocast instead of float16, loss scale 1 (no scaler)
``loss_in_fp32``          the torch loss functions recomputed in fp32
``loss_on_logits``        the model's output and the loss in fp32 (autocast off): the
                          probabilities are not rounded in fp16
========================= ===================================================================

Which apply: a forward or backward culprit gets the island (unless it is the model itself,
whose island goes around an op in its code) and bf16 (in an fp16 autocast run); a loss that is
non-finite, or whose backward is, gets the loss in fp32 and bf16, and the logits form where
its backward is. An op that ran between two calls of the model (``computed.py``) gets none:
the trials re-run the calls on the inputs they were given, the op's bad output among them. A
loss written by hand cannot be recomputed: a trial's backward would start
from the gradient the real step recorded at the model's output, already non-finite, so those
trials are not run and say why (``singular.py`` measures what can be measured there). A trial
that is not run is ``{"tried": False, "note": why}``.

Where the loss's backward failed, ``Prover`` also checks whether it is singular in fp32 too
(``singular.py``): a torch loss function at once (``detail.loss_singular_fp32``), a loss
written by hand on the next event of the ``singular.Watch`` it arms, as an
``Event.LOSS_SINGULAR`` row.

Bounded: a few re-runs of one step, only on an event a replay located, once per culprit
module (each loss event: GradScaler's first calibration overflows a half loss's backward too,
before the failure does), at most ``MAX_PROVED`` per run, never on a steady step, and never
once the replay budget is spent (no replay, no trial). A failure inside leaves the replay's
finding as it was (``trials_error``); the run goes on.

Example (what ``Forensics`` does after a replay located the failure)::

    forensics.prover.after_replay(12, captures, finding, micro, scale)
    finding.detail.trials
    # {'fp32_island': {'tried': True, 'finite': True, 'loss': 2.31, ...},
    #  'use_bf16': {'tried': True, 'finite': False, 'first': 'backward', ...}}
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Optional

import torch

from ...runfile.detail import SingularOp, TriedFix
from ...runfile.payloads import LossSingular
from ...runfile.schema import Event, Phase
from . import singular
from .culprit import Culprit
from .trace import Capture, unwrap
from .trial import AS_RECORDED, LOSS_FP32, Outcome, Trial, forward

MAX_PROVED = 4  # events whose fixes are tried on the step, per run

HANDWRITTEN = ("the loss is written by hand (no torch loss function), so a trial cannot "
               "recompute it: its backward would start from the gradient the real step "
               "recorded at the model's output, already non-finite")


class Prover:
    """The trials of one recorder's forensic tier: which events had them, and the watch of a
    hand-written loss's singular op. ``forensics``: its ``Forensics`` (``trial``, ``guarded``,
    ``watched``, ``journal``, ``strict``)."""

    def __init__(self, forensics: Any):
        self.forensics = forensics
        self.proved: set = set()  # (phase, module) of the culprits tried, or (step,) of a loss
        self.watch: Optional[singular.Watch] = None

    def after_replay(self, step: int, captures: list, finding: Culprit, micro: int,
                     scale: Optional[float]) -> None:
        """The replay located ``finding`` at ``step``: its fixes tried on the step into
        ``finding.detail.trials`` (``prove``); where the loss's backward failed, the fp32
        check of a torch loss, or the watch armed for a hand-written one."""
        f, fz = finding, self.forensics
        key = (f.phase, f.module) if f.phase != Phase.LOSS else (step,)
        if not 0 <= micro < len(captures) or f.phase not in (
                Phase.FORWARD, Phase.BACKWARD, Phase.LOSS) or key in self.proved or \
                len(self.proved) >= MAX_PROVED or f.detail.accum_overflow or \
                f.detail.input_modified:
            return
        self.proved.add(key)
        began = time.perf_counter()
        try:
            f.detail.trials = prove(fz, captures, f, micro, scale, step)
            cap = captures[micro]
            if handwritten_backward(cap, f):
                self.watch = singular.Watch(step, step + singular.WATCH_STEPS)
            elif handwritten_nonfinite(cap, f):
                self.watch = singular.Watch(step, step + singular.WATCH_STEPS,
                                            singular.DIVISIONS)
            elif f.phase == Phase.LOSS and f.detail.output_grad_nonfinite:
                with fz.guarded(captures):
                    found = singular.torch_loss(cap, forward(cap, AS_RECORDED,
                                                             fz.watched.names))
                if found is not None:
                    f.detail.loss_singular_fp32 = found
        except Exception as exc:  # noqa: BLE001 - the replay's finding stands without them
            if fz.strict:
                raise
            f.detail.trials_error = f"{type(exc).__name__}: {exc}"[:300]
        f.detail.trials_seconds = round(time.perf_counter() - began, 4)

    def watching(self, st: Any) -> bool:
        """Is step ``st`` (the recorder's current step) one whose loss's graph is walked?"""
        return self.watch is not None and st is not None and self.watch.live(st.index)

    def read(self, cap: Capture, loss: torch.Tensor) -> None:
        """A watched step's loss, before its backward: its singular ops and their inputs, by
        reference (``singular.inputs``)."""
        if len(cap.singular) >= singular.MAX_READS:
            return
        try:
            ops = self.watch.ops if self.watch is not None else None
            cap.singular += singular.inputs(loss, cap.output_nodes, ops)
        except Exception as exc:  # noqa: BLE001 - the training step must go on without it
            if self.forensics.strict:
                raise
            self.watch = None
            self.forensics.journal.warn_once("singular", "reading the loss's graph failed "
                                             f"({type(exc).__name__}: {exc}); recording goes on")

    def at_event(self, step: Any, captures: list) -> None:
        """An event on a watched step: what the loss's singular ops held (``singular.measure``,
        host reads, event only) into an ``Event.LOSS_SINGULAR`` row; the watch ends."""
        if self.watch is None:
            return
        if step.index > self.watch.until:
            self.watch = None
            return
        reads = [r for c in captures for r in c.singular]
        if not reads:
            return
        self.watch = None
        try:
            measured = singular.measure(reads)
        except Exception as exc:  # noqa: BLE001 - the event goes on without it
            if self.forensics.strict:
                raise
            measured = [SingularOp(error=f"{type(exc).__name__}: {exc}"[:300])]
        worst = measured[0].fp32
        self.forensics.journal.event(Event.LOSS_SINGULAR, step,
                                     value=float(worst.nonfinite if worst else 0),
                                     text=LossSingular(ops=measured).to_text())


def plans(captures: list, f: Culprit, micro: int, names: dict) -> dict[str, Any]:
    """The trial of each fix that applies to finding ``f``: a ``Trial``, or the sentence
    saying why it is not tried."""
    cap = captures[micro]
    fp16 = bool(cap.autocast[1]) and cap.autocast[2] == "float16"
    half = any(p.is_floating_point() and p.dtype != torch.float32
               for p in unwrap(cap.root).parameters())
    bf16: Any = Trial("use_bf16", autocast="bfloat16", scale=1.0) if not half else (
        "the weights are half (made so by the code): bf16 autocast would run on them as they "
        "are, which is not the fix")
    out: dict[str, Any] = {}
    if f.detail.computed:  # (computed.py) made by the code between two model calls
        why = ("the op ran between two calls of the model, outside any module: a trial re-runs "
               "the calls on the inputs they were given, not the code between them")
        return {"fp32_island": why, **({"use_bf16": why} if fp16 else {})}
    if f.phase in (Phase.FORWARD, Phase.BACKWARD) and f.module:
        if f.call is not None and f.call.module is unwrap(cap.root) and \
                not _one_of_a_chain(captures, cap.root):
            out["fp32_island"] = ("the culprit is the model itself: its island goes around an "
                                  "op in its own forward, which a trial cannot rewrite")
        else:
            out["fp32_island"] = Trial("fp32_island",
                                       fp32_modules=tuple(siblings(f.module, names)))
        if fp16:
            out["use_bf16"] = bf16
    elif f.phase == Phase.LOSS:
        recomputed = bool(cap.loss_calls)
        out["loss_in_fp32"] = LOSS_FP32 if recomputed else HANDWRITTEN
        if f.detail.output_grad_nonfinite and not f.detail.loss_nonfinite:
            out["loss_on_logits"] = Trial("loss_on_logits", autocast="off", loss_fp32=True) \
                if recomputed else HANDWRITTEN
        if fp16:
            out["use_bf16"] = bf16 if recomputed else HANDWRITTEN
    return out


def prove(forensics: Any, captures: list, f: Culprit, micro: int, scale: Optional[float],
          step: int) -> dict[str, TriedFix]:
    """Run the trials of ``plans`` through ``forensics.trial`` (its guarantees: RNG forked,
    buffers restored, ``.grad`` untouched); each outcome as a dict, ``tried`` and ``step``
    added. The loss's own fp32 re-run that the replay already made is reused. A trial whose
    forward and loss are finite but whose gradients overflow at the recorded loss scale is
    run again at scale 1 (``at_scale``): GradScaler lowers its scale by itself, and a fix is
    not refuted by a scale too high for the fixed step."""
    out: dict[str, TriedFix] = {}
    for fix_id, plan in plans(captures, f, micro, forensics.watched.names).items():
        if isinstance(plan, str):
            out[fix_id] = TriedFix(note=plan)
            continue
        began = time.perf_counter()
        at: Optional[float] = None
        try:
            reused = f.detail.loss_fp32 if fix_id == "loss_in_fp32" else None
            done = reused if reused is not None else forensics.trial(captures, plan, scale)
            if _scale_bound(done, plan, scale):
                low = forensics.trial(captures, replace(plan, scale=1.0), scale)
                if low.finite:
                    done, at = low, 1.0
        except Exception as exc:  # noqa: BLE001 - a trial must never stop the training run
            if forensics.strict:
                raise
            out[fix_id] = TriedFix(note=f"the trial failed: {type(exc).__name__}: {exc}"[:300])
            continue
        if done.unjudged:
            out[fix_id] = TriedFix(note=done.unjudged)
            continue
        out[fix_id] = TriedFix.ran(done, step, round(time.perf_counter() - began, 4),
                                   list(plan.fp32_modules) or None, at,
                                   scale if at is not None else None)
    return out


def _scale_bound(done: Outcome, plan: Trial, scale: Optional[float]) -> bool:
    """Finite up to the gradients, which overflowed at a loss scale above 1."""
    return not done.finite and done.first == "backward" and \
        plan.scale is None and scale is not None and scale > 1.0


def _one_of_a_chain(captures: list, root: torch.nn.Module) -> bool:
    """Is ``root`` one model of several in the step, with no submodule of its own (a Gram
    matrix after a frozen extractor)? An island around it is then an island around its op."""
    inner = unwrap(root)
    return len({id(unwrap(c.root)) for c in captures}) > 1 and \
        next(inner.children(), None) is None


def handwritten_backward(cap: Capture, f: Culprit) -> bool:
    """The loss's backward is what failed, and the loss is written by hand: what
    ``singular.Watch`` is armed for."""
    return f.phase == Phase.LOSS and bool(f.detail.output_grad_nonfinite) and \
        not f.detail.loss_nonfinite and not cap.loss_calls


def handwritten_nonfinite(cap: Capture, f: Culprit) -> bool:
    """The loss itself is non-finite on finite outputs, and written by hand: the watch is
    armed with its divisions (``singular.DIVISIONS``), whose denominators say whether it was
    a count of zero (0/0 in any precision)."""
    return f.phase == Phase.LOSS and bool(f.detail.loss_nonfinite) and \
        not cap.loss_calls


def siblings(module: str, names: dict) -> list[str]:
    """``module`` and the same module in every block of its ModuleList, among the recorded
    module names (``blocks.0.attn`` -> ``blocks.0.attn``, ``blocks.1.attn``, ...), as the
    fix's snippet and its ``--apply`` wrap them."""
    parts = module.split(".")
    idx = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    if idx is None or not 0 < idx < len(parts) - 1:
        return [module]
    head, tail = ".".join(parts[:idx]) + ".", "." + ".".join(parts[idx + 1:])
    found = {n for n in names.values() if n.startswith(head) and n.endswith(tail)
             and n[len(head):len(n) - len(tail)].isdigit()}
    found.add(module)
    return sorted(found, key=lambda n: int(n[len(head):len(n) - len(tail)]))
