"""Which Linear layers to keep in bf16, measured: a sampled step re-run with layers in fp8.

The /fp8 statistics (``record/fp8.py``) say what a recipe's cast does to each operand; they
cannot say what that does to the training. This trial does, on one step:

1. **Kept.** At the end of each sampled step the recorder hands over the step's micro-batches
   (``keep``): CPU copies (``kept.offload``: the batch, the loss calls' held arguments, the
   output gradients only where no torch loss function was seen), within ``KEEP_BYTES``, the
   previous sampled step's dropped. One device-to-host copy per sampled step, no other cost;
   nothing on a step that is not sampled.
2. **Run once, when the recording closes** (``run``), on the last sampled step's batch with the
   run's final weights (where an outlier that grows over the run is largest): the step re-run
   as recorded (the reference: its loss and every parameter's gradient), then, for each
   recipe of ``RECIPES``, every Linear in emulated fp8 at once (``fp8matmul.in_fp8``), each
   Linear alone, and every Linear but those kept. Each re-run is a ``trial.rerun_grads`` with
   a replay's guarantees (``Forensics.guarded``: RNG forked, buffers and Python state put
   back, the user's hooks set aside, ``.grad`` untouched).
3. **Measured.** Against the reference: the loss's relative change, and the gradient's
   relative error ``||g - g0|| / ||g0||`` over every parameter together (with its cosine, and
   the parameter whose own gradient moved most).
4. **Decided.** A layer is kept in high precision when casting it alone moves the gradient by
   more than ``GRAD_ERROR`` or the loss by more than ``LOSS_CHANGE``; the all-but-kept re-run
   then says what the rest still do together. The recipe that suits the model is the one whose
   all-but-kept re-run stays within both thresholds with the fewest layers kept (then the
   smallest error; ties to the order of ``RECIPES``, cheapest first).

**Bounded** by ``budget`` seconds: the reference and each recipe's all-layers re-run first,
then the layers alone, the worst by the statistics first (``rank``), the recipes in turn, then
the all-but-kept re-runs; once the budget is spent the layers not tried are listed
(``untried``) and ``stopped`` says so. The result is one ``Event.FP8_TRIAL`` row whose text is
``payloads.Fp8Trial``; ``release/fp8.py`` reads it.

**A run already in fp8** (torchao's ``Float8Linear``) is re-run the other way round too
(``own``): its fp8 layers as the Linears they were (``fp8matmul.in_high_precision``) give the
reference, against which the step as recorded, and each fp8 layer alone kept in high precision
(or, cast per tensor, alone cast row-wise) are measured; where no loss was recomputed, the
change of sum <g, y> over the outputs and their recorded gradient g (``output_term``) gives
the loss change to first order. ``diagnosis/rules/fp8own.py`` reads it.

Not tried: ``delayed`` (its scale is an amax history of every step, which one step does not
hold); a step of several models, a sharded one, one whose loss was not captured and whose
output gradient was not kept (each said in ``note``).

Example (what the recorder does)::

    trial = TrialAtClose(forensics, tensor_id, budget=30.0)
    trial.rank(fp8_rows)                  # each sampled step's /fp8 rows
    trial.keep(step, forensics.captures)  # each sampled step, before the captures go
    payload = trial.run(last_step)        # at close: payloads.Fp8Trial, or None
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any, Callable, Optional

import numpy as np
import torch

from ...runfile.payloads import Fp8Effect, Fp8Own, Fp8OwnLayer, Fp8Recipe, Fp8Trial
from ...runfile.schema import Kind, Recipe
from ..fp8 import matmul_weight
from ..fp8layers import describe, is_float8
from ..sampler import tensors_in
from .fp8matmul import in_fp8, in_high_precision
from .kept import offload, reload
from .trace import unwrap
from .trial import AS_RECORDED, rerun_grads

RECIPES = {Recipe.TENSOR: "tensorwise", Recipe.ROWWISE: "rowwise", Recipe.MX: "mxfp8"}
# A layer is kept when casting it alone moves the step's gradient by more than this share of
# its norm. Rounding to e4m3 alone costs an operand about 3 % (its 30 dB); a layer whose three
# operands each lose that moves its own weight's gradient by about 5 %, and the gradient of the
# whole model by less. 10 % is twice what a cast within the format's rounding does, and far
# below what a flushed or saturated operand does (docs/fp8.md shows both, measured).
GRAD_ERROR = 0.1
# ... or the loss by more than this share of it (a cast that shifts the forward's output).
LOSS_CHANGE = 0.01
BUDGET_SECONDS = 30.0
KEEP_BYTES = 64 << 20  # CPU copies of the sampled step kept for the trial


class TrialAtClose:
    """The recorder's side of the trial (see the module docstring)."""

    def __init__(self, forensics: Any, tensor_id: Callable[..., int],
                 budget: float = BUDGET_SECONDS):
        self.forensics = forensics
        self.tensor_id = tensor_id
        self.budget = budget
        self.step = -1  # the sampled step kept
        self.captures: list = []
        self.note = ""  # why nothing is kept ("" : something is, or no sampled step yet)
        self._risk: dict[tuple[int, int], tuple[float, float]] = {}

    def rank(self, rows: np.ndarray) -> None:
        """Fold a sampled step's /fp8 rows into each (layer, recipe)'s risk: the largest share
        of an operand's values flushed, saturated or (a tenth) subnormal, then its lowest SQNR."""
        for r in rows:
            n = max(int(r["sample_n"]) - int(r["zeros"]), 1)
            lost = (int(r["flushed"]) + int(r["saturated"]) + int(r["subnormal"]) / 10) / n
            sqnr = float(r["sqnr_db"]) if math.isfinite(float(r["sqnr_db"])) else math.inf
            key = (int(r["tensor"]), int(r["recipe"]))
            old = self._risk.get(key, (0.0, math.inf))
            self._risk[key] = (max(old[0], lost), min(old[1], sqnr))

    def keep(self, step: int, captures: list) -> None:
        """The sampled step's micro-batches, copied to the CPU (the previous ones dropped);
        a failure drops them and says why, never more."""
        self.captures, self.step = [], -1
        try:
            self._keep(step, captures)
        except Exception as exc:  # noqa: BLE001 - the trial must never stop the recording
            if self.forensics.strict:
                raise
            self.captures, self.note = [], f"not kept: {type(exc).__name__}: {exc}"[:300]

    def _keep(self, step: int, captures: list) -> None:
        captures = [c for c in captures if not c.open]  # (a call that raised never closed)
        if not captures:
            self.note = ("no model call of the step was captured whole (the forensic tier "
                         "had spent its replays, or the call raised)")
            return
        if len({id(unwrap(c.root)) for c in captures}) > 1:
            self.note = "a step of several models: not tried"
            return
        if self.forensics.watched.sharding is not None:
            self.note = "a sharded model: not tried"
            return
        inputs = sum(_nbytes((c.args, c.kwargs)) for c in captures)
        grads = [not c.loss_calls for c in captures]
        total = inputs + sum(_nbytes(c.grads) for c, g in zip(captures, grads) if g)
        if total > KEEP_BYTES:
            self.note = f"the step's batch was over {KEEP_BYTES >> 20} MiB"
            return
        self.captures = [offload(c, g) for c, g in zip(captures, grads)]
        self.step, self.note = step, ""

    def run(self, at_step: int) -> Optional[Fp8Trial]:
        """The trial on the kept step (the module docstring); None where no step was kept and
        nothing says why."""
        if not self.captures:
            return Fp8Trial(note=self.note) if self.note else None
        out = Fp8Trial(step=self.step, weights_step=at_step, budget=self.budget,
                      thresholds={"grad_error": GRAD_ERROR, "loss_change": LOSS_CHANGE})
        start = time.perf_counter()
        try:
            _Run(self, out, start).all()
        except Exception as exc:  # noqa: BLE001 - the trial must never stop the recording
            if self.forensics.strict:
                raise
            out.error = f"{type(exc).__name__}: {exc}"[:300]
        out.seconds = round(time.perf_counter() - start, 3)
        self.captures = []
        return out

    def layers(self, root: torch.nn.Module) -> dict[str, torch.nn.Module]:
        names = self.forensics.watched.names
        # (a Linear torchao or TransformerEngine made fp8 already, under --apply fp8, is not
        # cast again)
        return {names[m]: m for m in root.modules()
                if m in names and matmul_weight(m) is not None and
                not type(m).__module__.startswith(("torchao", "transformer_engine"))}

    def own_layers(self, root: torch.nn.Module) -> dict[str, torch.nn.Module]:
        """The layers the run already trains in fp8 (torchao's ``Float8Linear``), by name."""
        names = self.forensics.watched.names
        return {names[m]: m for m in root.modules() if m in names and is_float8(m)}

    def risk(self, name: str, module: torch.nn.Module, recipe: Recipe) -> tuple:
        """Sort key, the most at risk by the statistics first (unmeasured layers last)."""
        tid = self.tensor_id(Kind.OUTPUT, name, 0, None, type(module).__name__)
        lost, sqnr = self._risk.get((tid, int(recipe)), (-1.0, math.inf))
        return (-lost, sqnr)


