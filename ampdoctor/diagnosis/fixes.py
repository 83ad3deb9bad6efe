"""The fixes a diagnosis suggests, each with a snippet written for the user's own run.

A fix id is part of the public contract (JSON output, tests, docs). Snippets use what the run
recorded: the culprit module's path and class (``blocks.3.attn``, ``Attention``), the optimizer
class and its learning rate and eps, the scaler's settings, the autocast device. The names of
the user's *variables* are not recorded, so snippets call them ``model``, ``optimizer``,
``scaler`` and ``loss``.

Each fix is one function, registered under its id by ``@fix(id, meaning)``: it returns the
advice and its snippet (and, when the snippet carries a number, the ``Dose`` it took the
number from), and ``make`` turns them into a ``Fix`` with that id.

The numbers are the run's: ``Context.dose(name)`` asks the measurer the diagnosis gives the
context (``diagnosis/dose.py``: the LR from the update ratios, the loss scale from the
gradients, Adam's eps from the optimizer state, ``max_norm`` from the healthy steps), and a
context with no run behind it gets the documented defaults of ``DEFAULTS``, each saying why.

Each fix also says how to try it on the whole run with no code change (``apply``: the
argument of ``ampdoctor record --apply``, see ``record/prescription.py``), or why it cannot be
applied from outside the code (``apply_note``); and whether it was tried on the saved failing
step (``tried``, ``outcome``, ``finite``: filled by the forensic replay where it can try it).

Example::

    ctx = Context(module="blocks.3.attn", module_type="Attention", lr=3e-4)
    [fx.id for fx in make(["fp32_island", "lower_lr"], ctx)]   # ['fp32_island', 'lower_lr']
    make(["adam_eps"], ctx)[0].values                          # {'eps': 0.0001} (the default)

numpy-free and torch-free: plain strings. Over 600 lines on purpose: one short writer per fix
id, all of them here, so that the public ids, their texts and their snippets read together.
"""

from __future__ import annotations

