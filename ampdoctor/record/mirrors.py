"""Master weights: an optimizer that steps copies of the model's parameters.

Mixed precision written by hand (apex's O2, Megatron's fp16 optimizer, a bf16 model whose
updates would round away in bf16: pytorch/pytorch#120376) keeps fp32 copies of the half
weights: the model runs in half, its gradients are copied into the copies' ``.grad``, the
optimizer steps the copies and they are cast back into the model. None of the optimizer's
tensors is a parameter of the model, yet its step is the run's step, and the copies are the
weights the run really updates (their update ratio is the run's: nothing of it rounds away).

``match`` tells such copies from another model's optimizer by their layout: one tensor per
parameter of the model that the optimizer does not step itself, of the same shape (apex's O2
steps the copies of the half weights beside the fp32 BatchNorm weights themselves). Each copy
is paired with a parameter shape by shape, in order (the k-th copy of a shape mirrors the k-th
parameter of that shape): the usual weight-decay groups (decayed weights, then biases and
norms) keep the model's order within each shape, so each copy takes its parameter's name.
Master weights held in one flat buffer (a ZeRO partition) do not match: their engine's steps
are read by ``engines.py``.

Example::

    pairs = mirrors.match(optimizer_params, model_params)   # {id(copy): id(parameter)}
    pairs = mirrors.of_models(optimizer_params, [list(root.parameters()) for root in roots])
"""

from __future__ import annotations

import collections

import torch


def match(params: list[torch.Tensor], model: list[torch.Tensor],
          others: frozenset = frozenset()) -> dict[int, int]:
    """``{id(copy): id(parameter)}`` where the tensors of ``params`` (an optimizer's) that are
    not ``model``'s (the model's parameters) are copies, shape for shape, of those of
    ``model`` it does not step; empty where they are not (another model's optimizer, a part
    of the model, the model's own parameters only). A tensor in ``others`` (the ids of
    another model's parameters) is never a copy: an optimizer of the real model is not one
    of copies of a throwaway model of the same shapes. Python-side only: shapes and ids, no
    tensor read."""
    params, model = _unique(params), _unique(model)
    own = {id(q) for q in model}
    stepped = {id(p) for p in params}
    if any(id(p) in others and id(p) not in own for p in params):
        return {}
    copies = [p for p in params if id(p) not in own]
    rest = [q for q in model if id(q) not in stepped]
    if not copies or len(copies) != len(rest):
        return {}
    by_shape: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
    for q in rest:
        by_shape[tuple(q.shape)].append(q)
    pairs: dict[int, int] = {}
    for p in copies:
        waiting = by_shape.get(tuple(p.shape))
        if not waiting:
            return {}  # a shape the model has not (or not that many times)
        pairs[id(p)] = id(waiting.popleft())
    return pairs


def of_models(params: list[torch.Tensor], models: list[list[torch.Tensor]]) -> dict[int, int]:
    """``match`` against the parameters of ``models`` (the roots, in the order adopted)
    together, then each one's alone, the last adopted first (a model run and dropped in the
    first step comes before the real one, and may have its shapes); their trainable
    parameters first, then all of them (a frozen parameter copied too)."""
    everything = [p for model in models for p in model]
    tries = [everything] + (models[::-1] if len(models) > 1 else [])
    others = frozenset(id(p) for p in everything)
    for model in tries:
        for wanted in ([p for p in model if p.requires_grad], model):
            pairs = match(params, wanted, others)
            if pairs:
                return pairs
    return {}


def _unique(tensors: list) -> list[torch.Tensor]:
    """The tensors of ``tensors``, each once, in their order."""
    return list({id(t): t for t in tensors if isinstance(t, torch.Tensor)}.values())
