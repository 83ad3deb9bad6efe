"""Fixes for a value outside half precision's range or precision: where in the model to compute
in more range (an fp32 island, a norm in fp32, a scaled attention, bf16), GradScaler's scale,
Adam's eps, fp32 master weights, a mask fp16 can hold, a loss term too small for the scale.
"""

from __future__ import annotations

import math
from typing import Optional

from .premises import fp32_cannot_fix, island_applies, use_bf16_applies
from .registry import (
    Advice,
    Context,
    Dose,
    assign_module,
    fix,
    literal,
    module_expr,
    one_line,
)


def _listed(path: str) -> Optional[tuple[str, str]]:
    """(the ModuleList, the path inside a block) for 'blocks.3.attn' -> ('blocks', 'attn');
    None for a module in no ModuleList."""
    parts = path.split(".")
    idx = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    if idx is not None and 0 < idx < len(parts) - 1:
        return ".".join(parts[:idx]), ".".join(parts[idx + 1:])
    return None


def wrap_lines(path: str, wrapper: str, handles: Optional[dict] = None) -> str:
    """Assignments wrapping ``path`` (and its siblings in the same ModuleList) in ``wrapper``,
    through the script's own names for the modules (``handles``)."""
    listed = _listed(path)
    if listed is not None:
        container, rest = module_expr(listed[0], handles), listed[1]
        inner = module_expr(rest, root="block")
        return (f"for block in {container}:  # {one_line(path)} and the same module in every "
                f"block\n    {assign_module(rest, f'{wrapper}({inner})', root='block')}")
    return assign_module(path, f"{wrapper}({module_expr(path, handles)})", handles)


def _wrap_all(paths: list[str], wrapper: str, handles: Optional[dict] = None) -> str:
    """``wrap_lines`` for each of ``paths``, one loop per ModuleList they share."""
    lines, seen = [], set()
    for path in paths:
        key = _listed(path) or path
        if key not in seen:
            seen.add(key)
            lines.append(wrap_lines(path, wrapper, handles))
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
    if c.module_type == "autograd.Function":
        return _function_in_fp32(c)
    if c.module_type == "op":  # an op the training code calls between the model's calls
        op = c.op or "the op"
        return (f"Run {op} in fp32 where the code calls it, between the model's calls: autocast "
                "off around it and its inputs cast to float32.",
                f'with torch.autocast("{c.device}", enabled=False):\n'
                f"    y = {op.lower()}(x.float())  # fp32 in, fp32 out\n"
                "y = y.to(x.dtype)  # back to the low precision only once it is in range")
    cls = c.module_type or c.module or "the model"
    op = c.op or "the op"
    snippet = (f"# in {cls}.forward, around {op} (and the ops that produce its input):\n"
               f'with torch.autocast("{c.device}", enabled=False):\n'
               "    y = op(x.float())  # fp32 in, fp32 out\n"
               "y = y.to(x.dtype)  # back to the low precision only once it is in range")
    return (f"The overflow is in {cls}'s own forward ({op}), not in a "
            "submodule: run that op in fp32, with autocast off and its inputs cast to "
            "float32.", snippet)


def _function_in_fp32(c: Context) -> Advice:
    """The culprit is a custom autograd.Function: autocast does not reach inside it, so its
    forward is declared to run in fp32 (and its backward in the forward's autocast state)."""
    fn = c.op or c.module or "MyFunction"
    snippet = (f"class {fn}(torch.autograd.Function):\n"
               "    @staticmethod\n"
               f'    @torch.amp.custom_fwd(device_type="{c.device}", cast_inputs=torch.float32)\n'
               "    def forward(ctx, x):\n"
               "        ...  # unchanged: now runs in fp32 on fp32 inputs\n\n"
               "    @staticmethod\n"
               f'    @torch.amp.custom_bwd(device_type="{c.device}")\n'
               "    def backward(ctx, grad):\n"
               "        ...  # unchanged")
    return (f"Run the custom autograd.Function {fn} in fp32: decorate its forward with "
            "torch.amp.custom_fwd(cast_inputs=torch.float32), which casts its inputs to "
            "float32 and turns autocast off inside it, and its backward with "
            "torch.amp.custom_bwd, so that it runs as the forward did.", snippet)


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
     "around the op in its code", premise=island_applies)
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
        + _wrap_all(targets, "FP32Island", c.handles))
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
                      f"{one_line(c.module)}'s one parameter, as recorded\n")
    if not c.params and c.module:
        return eps + (f"    return y.to(x.dtype)  # {one_line(c.module)} recorded no parameter: "
                      "no gain\n")
    known = (f"of {', '.join(c.params[:3])}" if c.params else "its name is not recorded")
    return eps + ("    return (y * self.weight.float()).to(x.dtype)  # self.weight: your "
                  f"class's gain ({known})\n")