import functools
import keyword
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from ..numfmt import fmt


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
    clip_max_norm: Optional[float] = None  # the max_norm the script's clip_grad_norm_ passed
    replayed: Optional[int] = None  # the failing step a forensic replay re-ran, if any
    # The loss's op whose derivative is infinite at a point, as the replay measured it, for
    # clamp_loss_input: {"op", "exponent", "eps", "step", "dtype", "points", "source"}
    singular: Optional[dict] = None
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
    ``finite``: the step came out finite with it)."""

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


def fix(fix_id: str, meaning: str, *, apply: Union[str, Applier, None] = None,
        manual: str = "", replay: str = "") -> Callable[[Callable[[Context], Advice]],
                                                        Callable[[Context], Fix]]:
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


def _literal(x: Optional[float], default: str) -> str:
    """``x`` as a Python literal for a snippet, to the two significant digits the doses are
    rounded to: 3e-4, 1.4e-4, 1e-8, 0.05, 7.5 (``default`` for None)."""
    if x is None:
        return default
    if float(x).is_integer() and 1e4 <= abs(x) < 1e16:
        return str(int(x))  # a loss scale: 65536
    if x and (abs(x) < 1e-3 or abs(x) >= 1e4):
        mantissa, exponent = f"{x:.1e}".split("e")
        mantissa = mantissa.rstrip("0").rstrip(".")
        return f"{mantissa}e{int(exponent)}"
    return f"{x:g}"


def _clip_step(scaler: bool, max_norm: str = "1.0") -> str:
    """The backward-to-step lines with gradient clipping (after unscale_ under a scaler)."""
    clip = f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={max_norm})\n"
    if scaler:
        return ("scaler.scale(loss).backward()\n"
                "scaler.unscale_(optimizer)\n" + clip +
                "scaler.step(optimizer)\n"
                "scaler.update()")
    return "loss.backward()\n" + clip + "optimizer.step()"


def _max_norm(c: Context) -> tuple[str, Optional[Dose]]:
    """The clip threshold for a snippet (the run's healthy grad norms), and its dose."""
    dose = c.dose("max_norm")
    value = dose.values.get("max_norm") if dose else None
    return (_literal(value, "1.0") if value else "1.0"), dose


def _joined(*doses: Optional[Dose]) -> Optional[Dose]:
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
        return f"{name} {_literal(value, '?')}: {d.source}"

    return Dose(values, "; ".join(named(d) for d in found if d.source))


def module_expr(path: str, root: str = "model") -> str:
    """Python expression for a submodule: 'blocks.3.attn' -> 'model.blocks[3].attn'."""
    out = root
    for part in path.split("."):
        if part.isdigit():
            out += f"[{part}]"
        elif part.isidentifier() and not keyword.iskeyword(part):
            out += f".{part}"
        else:
            return f'{root}.get_submodule("{path}")'
    return out


def _listed(path: str) -> Optional[tuple[str, str]]:
    """(the ModuleList, the path inside a block) for 'blocks.3.attn' -> ('blocks', 'attn');
    None for a module in no ModuleList."""
    parts = path.split(".")
    idx = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    if idx is not None and 0 < idx < len(parts) - 1:
        return ".".join(parts[:idx]), ".".join(parts[idx + 1:])
    return None


def _wrap_lines(path: str, wrapper: str) -> str:
    """Assignments wrapping ``path`` (and its siblings in the same ModuleList) in ``wrapper``."""
    listed = _listed(path)
    if listed is not None:
        container, rest = module_expr(listed[0]), listed[1]
        inner = module_expr(rest, "block")
        return (f"for block in {container}:  # {path} and the same module in every block\n"
                f"    {inner} = {wrapper}({inner})")
    target = module_expr(path)
    return f"{target} = {wrapper}({target})"


def _wrap_all(paths: list[str], wrapper: str) -> str:
    """``_wrap_lines`` for each of ``paths``, one loop per ModuleList they share."""
    lines, seen = [], set()
    for path in paths:
        key = _listed(path) or path
        if key not in seen:
            seen.add(key)
            lines.append(_wrap_lines(path, wrapper))
    return "\n".join(lines)


def _island_targets(c: Context) -> list[str]:
    """What an fp32 island covers: the culprit, its siblings and the modules the rule saw the
    same failure in (``Context.siblings``)."""
    head = [] if not c.module or c.module in c.siblings else [c.module]
    return list(dict.fromkeys(head + c.siblings))


def _beyond(c: Context, targets: list[str]) -> list[str]:
    """Those of ``targets`` that the culprit's own loop (its ModuleList) does not cover."""
    own = _listed(c.module or "")
    return [t for t in targets if t != c.module and (own is None or _listed(t) != own)]


def _op_island(c: Context) -> Advice:
    """The culprit is the model itself: the island goes around the op in its forward."""
    cls = c.module_type or c.module or "the model"
    op = c.op or "the op"
    snippet = (f"# in {cls}.forward, around {op} (and the ops that produce its input):\n"
               f'with torch.autocast("{c.device}", enabled=False):\n'
               "    y = op(x.float())  # fp32 in, fp32 out\n"
               "y = y.to(x.dtype)  # back to the low precision only once it is in range")
    return (f"The overflow is in {cls}'s own forward ({op}), not in a "
            "submodule: run that op in fp32, with autocast off and its inputs cast to "
            "float32.", snippet)


def _island_apply(c: Context) -> Optional[str]:
    """``fp32_island=NAME[,NAME...]``: the culprit and its siblings in every block (what the
    snippet wraps); None for the model itself (the island goes around an op in its code)."""
    if c.root or not c.module:
        return None
    return "fp32_island=" + ",".join(_island_targets(c))


def _class_apply(c: Context) -> Optional[str]:
    """``fp32_island=`` over every module of the norm's class (what norm_in_fp32 changes: the
    class's forward), else over what the island would cover."""
    if c.root or not c.module:
        return None
    return "fp32_island=" + ",".join(dict.fromkeys(_island_targets(c) + c.kin))


@fix("fp32_island", "run the named module with autocast off, on fp32 inputs",
     apply=_island_apply, manual="the overflow is in the model's own forward: the island goes "
     "around the op in its code")
def fp32_island(c: Context) -> Advice:
    if c.root:
        return _op_island(c)
    path = c.module or "the_module"
    what = f"{path} ({c.module_type})" if c.module_type else path
    inside = f" (its first op to overflow is {c.op})" if c.op else ""
    targets = _island_targets(c) or [path]
    more = _beyond(c, targets)
    if more:
        inside += (f", and {', '.join(more[:4])}" + (f" and {len(more) - 4} more" if len(more)
                                                     > 4 else "")
                   + " too (the same overflow was seen there, or in their ModuleList)")
    snippet = (
        "import torch\n\n"
        "class FP32Island(torch.nn.Module):\n"
        '    """Runs the wrapped module with autocast off, on fp32 inputs."""\n\n'
        "    def __init__(self, inner):\n"
        "        super().__init__()\n"
        "        self.inner = inner.float()\n\n"
        "    def forward(self, *args, **kwargs):\n"
        "        up = lambda t: t.float() if torch.is_tensor(t) and t.is_floating_point() else t\n"
        f'        with torch.autocast("{c.device}", enabled=False):\n'
        "            return self.inner(*map(up, args), **{k: up(v) for k, v in kwargs.items()})\n\n"
        + _wrap_all(targets, "FP32Island"))
    return (f"Run {what} in fp32{inside}: autocast off inside it and its "
            "inputs cast to float32, so the values it produces have fp32's range. Wrap the "
            "module that produces the large values, not the one after it.", snippet)


@fix("norm_in_fp32", "compute a hand-written norm's statistics in fp32, the result cast back",
     apply=_class_apply, manual="the norm is the model itself: its forward must change")
def norm_in_fp32(c: Context) -> Advice:
    cls = c.module_type or "the norm"
    others = [m for m in c.kin if m != c.module]
    where = (f" ({c.module} and the {len(others)} other {cls} module"
             f"{'s' if len(others) != 1 else ''}: the class's forward serves them all)"
             if c.module and others else f" ({c.module})" if c.module else "")
    snippet = (f"# in {cls}.forward: square, mean and rsqrt in fp32; the result back in x's dtype\n"
               "def forward(self, x):\n"
               "    xf = x.float()\n"
               + _norm_lines(c) +
               "# or torch.nn.RMSNorm / torch.nn.LayerNorm, which autocast runs in fp32")
    return (f"Compute {cls}'s statistics in fp32{where}: in fp16, x * x passes 65504 once a "
            "value passes 256, its mean is inf and x / sqrt(inf) is 0. Cast x to float32 "
            "first and the result back: the output is as cheap to pass on as before.", snippet)


def _norm_lines(c: Context) -> str:
    """The norm's last lines, with the gain the run recorded (its one parameter, by name);
    what the run does not record (the eps, a gain among several) is said in a comment."""
    eps = "    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)  # your class's eps\n"
    if len(c.params) == 1:
        gain = c.params[0]
        return eps + (f"    return (y * self.{gain}.float()).to(x.dtype)  # self.{gain}: "
                      f"{c.module}'s one parameter, as recorded\n")
    if not c.params and c.module:
        return eps + f"    return y.to(x.dtype)  # {c.module} recorded no parameter: no gain\n"
    known = (f"of {', '.join(c.params[:3])}" if c.params else "its name is not recorded")
    return eps + ("    return (y * self.weight.float()).to(x.dtype)  # self.weight: your "
                  f"class's gain ({known})\n")


@fix("scale_attention", "scale q before q @ k^T, or use scaled_dot_product_attention",
     manual="the attention's forward must change")
def scale_attention(c: Context) -> Advice:
    cls = c.module_type or "the attention module"
    snippet = (f"# in {cls}.forward: scale q before the product (identical in fp32, and q @ k^T\n"
               "# stays below fp16's 65504), and run the softmax in fp32\n"
               "q = q * q.shape[-1] ** -0.5\n"
               "scores = q @ k.transpose(-2, -1)\n"
               "attn = torch.softmax(scores.float(), dim=-1).to(v.dtype)\n"
               "# or let PyTorch's fused kernel do all of it:\n"
               "out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)")
    return (f"Cheaper than an island: in {cls}, pre-scale the query by "
            "1/sqrt(head_dim) before q @ k^T (or use scaled_dot_product_attention).", snippet)


@fix("use_bf16", "autocast to bfloat16 (fp32's exponent range) instead of float16",
     apply="use_bf16")
def use_bf16(c: Context) -> Advice:
    snippet = (f'with torch.autocast("{c.device}", dtype=torch.bfloat16):  # was torch.float16\n'
               "    loss = compute_loss(model, batch)\n"
               "loss.backward()              # bf16 needs no GradScaler\n"
               "optimizer.step()\n"
               "optimizer.zero_grad(set_to_none=True)")
    return ("Autocast to bfloat16 instead of float16 where the hardware has it "
            "(NVIDIA Ampere or newer, recent CPUs): bf16 has fp32's exponent range, so "
            "gradients neither overflow nor flush to zero, and no loss scaling is needed.",
            snippet)


@fix("add_grad_scaler", "use a GradScaler with fp16 autocast",
     manual="the loop itself must call scaler.scale(loss).backward(), scaler.step and "
     "scaler.update")
def add_grad_scaler(c: Context) -> Advice:
    dose = c.dose("init_scale")
    snippet = (f'scaler = torch.amp.GradScaler("{c.device}", init_scale={_scale_literal(dose)})'
               "  # once, before the loop\n\n"
               f'with torch.autocast("{c.device}", dtype=torch.float16):\n'
               "    loss = compute_loss(model, batch)\n"
               "scaler.scale(loss).backward()  # gradients scaled up into fp16's range\n"
               f"scaler.step(optimizer)         # {c.optimizer}: unscales, skips inf/NaN steps\n"
               "scaler.update()\n"
               "optimizer.zero_grad(set_to_none=True)")
    return ("fp16 autocast needs a GradScaler: it multiplies the loss "
            "before backward so that small gradients stay above fp16's underflow threshold "
            "(6e-8), and divides them back before the optimizer step.", snippet, dose)


def _scale_literal(dose: Optional[Dose]) -> str:
    """A power-of-two loss scale as a literal: 2.0**16."""
    value = dose.values.get("init_scale") if dose else None
    if not value or value <= 0:
        return "2.0**16"
    k = math.log2(value)
    return f"2.0**{int(k)}" if k == int(k) else _literal(value, "2.0**16")


def _init_scale_apply(c: Context) -> Optional[str]:
    dose = c.dose("init_scale")
    value = dose.values.get("init_scale") if dose else None
    return f"init_scale={int(value)}" if value else None


@fix("raise_init_scale", "start GradScaler at a scale that lifts the small gradients into range",
     apply=_init_scale_apply, manual="no loss scale could be measured")
def raise_init_scale(c: Context) -> Advice:
    dose = c.dose("init_scale")
    was = (f"  # was init_scale={_literal(c.init_scale, '?')}, growth_interval={c.growth_interval}"
           if c.init_scale is not None else "")
    snippet = (f'scaler = torch.amp.GradScaler("{c.device}", init_scale={_scale_literal(dose)})'
               f"{was}")
    return (f"Keep the loss scale high enough for the small gradients: start GradScaler at "
            f"{_scale_literal(dose)}, and fix whatever keeps pushing it down.", snippet, dose)


def _eps_apply(c: Context) -> Optional[str]:
    dose = c.dose("eps")
    value = dose.values.get("eps") if dose else None
    return f"adam_eps={_literal(value, '')}" if value else None


@fix("adam_eps", "an Adam eps that fp16 can hold, measured from the gradients, or fp32 master "
     "weights", apply=_eps_apply, manual="no eps could be measured",
     replay="the update that eps breaks runs on a step whose loss and gradients are finite, "
     "which no event replays; the replayed step's weights are already non-finite")
def adam_eps(c: Context) -> Advice:
    opt = c.optimizer
    lr = _literal(c.lr, "lr")
    dose = c.dose("eps")
    new = _literal(dose.values.get("eps") if dose else None, "1e-4")
    was = f"  # was eps={_literal(c.eps, '1e-8')}: 0.0 in fp16" if c.eps is not None else ""
    snippet = (f"optimizer = torch.optim.{opt}(model.parameters(), lr={lr}, eps={new}){was}\n"
               "# better: fp32 master weights, fp16 only inside autocast\n"
               "model = model.float()\n"
               f'scaler = torch.amp.GradScaler("{c.device}")')
    return (f"{opt}'s eps must survive in fp16: anything below 3e-8 (the default "
            "1e-8) rounds to 0, and a zero or tiny gradient then gives 0/0 = NaN or m/0 = "
            f"inf in the update. Use eps={new}, or keep fp32 weights and optimizer state "
            "(autocast + GradScaler).", snippet, dose)


@fix("fp32_master_weights", "keep fp32 weights and optimizer state; autocast does the rest",
     manual="the weights' dtype is set in the code (model.half(), .to(torch.bfloat16))")
def fp32_master_weights(c: Context) -> Advice:
    # an fp16 run keeps fp16 compute (with the GradScaler fp16 needs); any other run bf16
    fp16 = c.autocast == "float16" or (c.autocast is None and c.low == "fp16")
    low = "float16" if fp16 else "bfloat16"
    snippet = ("model = model.float()  # weights and optimizer state in fp32\n"
               f"optimizer = torch.optim.{c.optimizer}(model.parameters(), "
               f"lr={_literal(c.lr, 'lr')})\n"
               + (f'scaler = torch.amp.GradScaler("{c.device}")\n' if fp16 else "")
               + f'with torch.autocast("{c.device}", dtype=torch.{low}):  # low precision '
               "compute\n"
               "    loss = compute_loss(model, batch)"
               + ("\nscaler.scale(loss).backward()\nscaler.step(optimizer)\nscaler.update()"
                  if fp16 else ""))
    return ("Keep the weights and the optimizer state in fp32 and let "
            "autocast run the matmuls in low precision: small updates then accumulate "
            "instead of rounding away. (If memory forbids it, use an optimizer with "
            "stochastic rounding or Kahan summation for bf16 weights.)", snippet)


def _tenth(peak: Optional[float]) -> Optional[Dose]:
    """The LR default with no update ratio to measure: a tenth of the peak."""
    if not peak:
        return None
    return Dose({"lr": float(f"{peak / 10:.2g}"), "lr_factor": 0.1},
                f"a tenth of the peak LR {_literal(peak, '')}: the default, no update ratio "
                "was measured")


def _lr_apply(c: Context) -> Optional[str]:
    """``lr_factor=F``: the run's whole LR schedule scaled so that its peak becomes the
    measured LR (``lr=X`` when the run recorded no LR to scale)."""
    dose = c.dose("lr") or _tenth(c.lr)
    if dose is None or not dose.values.get("lr"):
        return None
    factor = dose.values.get("lr_factor")
    return f"lr_factor={_literal(factor, '')}" if factor else \
        f"lr={_literal(dose.values['lr'], '')}"


@fix("lower_lr", "lower the peak learning rate to the one the update ratios measure, clip "
     "after unscale_", apply=_lr_apply, manual="the run recorded no learning rate to scale",
     replay="the replay cannot try a lower LR, which needs many steps")
def lower_lr(c: Context) -> Advice:
    lr_dose = c.dose("lr") or _tenth(c.lr)
    new = _literal(lr_dose.values.get("lr") if lr_dose else None, "lr / 10")
    clip, norm_dose = _max_norm(c)
    peak = f"  # peak was {_literal(c.lr, str(c.lr))}" if c.lr else ""
    snippet = (f"optimizer = torch.optim.{c.optimizer}(model.parameters(), lr={new}){peak}\n"
               "...\n" + _clip_step(c.scaler, clip))
    return (f"Set the peak learning rate to {new} and clip gradients at {clip}"
            f"{' (after unscale_)' if c.scaler else ''}. Restart from the initial weights or "
            "a checkpoint before the weights grew: what a too-large step did to them does not "
            "undo itself.", snippet, _joined(lr_dose, norm_dose))


@fix("scheduler_per_step", "step the LR scheduler once per optimizer step, not per micro-batch",
     apply="scheduler_per_step", replay="the replay of one step cannot try a schedule, which "
     "needs many steps")
def scheduler_per_step(c: Context) -> Advice:
    snippet = ("for i, batch in enumerate(loader):\n"
               "    loss = compute_loss(model, batch) / accum_steps\n"
               "    loss.backward()\n"
               "    if (i + 1) % accum_steps == 0:\n"
               "        optimizer.step()\n"
               "        optimizer.zero_grad(set_to_none=True)\n"
               "        scheduler.step()  # here, once per optimizer step: not per micro-batch")
    return ("Step the LR scheduler once per optimizer step: stepped once per micro-batch, a "
            "warm-up reaches its peak as many times too early as there are micro-batches, and "
            "the peak then hits a model that has not warmed up.", snippet)


@fix("check_data", "drop or repair non-finite and out-of-range batches (or targets)",
     manual="the data pipeline must change")
def check_data(c: Context) -> Advice:
    """What the snippet says of the run comes from a check that found it (``Context.data``):
    a batch the replay or the sampled tier found non-finite, or beyond fp16's range, or
    targets that make the loss non-finite; with no such finding it claims nothing."""
    d = c.data or {}
    if d.get("kind") == "targets":
        return _bad_targets(d)
    step, kind = d.get("step"), d.get("kind") if d.get("step") is not None else None
    held = f" ({', '.join(d['labels'][:3])})" if d.get("labels") else ""
    nan = f"  # step {step}'s batch held NaN/inf{held}" if kind == "nonfinite" else ""
    big = f"  # step {step}'s batch held values up to {fmt(d.get('absmax'))}" \
        if kind == "range" else ""
    lead = {"nonfinite": "Drop", "range": "Normalise the inputs, and drop"}.get(
        kind or "", "As a guard (no check in this run found a bad batch): drop")
    snippet = ("for x, y in loader:\n"
               f"    if not torch.isfinite(x).all():{nan}\n"
               "        continue  # or log the sample ids and repair the dataset\n"
               "    x = x.clamp(-torch.finfo(torch.float16).max, torch.finfo(torch.float16).max)"
               f"  # and normalise features to O(1){big}")
    return (f"{lead} (or repair) the batches holding NaN/inf or values beyond fp16's range "
            "(65504); normalise inputs to order 1.", snippet)


def _bad_targets(d: dict) -> Advice:
    """Targets that make the loss non-finite whatever the precision (issue 23's case: every
    target ignore_index, so a mean over no targets is 0/0)."""
    step = d.get("step")
    if d.get("all_ignored"):
        ignore = d.get("ignore_index", -100)
        at = f"  # step {step}: every target was {ignore}" if step is not None else ""
        snippet = ("for x, y in loader:\n"
                   f"    if (y != {ignore}).sum() == 0:{at}\n"
                   "        continue  # no target to learn from: the mean over none is NaN\n"
                   "# or keep the batch and sum instead of averaging over no tokens:\n"
                   f"loss = F.cross_entropy(logits, y, ignore_index={ignore}, reduction=\"sum\")"
                   f" / (y != {ignore}).sum().clamp(min=1)")
        return ("Skip the batches whose every target is ignore_index (padding only), or "
                "divide by the number of real targets clamped to at least 1: the loss is NaN "
                "in fp32 too, so AMP is not the cause and turning it off would not help.",
                snippet)
    at = f"  # step {step}: {d.get('problem')}" if step is not None else ""
    if d.get("out_of_range"):
        test = (f"(((y < 0) | (y >= {d.get('classes', 'num_classes')})) & "
                f"(y != {d.get('ignore_index', -100)})).any()")
    elif d.get("outside"):
        test = "((y < 0) | (y > 1)).any()"
    else:
        test = "not torch.isfinite(y).all()"
    snippet = ("for x, y in loader:\n"
               f"    if {test}:{at}\n"
               "        continue  # or log the sample ids and repair the labels")
    return ("Check the targets: the loss is non-finite in fp32 too on these labels, so it is "
            "the data, not the precision.", snippet)


@fix("unscale_before_clip", "call scaler.unscale_(optimizer) before clip_grad_norm_",
     manual="the order of the calls in the loop must change")
def unscale_before_clip(c: Context) -> Advice:
    norm = _literal(c.clip_max_norm, "max_norm") if c.clip_max_norm else "max_norm"
    snippet = ("scaler.scale(loss).backward()\n"
               "scaler.unscale_(optimizer)  # first: gradients back to their true size\n"
               f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={norm})"
               + ("  # your max_norm" if c.clip_max_norm else "") + "\n"
               "scaler.step(optimizer)\n"
               "scaler.update()")
    dose = Dose({"max_norm": c.clip_max_norm}, "the max_norm the run's clip_grad_norm_ "
                "passed") if c.clip_max_norm else None
    return ("Call scaler.unscale_(optimizer) before "
            "clip_grad_norm_: clipping the scaled gradients measures a norm S times too "
            "large and shrinks every update by the loss scale S.", snippet, dose)