class _Run:
    """One trial: the reference, then the recipes' re-runs within the budget."""

    def __init__(self, owner: TrialAtClose, out: Fp8Trial, start: float):
        self.owner, self.out, self.start = owner, out, start
        self.captures = [reload(c) for c in owner.captures]
        self.root = unwrap(self.captures[0].root)
        self.params = [p for p in self.root.parameters() if p.requires_grad]
        self.pnames = [owner.forensics.watched.param_names.get(id(p), "param")
                       for p in self.params]
        self.layers = owner.layers(self.root)
        self.runs = 0
        self.reference: tuple = (None, [])
        # rerun's sum <g, y> where no loss was recomputed: the last re-run's, the reference's
        # and the high-precision one's
        self.linear: Optional[float] = None
        self.recorded_linear: Optional[float] = None
        self.linear_high: Optional[float] = None

    def all(self) -> None:
        loss, grads, note = self.rerun([], Recipe.TENSOR)
        if not grads:
            self.out.note = note or "no gradient reached the parameters"
            return
        if not _finite(loss, grads):
            self.out.note = "the step re-run as recorded was not finite: nothing to compare"
            return
        self.reference = (loss, grads)
        self.recorded_linear = self.linear
        self.out.loss = loss
        own = self.owner.own_layers(self.root)
        if own:
            self.out.own = self.own(own)
        recipes: dict[str, Fp8Recipe] = {}
        everything = list(self.layers)
        for recipe, name in RECIPES.items():
            recipes[name] = Fp8Recipe(all=self.effect(everything, recipe), keep=[])
        order = {r: self.ranked(everything, r) for r in RECIPES}
        for i in range(len(everything)):
            for recipe, name in RECIPES.items():
                layer = order[recipe][i]
                if self.spent(reserve=len(RECIPES)):
                    recipes[name].untried.append(layer)
                    continue
                recipes[name].layers[layer] = self.effect([layer], recipe)
        for recipe, name in RECIPES.items():
            self.decide(recipes[name], recipe, everything)
        self.out.recipes = recipes
        self.out.suits = suits(recipes)
        self.out.runs = self.runs
        if any(r.untried for r in recipes.values()):
            self.out.stopped = (f"the budget of {self.owner.budget:g} s was spent after "
                                   f"{self.runs} re-runs")

    def own(self, own: dict) -> Fp8Own:
        """A run already in fp8, the other way round: the high-precision re-run (every fp8
        layer as the Linear it was) is the reference; against it, the step as recorded
        (``as_recorded``: what fp8 does to this step's gradient), then each fp8 layer alone
        kept in high precision (``layers[NAME].high_precision``: what is left with it
        kept) and, for a layer cast per tensor, alone in row-wise scaling (``rowwise``)."""
        loss, grads, note = self.rerun([], Recipe.TENSOR, high=list(own.values()))
        if not grads or not _finite(loss, grads):
            return Fp8Own(note=note or "the step re-run in high precision was not finite")
        ref_loss, ref = self.reference
        self.linear_high = high = self.linear
        as_recorded = measured(ref_loss, ref, loss, grads, self.pnames)
        if high is not None and self.recorded_linear is not None:
            as_recorded = replace(as_recorded, output_term=self.recorded_linear - high)
        layers: dict[str, Fp8OwnLayer] = {}
        out = Fp8Own(loss=loss, as_recorded=as_recorded, layers=layers,
                     thresholds={"grad_error": GRAD_ERROR, "loss_change": LOSS_CHANGE})
        for name, module in own.items():
            if self.spent(reserve=len(RECIPES)):
                out.untried = (out.untried or []) + [name]
                continue
            rest = [m for n, m in own.items() if n != name]
            rowwise = (describe(module) or {}).get("recipe") == "tensorwise"
            layers[name] = Fp8OwnLayer(
                high_precision=self.against(loss, grads, [], rest),
                rowwise=self.against(loss, grads, [module], rest, Recipe.ROWWISE)
                if rowwise else None)
        return out

    def against(self, loss: Optional[float], grads: list, cast: list, high: list,
                recipe: Recipe = Recipe.TENSOR) -> Fp8Effect:
        """A re-run (``cast`` in emulated fp8 under ``recipe``, ``high`` in high precision,
        the rest as recorded) measured against the high-precision one."""
        got_loss, got, note = self.rerun(cast, recipe, high=high)
        effect = measured(got_loss, got, loss, grads, self.pnames, note)
        if self.linear is not None and self.linear_high is not None:
            effect = replace(effect, output_term=self.linear - self.linear_high)
        return effect

    def decide(self, recipe: Fp8Recipe, which: Recipe, everything: list) -> None:
        tried = recipe.layers
        keep = [n for n, e in tried.items() if over(e)]
        recipe.keep = sorted(keep, key=lambda n: -_num(tried[n].grad_error))
        rest = [n for n in everything if n not in keep]
        if keep and rest:
            recipe.all_but_keep = self.effect(rest, which)
        elif not keep:
            recipe.all_but_keep = recipe.all

    def spent(self, reserve: int = 0) -> bool:
        """The budget is spent, keeping room for ``reserve`` more re-runs."""
        elapsed = time.perf_counter() - self.start
        each = elapsed / max(self.runs, 1)
        return elapsed + reserve * each > self.owner.budget

    def ranked(self, names: list, recipe: Recipe) -> list:
        return sorted(names, key=lambda n: self.owner.risk(n, self.layers[n], recipe))

    def effect(self, names: list, recipe: Recipe) -> Fp8Effect:
        loss, grads, note = self.rerun([self.layers[n] for n in names], recipe)
        ref_loss, ref = self.reference
        return measured(loss, grads, ref_loss, ref, self.pnames, note)

    def rerun(self, modules: list, recipe: Recipe, high: Optional[list] = None
              ) -> tuple[Optional[float], list, str]:
        """The kept step's loss (summed over micro-batches) and gradients (summed), with
        ``modules`` in emulated fp8 under ``recipe`` (and the fp8 layers ``high`` in high
        precision). Where no loss was recomputed (the backward ran from the recorded output
        gradient g), ``self.linear`` is sum <g, y> over the outputs y: the difference of two
        re-runs' is their loss difference to first order."""
        self.runs += 1
        total: list = [None] * len(self.params)
        losses, note = [], ""
        pairs: list = []
        names = self.owner.forensics.watched.names
        with self.owner.forensics.guarded(self.captures), in_fp8(modules, recipe), \
                in_high_precision(high or []):
            for cap in self.captures:
                outcome, grads = rerun_grads(cap, AS_RECORDED, names, pairs)
                note = note or outcome.note
                if outcome.loss is not None:
                    losses.append(outcome.loss)
                for i, g in enumerate(grads):
                    if g is not None:
                        g = g.detach().float()
                        g = g.to_dense() if g.is_sparse else g  # (an embedding's, sparse=True)
                        total[i] = g if total[i] is None else total[i] + g
        self.linear = None if losses or not pairs else float(
            sum((x.float() * g.float()).sum() for x, g in pairs))
        if all(g is None for g in total):
            return None, [], note
        grads = [g if g is not None else torch.zeros(p.shape, device=p.device)
                 for g, p in zip(total, self.params)]
        return (sum(losses) if losses else None), grads, note


