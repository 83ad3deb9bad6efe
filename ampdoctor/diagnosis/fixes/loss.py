"""Fixes for the loss and what it is fed: the loss in fp32, computed from logits, a clamp of its
singular op's input, and bad batches or targets.
"""

from __future__ import annotations

from ...numfmt import fmt
from .registry import (
    Advice,
    Context,
    Dose,
    fix,
    literal,
)


@fix("loss_in_fp32", "compute the loss in fp32 (inside autocast, or on .float() outputs)",
     apply="loss_in_fp32")
def loss_in_fp32(c: Context) -> Advice:
    if c.autocast == "bfloat16" or (c.autocast is None and c.low == "bf16"):
        return _loss_in_fp32_bf16(c)
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


def _loss_in_fp32_bf16(c: Context) -> Advice:
    """bf16 has fp32's range: its loss fails on precision (a probability rounded to 1.0)."""
    snippet = (f'with torch.autocast("{c.device}", dtype=torch.bfloat16):\n'
               "    logits = model(x)\n"
               "loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), y)\n"
               "# a hand-written loss: its ops on .float() outputs, log-probabilities from "
               "logits\n"
               "log_p = torch.nn.functional.logsigmoid(logits.float())\n"
               "log_1mp = torch.nn.functional.logsigmoid(-logits.float())  # log(1 - p)")
    return ("Compute the loss in fp32, from the logits: on .float() outputs (autocast runs "
            "torch's losses in fp32, not your own ops). bf16 keeps 8 bits of precision: a "
            "probability near 1 is exactly 1.0 there (a sigmoid past 6.24), and log(1 - p) "
            "is -inf. "
            "binary_cross_entropy_with_logits (or logsigmoid) never forms the probability. "
            "(--apply loss_in_fp32 casts the inputs of torch's own loss functions; a "
            "hand-written loss needs the change in its code.)", snippet)


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
    shown = literal(eps, "eps")
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


@fix("check_data", "drop or repair non-finite and out-of-range batches (or targets)",
     manual="the data pipeline must change")
def check_data(c: Context) -> Advice:
    """What the snippet says of the run comes from a check that found it (``Context.data``):
    a batch the replay or the sampled tier found non-finite, or beyond fp16's range, or
    targets that make the loss non-finite; with no such finding it claims nothing."""
    d = c.data or {}
    if d.get("kind") == "targets":
        return _bad_targets(d)
    if d.get("kind") == "off_scale":
        return _off_scale(d)
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


def _off_scale(d: dict) -> Advice:
    """Batches whose values are inside fp16's range but thousands of times the other
    batches': a shard left unnormalised (raw 16-bit readings), which the layers overflow on."""
    snippet = ("for x, y in loader:\n"
               f"    # step {d.get('step')}'s batch held values up to {fmt(d.get('absmax'))}, "
               f"{fmt(d.get('ratio'))}x the batches before it ({fmt(d.get('typical'))})\n"
               f"    assert x.abs().max() < 100 * {fmt(d.get('typical'))}, "
               "'a batch off-scale: is every shard normalised the same way?'")
    return ("Normalise every batch the same way: from step "
            f"{d.get('step')} the batches are {fmt(d.get('ratio'))}x larger than before (a shard "
            "or a source left unscaled), and the model overflows fp16 on them. Find where that "
            "data is loaded and apply the same scaling; a check on each batch's magnitude "
            "catches the next one.", snippet)


def _bad_targets(d: dict) -> Advice:
    """Targets that make the loss non-finite whatever the precision (issue 23's case: every
    target ignore_index, so a mean over no targets is 0/0)."""
    step = d.get("step")
    if d.get("zero_count"):
        at = f"  # step {step}: the count was 0" if step is not None else ""
        snippet = ("mask = (labels != -100).float()\n"
                   "loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1)" + at + "\n"
                   "# or skip the batch: if mask.sum() == 0: continue")
        return ("Clamp the loss's denominator to at least 1 (a batch with nothing to average "
                "then adds 0), or skip such batches: the loss is 0/0 in fp32 too, so AMP is "
                "not the cause and turning it off would not help.", snippet)
    if d.get("unalignable"):
        at = f"  # step {step}: {d.get('unalignable')} too long" if step is not None else ""
        snippet = ("def frames_needed(lab):  # its labels and a blank between repeats\n"
                   "    return len(lab) + int((lab[1:] == lab[:-1]).sum())\n"
                   "keep = [i for i, lab in enumerate(labels) if frames_needed(lab) <= "
                   f"input_lengths[i]]{at}\n"
                   "# or: nn.CTCLoss(zero_infinity=True) drops their +inf loss and gradient")
        return ("Drop (or shorten) the label sequences that need more frames than their "
                "input has, or pass zero_infinity=True: CTC's loss for them is +inf in fp32 "
                "too, so AMP is not the cause.", snippet)
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