@fix("use_scaler_step", "call scaler.step(optimizer), never optimizer.step(), under a scaler",
     manual="the loop's optimizer.step() call must change")
def use_scaler_step(c: Context) -> Advice:
    snippet = ("scaler.scale(loss).backward()\n"
               f"scaler.step(optimizer)  # not optimizer.step(): {c.optimizer} would apply "
               "scaled, unchecked gradients\n"
               "scaler.update()\n"
               "optimizer.zero_grad(set_to_none=True)")
    return ("Step the optimizer through the scaler: scaler.step(optimizer) "
            "unscales the gradients and skips steps with inf/NaN; optimizer.step() applies "
            "gradients that are still multiplied by the loss scale.", snippet)


@fix("create_scaler_once", "create the GradScaler once and checkpoint its state",
     manual="where the scaler is created is in the code")
def create_scaler_once(c: Context) -> Advice:
    snippet = (f'scaler = torch.amp.GradScaler("{c.device}")  # once, before the epoch loop\n'
               "if \"scaler\" in checkpoint:\n"
               "    scaler.load_state_dict(checkpoint[\"scaler\"])\n"
               "for epoch in range(epochs):\n"
               "    ...\n"
               "checkpoint[\"scaler\"] = scaler.state_dict()")
    return ("Create the GradScaler once, and save/restore its state "
            "with checkpoints: a new scaler restarts at init_scale and skips steps to "
            "recalibrate every time.", snippet)


