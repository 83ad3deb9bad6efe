"""``ampdoctor top``'s fp8 lines: one per Linear at risk in fp8, nothing while none is.

The frame's ``fp8`` (``frame.Fp8Line``, from ``diagnosis.fp8watch``): per layer at risk on the
latest sampled step, its headroom under a delayed scale, the growth of its fastest-growing
operand's amax, its input's kurtosis and the sampled step it was first at risk. A run whose
Linears stay within every threshold gets no line at all.

Example::

    print("\\n".join(fp8top.lines(fr, 80, lambda style, text: text)))
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from .. import safe

KEY = ("headroom: binades to the fp8 top under a delayed scale (< 0 clamps); growth: amax "
       "doublings per 100 steps; kurtosis: the input's (Gaussian 3)")


def lines(fr: Any, width: int, paint: Callable[[str, str], str]) -> list[str]:
    """The fp8 section of a frame, in at most ``width`` columns; [] when no layer is at risk."""
    if not fr.fp8:
        return []
    n = fr.fp8_at_risk
    more = f", the {len(fr.fp8)} most at risk shown" if n > len(fr.fp8) else ""
    out = [f"fp8 headroom: {n} Linear{'' if n == 1 else 's'} at risk{more}:"]
    name_w = max(12, width - 2 - 10 - 9 - 10 - 8)
    out.append(f"  {'layer':<{name_w}}{'headroom':>10}{'growth':>9}{'kurtosis':>10}"
               f"{'since':>8}")
    for x in fr.fp8:
        name = safe.terminal(x.name)
        if len(name) > name_w - 1:
            name = "…" + name[-(name_w - 2):]
        out.append(paint("red", f"  {name:<{name_w}}{_num(x.headroom, '+.1f'):>10}"
                                f"{_num(x.growth, '+.1f'):>9}{_num(x.kurtosis, '.0f'):>10}"
                                f"{_num(x.since, 'd'):>8}"))
    out += _wrap(KEY, width - 2)
    return out


def _num(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _wrap(text: str, width: int) -> list[str]:
    out, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            out.append("  " + line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return out + (["  " + line] if line else [])
