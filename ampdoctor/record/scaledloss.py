"""Which scaled loss a tensor given to backward is: ``scaler.scale(loss)`` itself, or computed
from it by a few ops (``scaler.scale(loss) / n``; a DeepSpeed engine's ``loss * cur_scale``,
``engines.py``). The hooks keep each step's scaled losses and count, for a backward of one of
them, the loss before it was scaled.

Example::

    keep = [scaled]                 # what scaler.scale returned this step
    origin((scaled / 4), keep)      # 0: computed from keep[0]
    origin(other_loss, keep)        # None
"""

from __future__ import annotations

import collections
from typing import Any, Optional

import torch

# How many autograd nodes back from autograd.grad's output a scaled loss is looked for: far
# enough for a few ops on what scaler.scale returned (scaler.scale(loss) / n), never a walk of
# the model's whole graph.
_SCALED_WALK = 16


def _from_scaled(node: Any, scaled: list) -> bool:
    """Does the graph at ``node`` start from what ``scaler.scale`` returned (a ``grad_fn`` in
    ``scaled``), within ``_SCALED_WALK`` nodes?"""
    todo, seen = collections.deque([node]), 0
    while todo and seen < _SCALED_WALK:
        n = todo.popleft()
        if any(n is s for s in scaled):
            return True
        seen += 1
        todo.extend(nxt for nxt, _ in n.next_functions if nxt is not None)
    return False


def from_any_scaled(t: torch.Tensor, keep: list) -> bool:
    """Is ``t`` one of the step's scaled losses (``keep``), or computed from one by a few ops?
    (No walk at all without a scaled loss in the step.)"""
    return origin(t, keep) is not None


def origin(t: torch.Tensor, keep: list) -> Optional[int]:
    """Which of the step's scaled losses (``keep``) ``t`` is, or is computed from by a few
    ops (its position); None for neither. No walk without a scaled loss in the step."""
    for i, k in enumerate(keep):
        if t is k:
            return i
    if not keep or t.grad_fn is None:
        return None
    for i, k in enumerate(keep):
        if k.grad_fn is not None and _from_scaled(t.grad_fn, [k.grad_fn]):
            return i
    return None


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of autograd.grad's ``outputs``: a tensor or a sequence of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors(v)]
    return []