@fix("zero_grad_every_step", "zero the gradients after every step, skipped or not",
     manual="the loop must call zero_grad")
def zero_grad_every_step(c: Context) -> Advice:
    snippet = ("scaler.step(optimizer)\n"
               "scaler.update()\n"
               "optimizer.zero_grad(set_to_none=True)  # every step, also when it was skipped")
    return ("Zero the gradients after every optimizer step, "
            "including skipped ones: an inf left in .grad makes every later step overflow.",
            snippet)


@fix("fix_scaler_calls", "one unscale_/step/update per optimizer step, in that order",
     manual="the order of the calls in the loop must change")
def fix_scaler_calls(c: Context) -> Advice:
    clip, dose = _max_norm(c)
    snippet = ("for i, batch in enumerate(loader):\n"
               f'    with torch.autocast("{c.device}", dtype=torch.float16):\n'
               "        loss = compute_loss(model, batch) / accum_steps\n"
               "    scaler.scale(loss).backward()\n"
               "    if (i + 1) % accum_steps == 0:\n"
               "        scaler.unscale_(optimizer)  # once, only on stepping iterations\n"
               f"        torch.nn.utils.clip_grad_norm_(model.parameters(), {clip})\n"
               "        scaler.step(optimizer)\n"
               "        scaler.update()  # once per iteration, after every step()\n"
               "        optimizer.zero_grad(set_to_none=True)")
    return ("Call unscale_, step and update once per optimizer step, in "
            "that order (with gradient accumulation: only on the stepping iteration).",
            snippet, dose)


