"""Gradient accumulation in a half ``.grad``: finite micro-batch gradients whose sum overflows.

``backward()`` adds each micro-batch's gradient into an fp16 parameter's ``.grad`` in fp16,
so micro-batches that are each finite can still leave ``.grad`` holding inf. When every
micro-batch of a step replays finite and ``.grad`` is non-finite anyway, ``overflow``
recomputes each micro-batch's parameter gradients (its forward again, backward from the output
gradient the real step saw) and sums them in that dtype, in order; ``explain`` turns what it
found into the replay's finding. Event only: one backward and one parameter-sized sum per
micro-batch, host reads to compare.

Example (what ``Forensics._search`` does once every micro-batch replayed finite)::

    accum = overflow(watched, captures, stale_param_names)
    if accum:
        explain(finding, accum, len(captures), watched.names)
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...runfile.detail import AccumOverflow
from ...runfile.schema import Phase
from ..sampler import tensors_in
from .culprit import Culprit
from .isolated import set_rng
from .trace import Capture, autocast, unwrap


def overflow(watched: Any, captures: list, stale: list[str]) -> Optional[AccumOverflow]:
    """The first fp16 parameter (among ``stale``, those whose ``.grad`` is non-finite) and
    micro-batch whose running sum turns non-finite while every term is finite, else None (the
    ``.grad`` was stale: left over from an earlier step). ``watched``: the recorder's
    ``Watched`` (parameter names, trained parameters)."""
    by_name = {watched.param_names.get(id(p)): p for p in watched.trained_params()}
    params = [(n, p) for n, p in by_name.items() if n in stale and p.dtype == torch.float16]
    if not params or any(not c.grads for c in captures):
        return None
    sums = [torch.zeros_like(p) for _, p in params]
    for k, cap in enumerate(captures):
        grads = _micro_param_grads(cap, [p for _, p in params])
        for j, g in enumerate(grads):
            if g is None:
                continue
            if not bool(torch.isfinite(g).all()):
                return None  # a micro-batch's own gradient: not the accumulation
            wide = (sums[j].float() + g.float()).abs().max()
            sums[j] += g
            if not bool(torch.isfinite(sums[j]).all()):
                return AccumOverflow(param=params[j][0], micro=k,
                                     micro_batches=len(captures),
                                     dtype=str(g.dtype).replace("torch.", ""),
                                     fp32_absmax=float(wide))
    return None


def explain(finding: Culprit, accum: AccumOverflow, n: int, names: dict) -> None:
    """The replay's finding when the accumulation in ``.grad`` overflowed (``names``: the
    recorder's module -> name map)."""
    owner = accum.param.rsplit(".", 1)[0] if "." in accum.param else accum.param
    module = next((m for m, name in names.items() if name == owner), None)
    finding.phase, finding.module = Phase.BACKWARD, owner
    finding.module_type = type(module).__name__ if module is not None else ""
    finding.fp32_absmax = accum.fp32_absmax  # the sum's (no module to re-run in fp32)
    finding.detail.accum_overflow = accum
    finding.summary = (f"each of the {n} micro-batches' gradients is finite, but their sum "
                       f"in {accum.dtype} .grad passes 65504 at micro-batch "
                       f"{accum.micro} ({accum.param}, {accum.fp32_absmax:.3g} in fp32)")
    finding.detail.how = finding.summary


def _micro_param_grads(cap: Capture, params: list) -> list:
    """One micro-batch's gradients for ``params``: its forward again (same RNG, autocast),
    backward from the output gradient the real step saw; .grad is not touched."""
    set_rng(cap.rng)
    with torch.enable_grad(), autocast(cap.autocast):
        output = unwrap(cap.root)(*cap.args, **cap.kwargs)
    outs = list(tensors_in(output))
    pairs = [(t, cap.grads[i]) for i, t in enumerate(outs)
             if i in cap.grads and isinstance(t, torch.Tensor) and t.requires_grad]
    if not pairs:
        return [None] * len(params)
    return list(torch.autograd.grad([t for t, _ in pairs], params, [g for _, g in pairs],
                                    allow_unused=True))