@fix("scale_attention", "scale q before q @ k^T, or use scaled_dot_product_attention",
     manual="the attention's forward must change", premise=fp32_cannot_fix)
def scale_attention(c: Context) -> Advice:
    cls = c.module_type or "the attention module"
    snippet = (f"# in {cls}.forward: scale q before the product (identical in fp32, and q @ k^T\n"
               "# stays below fp16's 65504), and run the softmax in fp32\n"
               "q = q * q.shape[-1] ** -0.5\n"
               "scores = q @ k.transpose(-2, -1)\n"
               "attn = torch.softmax(scores.float(), dim=-1).to(v.dtype)\n"
               "# or let PyTorch's fused kernel do all of it:\n"
               "out = torch.nn.functional.scaled_dot_product_attention(q, k, v)  # + your mask,\n"
               "# attn_mask=mask, or is_causal=True for a causal one")
    return (f"Cheaper than an island: in {cls}, pre-scale the query by "
            "1/sqrt(head_dim) before q @ k^T (or use scaled_dot_product_attention).", snippet)


@fix("use_bf16", "autocast to bfloat16 (fp32's exponent range) instead of float16",
     apply="use_bf16", premise=use_bf16_applies)
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
    return f"2.0**{int(k)}" if k == int(k) else literal(value, "2.0**16")


def _init_scale_apply(c: Context) -> Optional[str]:
    dose = c.dose("init_scale")
    value = dose.values.get("init_scale") if dose else None
    return f"init_scale={int(value)}" if value else None


@fix("raise_init_scale", "start GradScaler at a scale that lifts the small gradients into range",
     apply=_init_scale_apply, manual="no loss scale could be measured")
def raise_init_scale(c: Context) -> Advice:
    dose = c.dose("init_scale")
    was = (f"  # was init_scale={literal(c.init_scale, '?')}, growth_interval={c.growth_interval}"
           if c.init_scale is not None else "")
    snippet = (f'scaler = torch.amp.GradScaler("{c.device}", init_scale={_scale_literal(dose)})'
               f"{was}")
    return (f"Keep the loss scale high enough for the small gradients: start GradScaler at "
            f"{_scale_literal(dose)}, and fix whatever keeps pushing it down.", snippet, dose)


def _eps_apply(c: Context) -> Optional[str]:
    dose = c.dose("eps")
    value = dose.values.get("eps") if dose else None
    return f"adam_eps={literal(value, '')}" if value else None


@fix("adam_eps", "an Adam eps that fp16 can hold, measured from the gradients, or fp32 master "
     "weights", apply=_eps_apply, manual="no eps could be measured",
     replay="the update that eps breaks runs on a step whose loss and gradients are finite, "
     "which no event replays; the replayed step's weights are already non-finite")
def adam_eps(c: Context) -> Advice:
    opt = c.optimizer
    lr = literal(c.lr, "lr")
    dose = c.dose("eps")
    new = literal(dose.values.get("eps") if dose else None, "1e-4")
    was = f"  # was eps={literal(c.eps, '1e-8')}: 0.0 in fp16" if c.eps is not None else ""
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
               f"lr={literal(c.lr, 'lr')})\n"
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


@fix("rebalance_losses", "bring a tiny loss term up to the others' scale",
     manual="the loss's weights are in the code")
def rebalance_losses(c: Context) -> Advice:
    mod = c.module or "the small head"
    ratio = f"{c.ratio:.0e}".replace("e+0", "e") if c.ratio else "1e3"
    head = module_expr(mod, c.handles) if c.module else "small_head"
    size = (f"are ~{ratio}x smaller than the rest's" if c.ratio else
            f"flush to 0, too small to measure (x{ratio}: a first step, not a measured one)")
    snippet = (f"# the gradients reaching {one_line(mod)} {size}: one loss\n"
               "# scale cannot serve both. Weight that loss term up to the others' size (and,\n"
               "# with SGD, lower that head's learning rate by the same factor):\n"
               f"loss = main_loss + aux_weight * {ratio} * aux_loss\n"
               f"optimizer = torch.optim.{c.optimizer}([\n"
               f"    {{\"params\": [p for n, p in {module_expr('', c.handles)}"
               f".named_parameters() if not n.startswith({mod + '.'!r})]}},\n"
               f"    {{\"params\": {head}.parameters(), \"lr\": lr}},  # SGD: lr / {ratio}\n"
               "], lr=lr)")
    dose = Dose({"ratio": float(c.ratio)}, f"the other layers' gradient rms over {mod}'s") \
        if c.ratio else None
    return (f"Or keep fp16 and bring the gradients of {mod} into range: "
            "a loss term weighted far below the others gives its head gradients that no "
            "single loss scale can hold.", snippet, dose)