@fix("loss_in_fp32", "compute the loss in fp32 (inside autocast, or on .float() outputs)",
     apply="loss_in_fp32")
def loss_in_fp32(c: Context) -> Advice:
    snippet = (f'with torch.autocast("{c.device}", dtype=torch.float16):\n'
               "    out = model(x)\n"
               "    loss = criterion(out, y)  # autocast runs nn losses in fp32, not your own ops\n"
               "# or, outside the block:\n"
               "loss = criterion(out.float(), y.float())\n"
               "# and for probabilities: BCEWithLogitsLoss on logits, not sigmoid + BCELoss")
    return ("Compute the loss in fp32: inside the autocast block (autocast "
            "runs losses and reductions in fp32) or on .float() outputs. An fp16 sum over a "
            "batch passes 65504 easily. (--apply loss_in_fp32 casts the inputs of torch's own "
            "loss functions; a hand-written loss needs the change in its code.)", snippet)


@fix("divide_loss_by_accum", "divide each micro-batch's loss by the number of micro-batches",
     manual="the loss's code must change")
def divide_loss_by_accum(c: Context) -> Advice:
    snippet = ("for micro, (x, y) in enumerate(micro_batches):\n"
               "    loss = criterion(model(x), y) / len(micro_batches)  # a mean, not a sum\n"
               "    scaler.scale(loss).backward()")
    return ("Divide each micro-batch's loss by the number of "
            "micro-batches: .grad then holds their mean, which stays the size of one "
            "micro-batch's gradient however many are accumulated.", snippet)


