"""The sampled steps' op probe read (``record/opprobe.StepProbe`` writes it; its events are
read whole by ``events.hidden_nonfinite``): the findings that speak of the precision
(``precision_hits``: an op that made inf/NaN in fp16/bf16 inside a module whose output stayed
finite, a mask's sum left out), and the note a healthy verdict carries for one
(``hidden_note``). Read by ``rules/hidden.py`` (``hidden_overflow``), ``notes.py`` and
``forecast.py``.

Example::

    precision_hits(f.hidden_nonfinite)[0]["op"]   # 'mul'
"""

from __future__ import annotations

from ..numfmt import count
from .facts import Facts

# What the op probe saw counts only in the low precisions (an fp32 log(0) that a mask wants is
# no precision problem).
LOW_DTYPES = ("float16", "bfloat16")
# ... and not an addition that made only -inf: two large negative mask constants summed (a
# causal mask plus a padding mask at torch.finfo(fp16).min each) give -inf by design, which
# softmax takes. A product, a power, a cast or an exp that overflows is not a mask.
MASK_OPS = ("add", "radd", "iadd", "sub", "rsub", "isub", "where")
_KINDS = ((1, "NaN"), (2, "+inf"), (4, "-inf"))


def hidden_overflows(f: Facts) -> list[dict]:
    """The op probe's findings that speak of the precision (``precision_hits``)."""
    return precision_hits(f.hidden_nonfinite)


def precision_hits(hits: list[dict]) -> list[dict]:
    """Of ``events.hidden_nonfinite``'s findings, those in fp16/bf16 that are not a mask sum."""
    return [h for h in hits if h["dtype"] in LOW_DTYPES and h["module"]
            and not (h["created"] == 4 and h["op"] in MASK_OPS)]


def hidden_note(f: Facts) -> list[str]:
    """For a healthy verdict: a hidden overflow that did no visible harm."""
    hits = hidden_overflows(f)
    if not hits:
        return []
    h = hits[0]
    steps = sorted({x["step"] for x in hits if x["module"] == h["module"]})
    harm = ("the loss still fell, so it did no harm this run shows" if f.curve.fell else
            f"whether it did harm was not judged ({f.curve.why or 'the run is short'})")
    return [f"Inside {h['module']}, {h['op']} made {kinds_made(h['created'])} in {h['dtype']} on "
            f"{count(len(steps), 'sampled step')} (first {steps[0]}) although {h['module']}'s "
            f"output stayed finite; {harm}. Computing that op in fp32 (an fp32 island around "
            f"{h['module']}) keeps it out."]


def kinds_made(bits: int) -> str:
    return " and ".join(name for bit, name in _KINDS if bits & bit) or "inf/NaN"
