"""The fix registry: ``@fix`` registers a writer under its id, ``make`` writes the fixes for a
run's ``Context``; ``Fix`` and ``Dose`` are what a diagnosis carries; the helpers every writer
shares (a number as a literal, the clip lines, a submodule's expression).
"""

from __future__ import annotations

import functools
import keyword
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union


@dataclass
class Dose:
    """The numbers a snippet uses, by name (``{"lr": 0.0012}``), and where they come from in
    one clause ("median update ratio 10 at LR 1.43 ...", or which default and why)."""

    values: dict[str, float]
    source: str


# What a fix prescribes when the run holds too little to measure it, and why that value
# (``Dose.source`` says "default: ..."): diagnosis/dose.py falls back to these.
DEFAULTS = {
    "init_scale": Dose({"init_scale": 65536.0}, "GradScaler's own default 2**16 (no sampled "
                       "gradient to measure)"),
    "eps": Dose({"eps": 1e-4}, "default 1e-4 (no finite gradient sampled to measure): far above "
                "fp16's smallest 6e-08, and m/eps stays small"),
    "max_norm": Dose({"max_norm": 1.0}, "the common default 1.0 (too few healthy steps to "
                     "measure the gradient norm)"),
}


@dataclass
class Context:
    """What the snippets may name, taken from the run."""

    device: str = "cuda"
    optimizer: str = "AdamW"
    lr: Optional[float] = None
    eps: Optional[float] = None
    init_scale: Optional[float] = None
    growth_interval: Optional[int] = None
    module: Optional[str] = None  # culprit module path, e.g. "blocks.3.attn"
    module_type: Optional[str] = None  # its class, e.g. "Attention"
    autocast: Optional[str] = None  # "float16", "bfloat16" or None
    step: Optional[int] = None  # the first bad step, for comments
    ratio: Optional[float] = None  # how much smaller the small gradients are than the rest
    op: Optional[str] = None  # the op inside the module that went non-finite first ("exp")
    root: bool = False  # the module is the model itself: the op sits in its own forward
    low: Optional[str] = "fp16"  # the run's low precision: "fp16", "bf16" or None (fp32)
    scaler: bool = True  # the run uses a GradScaler
    blowup_lr: Optional[float] = None  # the LR at which the loss blew up (a finite divergence)
    blowup_step: Optional[int] = None
    rank: Optional[int] = None  # the rank a failure began on (multi-rank runs)
    # What a check measured about the data, for check_data: {"kind": "nonfinite" | "range" |
    # "targets", "step": S, ...} (None: no check found a bad batch, and the fix says so).
    data: Optional[dict] = None
    # the culprit and the same module in every block of its ModuleList, as recorded (a rule
    # that saw the failure in more modules than one adds theirs: what an island must cover)
    siblings: list[str] = field(default_factory=list)
    # every recorded module of the culprit's class, in the order the forward met them
    kin: list[str] = field(default_factory=list)
    # the culprit's own parameters, by attribute name as recorded ("g" for norm.g)
    params: list[str] = field(default_factory=list)
    # the training command as the run recorded it (sys.argv of the script), and its ranks
    argv: list[str] = field(default_factory=list)
    world_size: int = 1
    # what the training code calls the recorded modules: {recorded path: expression}
    # (/meta handles); {} gives "model" for the root
    handles: dict = field(default_factory=dict)
    clip_max_norm: Optional[float] = None  # the max_norm the script's clip passed
    # the clip function the script called (clip_grad_norm_, clip_grads_with_norm_ after
    # get_total_norm, clip_grad_value_, timm's adaptive_clip_grad) and the clip_value (or
    # the clip factor) it passed
    clip_call: str = "clip_grad_norm_"
    clip_value: Optional[float] = None
    replayed: Optional[int] = None  # the failing step a forensic replay re-ran, if any
    # The loss's op whose derivative is infinite at a point, as the replay measured it, for
    # clamp_loss_input: {"op", "exponent", "eps", "step", "dtype", "points", "source"}
    singular: Optional[dict] = None
    # a run that trains layers in fp8: {"recipe": torchao's recipe name, "keep": the layers
    # `record --apply fp8` already left in high precision}, and for an operand several ranks
    # share, its layout: "by" ("ddp", "dtensor"), "role", "group" (None: no fp8 layer)
    fp8: Optional[dict] = None
    # What the compiled replay of a compiled model's step found, for the compiler fixes:
    # {"region", "op", "op_module", "finite_backend", "backends"} (None: not compiled)
    compiled: Optional[dict] = None
    # What the fixes' premises read (fixes/premises.py): the replay of the failure at ``step``
    # (``module``'s where one is named: {"module", "phase", "fp32_finite", "op"}), and whether
    # the model's recorded activations are all smooth ones (no ReLU to swap)
    culprit: Optional[dict] = None
    relu_free: bool = False
    # the run's measurer (diagnosis/dose.py): a dose by name ("lr", "init_scale", "eps",
    # "max_norm"); None: no run behind this context, the DEFAULTS serve
    measure: Optional[Callable[[str], Optional[Dose]]] = field(default=None, repr=False)

    def dose(self, name: str) -> Optional[Dose]:
        """The run's number for ``name`` with its source, else the documented default (None
        for the LR, which has no default without a run)."""
        found = self.measure(name) if self.measure is not None else None
        return found if found is not None else DEFAULTS.get(name)