@fix("loss_on_logits", "compute the loss from logits (BCEWithLogitsLoss, logsigmoid), not "
     "from fp16 probabilities", manual="the model's output and the loss's code must change")
def loss_on_logits(c: Context) -> Advice:
    snippet = (f'with torch.autocast("{c.device}", dtype=torch.float16):\n'
               "    logits = model(x)  # the model returns logits: no Sigmoid at its end\n"
               "loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), y)\n"
               "# a hand-written loss: take probabilities in fp32, or log-probabilities\n"
               "p = torch.sigmoid(logits.float())\n"
               "log_p = torch.nn.functional.logsigmoid(logits.float())")
    return ("Compute the loss from the logits, in fp32: an fp16 sigmoid "
            "rounds to exactly 1.0 (or 0.0), where BCE's, log's or sqrt's derivative is "
            "infinite. BCEWithLogitsLoss (or logsigmoid) never forms the probability.", snippet)


# How the clamp reads for each op (``x``: the op's input in the user's loss).
_CLAMPED = {"pow": "x.clamp(min={eps}) ** {e}", "sqrt": "torch.sqrt(x.clamp(min={eps}))",
            "log": "torch.log(x.clamp(min={eps}))", "log2": "torch.log2(x.clamp(min={eps}))",
            "log10": "torch.log10(x.clamp(min={eps}))",
            "log1p": "torch.log1p(x.clamp(min=-1 + {eps}))",
            "acos": "torch.acos(x.clamp(-1 + {eps}, 1 - {eps}))",
            "asin": "torch.asin(x.clamp(-1 + {eps}, 1 - {eps}))"}


@fix("clamp_loss_input", "clamp the input of the loss's op whose derivative is infinite there "
     "(a power below 1, sqrt or log at 0), in any precision", manual="the loss's code must change")
def clamp_loss_input(c: Context) -> Advice:
    """The loss's derivative is infinite at values the step reached, in fp32 too: a clamp of
    the op's input, at the distance the run's own values needed (``Context.singular``)."""
    s = c.singular or {"op": "sqrt"}  # no measurement behind it: the commonest case
    op = str(s.get("op"))
    eps = s.get("eps")
    at = f" at step {s['step']}" if s.get("step") is not None else ""
    shown = _literal(eps, "eps")
    form = _CLAMPED.get(op)
    if form is None:  # a torch loss function: its input, the model's output
        snippet = (f"p = p.clamp({shown}, 1 - {shown})  # the input of {op}, kept off the "
                   "values where its derivative is infinite\n"
                   f"loss = torch.nn.functional.{op}(p, y)")
    else:
        exponent = s.get("exponent")
        expr = form.format(eps=shown, e=f"{exponent:g}" if exponent is not None else "e")
        points = " or ".join(f"{p:g}" for p in s.get("points") or [0.0])
        snippet = (f"# x: what your loss passes to {op} (1 - p_t, say), exactly {points}{at}, "
                   f"where {op}'s derivative is infinite\n"
                   f"y = {expr}  # no gradient where the clamp bites: nothing left to learn")
    if isinstance(eps, (int, float)):
        dose = Dose({"eps": float(eps)}, f"the nearest any value of {op}'s input came to its "
                    f"singular point{at} with a finite derivative in "
                    f"{s.get('dtype') or 'the run dtype'}")
    else:
        dose = Dose({}, "not measured (the singular point is inside the loss function): keep "
                    "its input at least the dtype's resolution away from it")
    checked = f" (checked{at})" if at else ""
    return (f"Clamp the input of {op} in the loss: at values this run reached its derivative "
            f"is infinite in fp32 as well as in fp16{checked}, so neither precision nor a loss "
            "scale makes it finite there.", snippet, dose)


