"""Fixes for a run that already trains in fp8 (torchao's ``Float8Linear``): keep one layer in
high precision, cast per tensor (the output gradient in e5m2), cast row-wise (one scale per
row), or scale by the current amax (not a delayed scale). Each is tried on the whole run by
``record --apply fp8=RECIPE[:keep=...]`` (``record/apply/treatment.py``); the forensic replay of a
failing step does not convert layers, but the fp8 trial at close re-runs the saved step with
each fp8 layer kept in high precision or cast row-wise (``rules/fp8own.py`` reads it as the
outcome of ``fp8_keep_layer`` and ``fp8_rowwise``). Across ranks (``rules/fp8ranks.py``): make
the replicas of a tensor hold the same one (``fp8_sync_replicas``), or take one scale from the
amax reduced over the group that shares it (``fp8_reduce_amax``); neither can be applied from
outside the code.
"""

from __future__ import annotations

from typing import Optional

from .registry import Advice, Context, fix, one_line

# torchao's recipe names that `record --apply fp8=` takes (record/apply/prescription.FP8_RECIPES;
# the analysis side does not import record/, tests/record/test_treatment.py holds them together)
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
_REPLAY = "the replay of the saved step does not convert layers to fp8"


def _recipe(c: Context) -> Optional[str]:
    recipe = (c.fp8 or {}).get("recipe")
    return recipe if recipe in RECIPES else None


def _kept(c: Context) -> list[str]:
    """The layers already kept in high precision, then the culprit."""
    kept = [str(k) for k in (c.fp8 or {}).get("keep") or [] if k]
    return list(dict.fromkeys(kept + ([c.module] if c.module else [])))


def _keep_apply(c: Context) -> Optional[str]:
    recipe, kept = _recipe(c), _kept(c)
    if recipe is None or not kept or any(not _plain(k) for k in kept):
        return None
    return f"fp8={recipe}:keep={','.join(kept)}"


def _plain(name: str) -> bool:
    """A module name ``--apply`` can carry (no separator of the form's own)."""
    return bool(name) and not any(ch in name for ch in ",:= \n\t")


def _converted(recipe: str, note: str) -> str:
    """The lines that convert ``model`` with torchao's ``recipe`` (``note``: why it)."""
    return ("from torchao.float8 import Float8LinearConfig, convert_to_float8_training\n"
            f"config = Float8LinearConfig.from_recipe_name({recipe!r})  # {note}\n"
            "convert_to_float8_training(model, config=config)")


def _filter(kept: list[str]) -> str:
    return "{" + ", ".join(repr(k) for k in kept) + "}"


@fix("fp8_keep_layer", "leave the named layer out of the fp8 conversion: it trains in bf16",
     apply=_keep_apply, manual="the run's fp8 recipe or the layer's name cannot be given to "
     "record --apply fp8", replay=_REPLAY)
def fp8_keep_layer(c: Context) -> Advice:
    layer = one_line(c.module or "the layer")
    kept = _kept(c) or [layer]
    recipe = _recipe(c) or "tensorwise"
    snippet = ("from torchao.float8 import Float8LinearConfig, convert_to_float8_training\n"
               f"config = Float8LinearConfig.from_recipe_name({recipe!r})\n"
               f"keep = {_filter(kept)}  # trained in bf16\n"
               "convert_to_float8_training(model, config=config,\n"
               "                           module_filter_fn=lambda mod, fqn: fqn not in keep)")
    return (f"Keep {layer} in bf16: leave it out of the fp8 conversion (torchao's "
            "module_filter_fn), so that its matmul reads its operands unscaled; the other "
            "layers stay in fp8.", snippet)


@fix("fp8_tensorwise", "cast per tensor (torchao's tensorwise recipe): the output gradient in "
     "e5m2, whose range reaches 2^14 times further below its top than e4m3's",
     apply="fp8=tensorwise", replay=_REPLAY)
def fp8_tensorwise(c: Context) -> Advice:
    was = _recipe(c) or "the run's"
    snippet = _converted("tensorwise", "grad_output: e5m2")
    return (f"Train with torchao's tensorwise recipe instead of {was}: it casts the output "
            "gradient to e5m2 with one scale per tensor, and e5m2 keeps values down to 2^-16, "
            "2^32 below its top of 57344 (e4m3: 2^-9, 2^18 below 448), so a gradient whose "
            "values span many binades is no longer flushed.", snippet)


@fix("fp8_rowwise", "cast row-wise (torchao's rowwise recipe): one scale per row, so one "
     "outlier sets only its own row's scale", apply="fp8=rowwise", replay=_REPLAY)
def fp8_rowwise(c: Context) -> Advice:
    was = _recipe(c) or "the run's"
    snippet = _converted("rowwise", "one scale per row")
    return (f"Train with torchao's rowwise recipe instead of {was}: each row (token) gets its "
            "own power-of-two scale, so a massive activation in one token no longer pushes "
            "the other tokens' values below e4m3's smallest subnormal.", snippet)


@fix("fp8_current_scaling", "scale each cast by the tensor's current amax (torchao's dynamic "
     "tensorwise recipe) instead of a delayed or static scale: the scale follows an amax jump "
     "on the step it happens", apply="fp8=tensorwise", replay=_REPLAY)