@dataclass
class Fix:
    """One fix: its id, the advice, the snippet, the numbers the snippet uses (``values``)
    and their ``source``; the ``--apply`` argument that tries it on a whole run (None: it
    cannot be applied from outside the code, ``apply_note`` says why); and whether it was
    tried on the saved failing step (``tried``, ``outcome``: the result, or why not;
    ``finite``: the step came out finite with it; ``proven``: True when its loss also lies in
    the run's own range, False when it is not finite or its loss is out of that range, None
    when not tried or nothing to compare its loss with)."""

    id: str
    text: str
    snippet: str = ""
    values: dict = field(default_factory=dict)
    source: str = ""
    apply: Optional[str] = None
    apply_note: str = ""
    tried: bool = False
    outcome: str = ""
    finite: Optional[bool] = None
    proven: Optional[bool] = None


# What a fix function returns: the advice (a sentence or three) and its code snippet, and the
# dose its numbers come from when it has any.
Advice = Union[tuple[str, str], tuple[str, str, Optional[Dose]]]


# How a fix is tried on a whole run: the ``--apply`` argument for a context, or None.
Applier = Callable[["Context"], Optional[str]]


# Every id a diagnosis can suggest, with what it means (the README's table is checked against
# it by the tests), and the function that writes it; both filled by ``@fix``.
FIX_IDS: dict[str, str] = {}


MAKERS: dict[str, Callable[[Context], Fix]] = {}


# Why the replay of one saved step cannot try a fix, by fix id (the rest it may try).
NOT_REPLAYABLE: dict[str, str] = {}


# What must hold for a fix to apply, by fix id (fixes/premises.py): the fact that rules it out
# for a context, as a clause, or None where it holds.
Premise = Callable[["Context", Optional["Fix"]], Optional[str]]
PREMISES: dict[str, Premise] = {}


def fix(fix_id: str, meaning: str, *, apply: Union[str, Applier, None] = None,
        manual: str = "", replay: str = "", premise: Optional[Premise] = None
        ) -> Callable[[Callable[[Context], Advice]], Callable[[Context], Fix]]:
    """Register the decorated function as the writer of fix ``fix_id`` (``meaning``: one line
    for the README's table); the function returns ``(advice, snippet[, dose])`` and the
    registered one the ``Fix``.

    ``apply``: the ``record --apply`` argument that tries the fix (a string, or a function of
    the context that may return None); ``manual``: why it cannot be applied from outside the
    code, when it cannot; ``replay``: why the replay of the failing step cannot try it (a fix
    that needs many steps), when it cannot.
    """

    def register(write: Callable[[Context], Advice]) -> Callable[[Context], Fix]:
        assert fix_id not in FIX_IDS, f"fix {fix_id} registered twice"

        @functools.wraps(write)
        def made(c: Context) -> Fix:
            out = write(c)
            dose = out[2] if len(out) > 2 else None
            arg = apply(c) if callable(apply) else apply
            return Fix(fix_id, out[0], out[1], values=dict(dose.values) if dose else {},
                       source=dose.source if dose else "", apply=arg,
                       apply_note="" if arg else manual or "it cannot be applied from outside "
                       "the code here", outcome=_not_tried(fix_id, c))

        FIX_IDS[fix_id] = meaning
        MAKERS[fix_id] = made
        if replay:
            NOT_REPLAYABLE[fix_id] = replay
        if premise is not None:
            PREMISES[fix_id] = premise
        return made

    return register


def _not_tried(fix_id: str, c: Context) -> str:
    """Why a fix has not been tried on the saved failing step (the replay's fix trials fill
    ``tried`` and ``outcome`` where they run)."""
    if fix_id in NOT_REPLAYABLE:
        return f"not tried: {NOT_REPLAYABLE[fix_id]}"
    if c.replayed is None:
        return "not tried: no replay of the failing step"
    return f"not tried: the replay of step {c.replayed} ran the step as it was, without this fix"