@fix("safe_mask", "mask with torch.finfo(dtype).min or a bool mask, never -1e9 in fp16",
     manual="the mask's constant is in the model's code")
def safe_mask(c: Context) -> Advice:
    cls = c.module_type or "the attention module"
    snippet = (f"# in {cls}.forward: a mask value fp16 can hold, applied with masked_fill\n"
               "scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)\n"
               "attn = torch.softmax(scores.float(), dim=-1).to(v.dtype)\n"
               "# or a boolean mask in the fused kernel, which handles it for you:\n"
               "out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)")
    return (f"In {cls}, mask with torch.finfo(scores.dtype).min via masked_fill "
            "(or a boolean mask), never a constant like -1e9 or -1e4 * big: in fp16 it becomes "
            "-inf, and a row whose every key is masked turns into NaN in softmax.", snippet)


@fix("guard_buffers", "keep inf/NaN batches away from BatchNorm statistics, or restore them",
     manual="the loop must guard the batches or restore the statistics")
def guard_buffers(c: Context) -> Advice:
    snippet = ("for x, y in loader:\n"
               "    if not torch.isfinite(x).all():  # guard what reaches BatchNorm\n"
               "        continue\n"
               "    ...\n"
               "# or undo a skipped step's statistics:\n"
               'stats = {k: v.clone() for k, v in model.state_dict().items() if "running_" in k}\n'
               "scale = scaler.get_scale()\n"
               "scaler.step(optimizer)\n"
               "scaler.update()\n"
               "if scaler.get_scale() < scale:  # skipped: the forward saw inf/NaN\n"
               "    model.load_state_dict(stats, strict=False)")
    mod = f" ({c.module})" if c.module else ""
    step = "a skipped step" if c.scaler else "a bad step"  # a run without a scaler skips none
    return (f"GradScaler's skip protects the weights, not module "
            f"buffers: the BatchNorm running statistics{mod} absorbed the inf/NaN of "
            f"{step} and every eval is now NaN. Keep non-finite batches away from the "
            "model, or restore the statistics when a step is skipped; recompute them "
            "(a pass in train mode over clean data) to recover this run.", snippet)


@fix("rebalance_losses", "bring a tiny loss term up to the others' scale",
     manual="the loss's weights are in the code")
def rebalance_losses(c: Context) -> Advice:
    mod = c.module or "the small head"
    ratio = f"{c.ratio:.0e}".replace("e+0", "e") if c.ratio else "1e3"
    head = module_expr(mod) if c.module else "small_head"
    size = (f"are ~{ratio}x smaller than the rest's" if c.ratio else
            f"flush to 0, too small to measure (x{ratio}: a first step, not a measured one)")
    snippet = (f"# the gradients reaching {mod} {size}: one loss\n"
               "# scale cannot serve both. Weight that loss term up to the others' size (and,\n"
               "# with SGD, lower that head's learning rate by the same factor):\n"
               f"loss = main_loss + aux_weight * {ratio} * aux_loss\n"
               f"optimizer = torch.optim.{c.optimizer}([\n"
               f"    {{\"params\": [p for n, p in model.named_parameters() if not "
               f"n.startswith(\"{mod}.\")]}},\n"
               f"    {{\"params\": {head}.parameters(), \"lr\": lr}},  # SGD: lr / {ratio}\n"
               "], lr=lr)")
    dose = Dose({"ratio": float(c.ratio)}, f"the other layers' gradient rms over {mod}'s") \
        if c.ratio else None
    return (f"Or keep fp16 and bring the gradients of {mod} into range: "
            "a loss term weighted far below the others gives its head gradients that no "
            "single loss scale can hold.", snippet, dose)


@fix("scheduler_after_real_step", "step the LR scheduler only when the optimizer step ran",
     apply="scheduler_per_step", replay="the replay of one step cannot try a schedule, which "
     "needs many steps")
def scheduler_after_real_step(c: Context) -> Advice:
    snippet = ("scale = scaler.get_scale()\n"
               "scaler.step(optimizer)\n"
               "scaler.update()\n"
               "if scaler.get_scale() >= scale:  # applied (a skipped step halves the scale)\n"
               "    scheduler.step()\n"
               "optimizer.zero_grad(set_to_none=True)")
    return ("Step the LR scheduler only after a step the "
            "optimizer really took: GradScaler skips steps with inf/NaN gradients, and a "
            "schedule that advances on them ends its warmup before the model trained.",
            snippet)




@fix("revive_units", "an activation that cannot die (LeakyReLU/GELU), biases from 0, a restart",
     manual="the activations are in the model's code", replay="the replay of one step cannot "
     "try a restart, which needs many steps")
def revive_units(c: Context) -> Advice:
    """Dead units (ReLU outputs 0 for every input) pass no gradient and never come back."""
    kind = (c.module_type or "").lower()
    at = f" before step {c.step}" if c.step is not None else ""
    if c.module and kind in ("relu", "relu6", "threshold", "hardtanh", ""):
        target = module_expr(c.module)
        what = f"{c.module}{f' ({c.module_type})' if c.module_type else ''}"
        snippet = (f"# {what} outputs exactly 0 for every input: nothing before it learns\n"
                   f"{target} = torch.nn.LeakyReLU(0.01)  # or torch.nn.GELU(): never flat, "
                   "so the gradient keeps flowing\n"
                   "# and restart from the initial weights (or a checkpoint"
                   f"{at}): dead units do not come back")
    else:
        snippet = ("# ReLU -> a non-saturating activation in the model's definition\n"
                   "act = torch.nn.LeakyReLU(0.01)  # or torch.nn.GELU()\n"
                   "# biases start at 0, not below it; a LayerNorm before the activation\n"
                   "torch.nn.init.zeros_(layer.bias)")
    return ("Units whose input is negative for every example output 0 "
            "and pass no gradient, so they never recover: use an activation with a slope "
            "everywhere (LeakyReLU, GELU, SiLU), start biases at 0 and normalise before the "
            "activation, keep the LR low enough that one update cannot push them all "
            "negative, and restart the run: the dead units stay dead.", snippet)