def fp8_current_scaling(c: Context) -> Advice:
    snippet = _converted("tensorwise", "dynamic scaling")
    return ("Scale by the current amax: torchao's dynamic scaling (every recipe of torchao "
            "0.10 and later) computes each cast's scale from the tensor it casts, so the "
            "largest value maps to the format's max and none is clamped. Where a delayed scale "
            "must stay (TransformerEngine's DelayedScaling), give it a margin (margin=1 halves "
            "the scale) or a shorter amax history.", snippet)


# Across ranks (rules/fp8ranks.py): ``c.fp8`` holds the operand's layout, {"by": "ddp" or
# "dtensor", "role": "weight", "group": [ranks]}.
_NOT_APPLIED = "it changes how the ranks share a tensor, in the training code"
_RANKS = "one step on one rank cannot show ranks that disagree"


@fix("fp8_sync_replicas", "make every rank that holds a replicated tensor hold the same one: "
     "DDP's gradients all-reduced on every step, weights loaded or changed before DDP is "
     "built (or broadcast after), one batch and one RNG per tensor-parallel group",
     manual=_NOT_APPLIED, replay=_RANKS)
def fp8_sync_replicas(c: Context) -> Advice:
    layout = c.fp8 or {}
    if layout.get("by") == "ddp":
        snippet = ("import contextlib\n"
                   "# every rank must step on the all-reduced gradient: let the last micro-"
                   "batch sync\n"
                   "for i, batch in enumerate(micro_batches):\n"
                   "    last = i == len(micro_batches) - 1\n"
                   "    with contextlib.nullcontext() if last else model.no_sync():\n"
                   "        loss = loss_fn(model(batch)) / len(micro_batches)\n"
                   "        loss.backward()\n"
                   "# weights set on one rank after DDP(model): load on every rank first, or\n"
                   "for p in model.module.parameters():\n"
                   "    torch.distributed.broadcast(p.data, src=0)")
        return ("Make the DDP replicas hold the same weights again, then keep them so: DDP "
                "broadcasts the weights once, when it is built, and afterwards only "
                "all-reduces gradients. So a step whose gradients were not all-reduced "
                "(no_sync() on every micro-batch, the last one included), a checkpoint or "
                "weight change applied on one rank after DDP(model), or an update only some "
                "ranks make leaves each rank its own model, and its own fp8 scale. Reducing "
                "the amax across the ranks would make the scales agree, not the weights.",
                snippet)
    snippet = ("# every rank of a tensor-parallel group must see the same replicated input:\n"
               "# shard the data by the data-parallel rank, not the global rank\n"
               "sampler = DistributedSampler(dataset, num_replicas=dp_mesh.size(),\n"
               "                             rank=dp_mesh.get_local_rank())\n"
               "# and draw dropout masks of a replicated tensor from one seed per TP group\n"
               "torch.manual_seed(seed + dp_mesh.get_local_rank())")
    return ("Give every rank of the group the same replicated tensor: a batch sharded by the "
            "global rank instead of the data-parallel rank, or a dropout mask drawn from each "
            "rank's own seed, makes a tensor the layout says is replicated differ across the "
            "group, and its fp8 scale with it.", snippet)


@fix("fp8_reduce_amax", "take the scale of a tensor several ranks share from its amax reduced "
     "across the group that shares it: torchao's FSDP float8 all-gather with "
     "precompute_float8_dynamic_scale_for_fsdp, its Float8ColwiseParallel on a DTensor, "
     "TransformerEngine's fp8_group set to the amax reduction group",
     manual=_NOT_APPLIED, replay=_RANKS)
def fp8_reduce_amax(c: Context) -> Advice:
    snippet = ("# torchao + FSDP2: one scale per weight, from the amax all-reduced over the "
               "mesh\n"
               "from torchao.float8 import Float8LinearConfig, convert_to_float8_training\n"
               "from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp\n"
               "config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)\n"
               "convert_to_float8_training(model, config=config)  # then fully_shard(...)\n"
               "optimizer.step()\n"
               "precompute_float8_dynamic_scale_for_fsdp(model)  # after every step\n"
               "# torchao + TP: Float8ColwiseParallel / Float8RowwiseParallel, and keep the\n"
               "# layer's input a DTensor whose amax is the whole tensor's (torchtitan#3109)\n"
               "# TransformerEngine: reduce the amax over the tensor-parallel group too\n"
               "with te.fp8_autocast(enabled=True, fp8_recipe=recipe,\n"
               "                     fp8_group=parallel_state.get_amax_reduction_group()):\n"
               "    out = model(batch)")
    return ("Reduce the amax across the group of ranks that shares the tensor before taking "
            "its scale, so that every rank casts it with one scale: with torchao and FSDP2, "
            "enable_fsdp_float8_all_gather and precompute_float8_dynamic_scale_for_fsdp "
            "(one all-reduce for every weight after the optimizer step); with tensor "
            "parallel, torchao's Float8ColwiseParallel/Float8RowwiseParallel on DTensors; "
            "with TransformerEngine, fp8_group set to the amax reduction group (the "
            "tensor-parallel ranks with the data-parallel ones: Megatron-LM PR 442, whose "
            "fp8 runs at TP 8 diverged with the data-parallel group alone).", snippet)