def measured(loss: Optional[float], grads: list, ref_loss: Optional[float], ref: list,
             names: list, note: str = "") -> Fp8Effect:
    """The effect of one re-run against the reference: the loss, its relative change, the
    gradient's relative error and cosine over every parameter, the parameter that moved most
    (one read of the device per re-run)."""
    if not grads:
        return Fp8Effect(loss=loss, note=note or "no gradient")
    parts = torch.stack([torch.stack([(g - r).square().sum(), r.square().sum(), (g * r).sum(),
                                      g.square().sum()]) for g, r in zip(grads, ref)])
    d, b, dot, gg = parts.double().cpu().numpy().T
    with np.errstate(divide="ignore", invalid="ignore"):
        error = math.sqrt(d.sum() / b.sum()) if b.sum() > 0 else math.inf
        cosine = dot.sum() / math.sqrt(gg.sum() * b.sum()) if gg.sum() * b.sum() > 0 else 0.0
        each = np.where(b > 0, np.sqrt(d / b), 0.0)
    worst = int(np.nanargmax(each)) if np.isfinite(each).any() else 0
    change = None
    if loss is not None and ref_loss is not None:
        change = (loss - ref_loss) / abs(ref_loss) if ref_loss else loss - ref_loss
    # (written as text where not finite: a NaN error as "inf", a non-finite cosine as "nan")
    return Fp8Effect(loss=loss, loss_change=change,
                     grad_error=error if math.isfinite(error) else math.inf,
                     grad_cosine=float(cosine) if math.isfinite(cosine) else math.nan,
                     worst_param=names[worst], worst_param_error=float(each[worst]))


def over(effect: Fp8Effect) -> bool:
    """Does this effect pass a threshold (a non-finite one always does)?"""
    change = effect.loss_change
    return _num(effect.grad_error if effect.grad_error is not None else 0.0) > GRAD_ERROR or \
        (change is not None and not abs(_num(change)) <= LOSS_CHANGE)


def suits(recipes: dict[str, Fp8Recipe]) -> str:
    """The recipe whose all-but-kept re-run is within both thresholds with the fewest layers
    kept, then the smallest gradient error (``RECIPES``' order breaks ties); "" where none is."""
    ok = [(len(r.keep or []), _num(_or(r.all_but_keep.grad_error, math.inf)), i, name)
          for i, (name, r) in enumerate(recipes.items())
          if r.all_but_keep is not None and not over(r.all_but_keep) and not r.untried]
    return min(ok)[3] if ok else ""


def _finite(loss: Optional[float], grads: list) -> bool:
    if loss is not None and not math.isfinite(loss):
        return False
    return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.inf


def _or(value: Optional[float], default: float) -> float:
    return value if value is not None else default


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in(value))