@fix("overfit_one_batch", "train on one fixed batch to tell a wiring bug from a data or LR "
     "problem", manual="it is a different loop, on one batch",
     replay="whether the model can learn is not told by one step")
def overfit_one_batch(c: Context) -> Advice:
    """A flat loss with no numeric cause: the classic first check of a training setup."""
    lr = f", lr={_literal(c.lr, 'lr')}" if c.lr else ""
    snippet = ("batch = next(iter(loader))  # one fixed batch, used again and again\n"
               "for i in range(300):\n"
               "    loss = compute_loss(model, batch)\n"
               "    loss.backward()\n"
               f"    optimizer.step()  # {c.optimizer}{lr}, as in the run\n"
               "    optimizer.zero_grad(set_to_none=True)\n"
               "print(loss.item())  # near 0: the model can learn; look at the data and the LR\n"
               "# the labels must stay paired with their inputs: shuffle them together\n"
               "perm = torch.randperm(len(x)); x, y = x[perm], y[perm]")
    return ("Check that the model can learn at all: train it on one fixed batch for a few "
            "hundred steps. If the loss cannot get near 0 there, the model, the loss or the "
            "optimizer is wired wrong (parameters the loss does not reach or the optimizer "
            "does not hold, an LR far off); if it can, look at the data: labels that are not "
            "paired with their inputs (shuffled separately, an off-by-one) leave nothing to "
            "learn.", snippet)


@fix("test_device", "test or exclude the device the failure began on (vendor diagnostics)",
     manual="the device is tested with the vendor's tools, outside the run",
     replay="the replay ran on the same device")
def test_device(c: Context) -> Advice:
    """A failure that did not reproduce on the same batch and weights: the device first."""
    where = f"rank {c.rank}'s device" if c.rank is not None else "the device"
    who = f"rank {c.rank}" if c.rank is not None else "each rank"
    snippet = ("import socket, subprocess\n"
               f"# where {who} runs (log it on every rank):\n"
               "print(socket.gethostname(), torch.cuda.current_device(), "
               "torch.cuda.get_device_name())\n"
               "# on that host, the vendor's diagnostics (AMD: rocm-smi --showrasinfo all, rvs)\n"
               'subprocess.run(["nvidia-smi", "-q", "-d", "ECC,PAGE_RETIREMENT,ROW_REMAPPER"])\n'
               'subprocess.run(["dcgmi", "diag", "-r", "3"])  # memory, compute, PCIe stress\n'
               "# and keep the node out of the job (the scheduler's exclude list) until it passes")
    return (f"Test {where} with the vendor's diagnostics, and keep it out of the job until it "
            "passes: a NaN that the same step on the same batch and weights does not repeat "
            "is the machine's, and a faulty GPU tends to do it again.", snippet)


@fix("rerun_elsewhere", "re-run the failing step on another device, from a checkpoint before it",
     manual="it needs another device and the job's checkpoint",
     replay="the replay ran on the same device")
def rerun_elsewhere(c: Context) -> Advice:
    step = c.step if c.step is not None else "S"
    snippet = ("import os, subprocess\n"
               f"# resume from the last checkpoint before step {step}, same data order, on "
               "another GPU\n"
               'subprocess.run(["ampdoctor", "record", "-o", "rerun.h5", "--", "python", '
               '"train.py"],\n'
               '               env={**os.environ, "CUDA_VISIBLE_DEVICES": "1"})\n'
               f"# step {step} finite there: this device is at fault; non-finite again: the "
               "numbers are")
    return ("Re-run the failing step on another device: resume from a checkpoint before it "
            "with the same batches. Finite there and non-finite here is a faulty device; "
            "non-finite on both is the numbers after all.", snippet)


@fix("deterministic_algorithms", "rule out nondeterministic kernels: deterministic algorithms",
     manual="the script must switch them on before training starts")
def deterministic_algorithms(c: Context) -> Advice:
    snippet = ('import os\n'
               'os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before CUDA starts\n'
               "torch.use_deterministic_algorithms(True)  # raises on an op with no "
               "deterministic kernel\n"
               "torch.backends.cudnn.benchmark = False")
    return ("Make the run deterministic to rule out a kernel whose result depends on "
            "scheduling (atomics in scatter/index_add, cuDNN autotuning): a NaN that still "
            "does not reproduce then is the hardware, or code outside the model that the "
            "replay does not run (hooks, a hand-written loss, communication).", snippet)


def make(ids: list[str], context: Context) -> list[Fix]:
    """The fixes ``ids``, in that order, written for ``context`` (bf16 is suggested only to a
    run in fp16: a bf16 or fp32 run has its range already)."""
    return [MAKERS[i](context) for i in ids if i != "use_bf16" or context.low == "fp16"]


def is_attention(module: Optional[str], module_type: Optional[str]) -> bool:
    """Does the name or class look like an attention block (for the cheaper fix)?"""
    text = f"{module or ''} {module_type or ''}".lower()
    return bool(re.search(r"attn|attention|mha|selfatt", text))