def literal(x: Optional[float], default: str) -> str:
    """``x`` as a Python literal for a snippet, to the two significant digits the doses are
    rounded to: 3e-4, 1.4e-4, 1e-8, 0.05, 7.5 (``default`` for None)."""
    if x is None:
        return default
    if not math.isfinite(x):  # (an infinite LR a file recorded: torch takes one)
        return f"float({str(float(x))!r})"
    if float(x).is_integer() and 1e4 <= abs(x) < 1e16:
        return str(int(x))  # a loss scale: 65536
    if x and (abs(x) < 1e-3 or abs(x) >= 1e4):
        mantissa, exponent = f"{x:.1e}".split("e")
        mantissa = mantissa.rstrip("0").rstrip(".")
        return f"{mantissa}e{int(exponent)}"
    return f"{x:g}"


def clip_step(scaler: bool, max_norm: str = "1.0") -> str:
    """The backward-to-step lines with gradient clipping (after unscale_ under a scaler)."""
    clip = f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={max_norm})\n"
    if scaler:
        return ("scaler.scale(loss).backward()\n"
                "scaler.unscale_(optimizer)\n" + clip +
                "scaler.step(optimizer)\n"
                "scaler.update()")
    return "loss.backward()\n" + clip + "optimizer.step()"


def max_norm(c: Context) -> tuple[str, Optional[Dose]]:
    """The clip threshold for a snippet, and its dose: the script's own max_norm where it
    clips, else the run's healthy grad norms (else the default)."""
    dose = c.dose("max_norm")
    if c.clip_max_norm and (dose is None or dose.values.get("max_norm") != c.clip_max_norm):
        dose = Dose({"max_norm": float(c.clip_max_norm)}, "the script's own clip, "
                    f"max_norm={c.clip_max_norm:g}")
    value = dose.values.get("max_norm") if dose else None
    return (literal(value, "1.0") if value else "1.0"), dose


def joined(*doses: Optional[Dose]) -> Optional[Dose]:
    """Several doses as one: their values together, their sources joined by "; "."""
    found = [d for d in doses if d is not None]
    if not found:
        return None
    values: dict[str, float] = {}
    for d in found:
        values.update(d.values)
    if len(found) == 1:
        return found[0]

    def named(d: Dose) -> str:  # "lr 0.0056: update ratio ..."
        name, value = next(iter(d.values.items()), ("value", None))
        return f"{name} {literal(value, '?')}: {d.source}"

    return Dose(values, "; ".join(named(d) for d in found if d.source))


def module_expr(path: str, handles: Optional[dict] = None, root: str = "model") -> str:
    """Python expression for a recorded module, from the script's own name for it or for the
    module above it (``handles``, else ``root`` for the model): 'blocks.3.attn' ->
    'model.blocks[3].attn'; a name that is no identifier goes through ``get_submodule`` with
    the name quoted, so the expression is valid Python for any name."""
    base, rest = _handle(path, handles or {}, root)
    out = base
    for part in rest.split(".") if rest else []:
        if part.isdigit():
            out += f"[{part}]"
        elif part.isidentifier() and not keyword.iskeyword(part):
            out += f".{part}"
        else:
            return f"{base}.get_submodule({rest!r})"
    return out


def assign_module(path: str, value: str, handles: Optional[dict] = None,
                  root: str = "model") -> str:
    """A statement that puts ``value`` where the recorded module ``path`` is: an attribute or
    index assignment, or ``setattr`` on its parent for a name that is no identifier."""
    target = module_expr(path, handles, root)
    if "get_submodule(" not in target:
        return f"{target} = {value}"
    parent, _, leaf = path.rpartition(".")
    holder = module_expr(parent, handles, root) if parent else _handle("", handles or {},
                                                                        root)[0]
    return f"setattr({holder}, {leaf!r}, {value})"


def one_line(text: Any) -> str:
    """A name put on a comment line of a snippet: no line break can end the comment early."""
    return " ".join(str(text).split())


def _handle(path: str, handles: dict, root: str) -> tuple[str, str]:
    """(the script's expression for the nearest recorded module at or above ``path`` that it
    has a name for, the rest of the path below it); ``root`` for the model without one."""
    matches = [k for k in handles if k == "" or path == k or path.startswith(k + ".")]
    if not matches:
        return root, path
    best = max(matches, key=len)
    return handles[best], path[len(best):].lstrip(".")


def make(ids: list[str], context: Context) -> list[Fix]:
    """The fixes ``ids``, in that order, written for ``context``: those whose premise holds
    there (bf16 only to a run in fp16, a lower LR only where the LR is above 0, ...)."""
    made = (MAKERS[i](context) for i in ids)
    return [fx for fx in made if unmet(fx, context) is None]


def unmet(fx: Fix, context: Context) -> Optional[str]:
    """Why ``fx`` does not apply to ``context``: its premise's failed fact, else None."""
    premise = PREMISES.get(fx.id)
    return premise(context, fx) if premise is not None else None


def is_attention(module: Optional[str], module_type: Optional[str]) -> bool:
    """Does the name or class look like an attention block (for the cheaper fix)?"""
    text = f"{module or ''} {module_type or ''}".lower()
    return bool(re.search(r"attn|attention|mha|selfatt", text))
