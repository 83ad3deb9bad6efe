"""A Linear's three matmuls in emulated fp8, for a trial: what the layer does under a recipe.

``in_fp8(modules, recipe)`` replaces, while it is open, each module's forward (an
``nn.Linear``, or Hugging Face's ``Conv1D``) by the matmuls an fp8 training recipe runs
(torchao's ``Float8Linear``):

- forward: ``y = cast(x) @ cast(W).T + b``, both operands scaled along the contracted
  dimension (the input's and the weight's last);
- input gradient: ``dx = cast(dy) @ cast(W)``, scaled along the output dimension;
- weight gradient: ``dW = cast(dy).T @ cast(x)``, scaled along the tokens (for the
  per-tensor recipe the scale is the tensor's either way);
- the bias and its gradient in high precision, as torchao leaves them.

Each ``cast`` is ``record/fp8.py``'s: the recipe's scale, rounding to e4m3 (e5m2 for the
output gradient under per-tensor scaling) and back, in float32; the products run in float32
with autocast off, as an fp8 GEMM accumulates in fp32, and the output takes the dtype the
layer's output had (autocast's, or the input's). The parameters receive their gradients
through the casts, straight through: the cast is the forward's, the gradient is the fp8
matmul's. No fp8 kernel runs, so this runs on any device.

Example::

    with in_fp8([model.fc2], Recipe.TENSOR):
        loss = criterion(model(x), y)          # fc2 in emulated fp8, the rest as it was
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch

from ...runfile.schema import Fp8Format, Recipe, Role
from ..fp8 import cast, element_format, matmul_weight


class _Fp8Matmul(torch.autograd.Function):
    """``linear(x, w, b)`` with the three matmuls of an fp8 recipe (the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                recipe: Recipe, out_dtype: torch.dtype) -> torch.Tensor:
        ctx.recipe = recipe
        ctx.dtypes = (x.dtype, w.dtype, None if b is None else b.dtype)
        ctx.save_for_backward(x, w)
        with torch.autocast(x.device.type, enabled=False):
            e4m3 = Fp8Format.E4M3
            y = cast(x, recipe, e4m3) @ cast(w, recipe, e4m3).t()
            if b is not None:
                y = y + b.float()
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        x, w = ctx.saved_tensors
        recipe = ctx.recipe
        e4m3, grad_fmt = Fp8Format.E4M3, element_format(recipe, Role.GRAD_OUTPUT)
        with torch.autocast(dy.device.type, enabled=False):
            g = dy.float().reshape(-1, dy.shape[-1])
            x2 = x.float().reshape(-1, x.shape[-1])
            dx = dw = db = None
            if ctx.needs_input_grad[0]:
                dx = cast(g, recipe, grad_fmt) @ cast(w.float().t(), recipe, e4m3).t()
                dx = dx.reshape(x.shape).to(ctx.dtypes[0])
            if ctx.needs_input_grad[1]:
                dw = cast(g.t(), recipe, grad_fmt) @ cast(x2.t(), recipe, e4m3).t()
                dw = dw.to(ctx.dtypes[1])
            if ctx.needs_input_grad[2]:
                db = g.sum(0).to(ctx.dtypes[2])
        return dx, dw, db, None, None


def linear_fp8(module: torch.nn.Module, recipe: Recipe) -> Any:
    """A forward for ``module`` (a matmul module: ``fp8.matmul_weight``) in emulated fp8."""
    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        weight = matmul_weight(module)  # [out, in]: read at each call (weight_norm, swaps)
        assert weight is not None
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) \
            else x.dtype
        return _Fp8Matmul.apply(x, weight, getattr(module, "bias", None), recipe, out_dtype)
    return forward


def in_fp8(modules: list, recipe: Recipe) -> contextlib.AbstractContextManager[None]:
    """Each of ``modules`` runs its matmuls in emulated fp8 under ``recipe`` while open; its
    own forward is put back after (an instance attribute, removed)."""
    return _forwards_swapped(modules, lambda m: linear_fp8(m, recipe))


def in_high_precision(modules: list) -> contextlib.AbstractContextManager[None]:
    """The reverse of ``in_fp8``: each of ``modules`` (a layer already in fp8, torchao's
    ``Float8Linear``) runs as the ``nn.Linear`` it was converted from, ``linear(x, W, b)``
    with no cast, while open (under autocast, in autocast's dtype, as a Linear would)."""
    return _forwards_swapped(modules, _linear)


@contextlib.contextmanager
def _forwards_swapped(modules: list, make: Callable[[torch.nn.Module], Any]) -> Iterator[None]:
    """Each of ``modules`` (a matmul module) has ``make(module)`` as its forward while open;
    its own forward (an instance attribute, or none) is put back after."""
    swapped = []
    try:
        for m in modules:
            if matmul_weight(m) is None:
                raise TypeError(f"{type(m).__name__} is not a Linear layer")
            had = m.__dict__.get("forward")
            m.forward = make(m)
            swapped.append((m, had))
        yield
    finally:
        for m, had in reversed(swapped):
            if had is None:
                del m.forward
            else:
                m.forward = had


def _linear(module: torch.nn.Module) -> Any:
    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        weight = matmul_weight(module)
        assert weight is not None
        return torch.nn.functional.linear(x, weight, getattr(module, "bias", None))
    return forward
