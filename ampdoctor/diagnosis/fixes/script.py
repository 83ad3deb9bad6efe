"""Fixes for the training script's calls: the order of unscale_, clip, step and update, the
scaler created once, gradients zeroed, micro-batches averaged, the LR scheduler stepped once
per real optimizer step, BatchNorm statistics guarded or kept in fp32.
"""

from __future__ import annotations

from .premises import own_clip
from .registry import (
    Advice,
    Context,
    Dose,
    fix,
    literal,
    max_norm,
)


@fix("unscale_before_clip", "call scaler.unscale_(optimizer) before the clip",
     manual="the order of the calls in the loop must change")
def unscale_before_clip(c: Context) -> Advice:
    snippet = ("scaler.scale(loss).backward()\n"
               "scaler.unscale_(optimizer)  # first: gradients back to their true size\n"
               + _clip_line(c) + "\n"
               "scaler.step(optimizer)\n"
               "scaler.update()")
    by_value = c.clip_call in ("clip_grad_value_", "adaptive_clip_grad")
    bound = c.clip_value if by_value else c.clip_max_norm
    name = {"clip_grad_value_": "clip_value", "adaptive_clip_grad": "clip_factor"}.get(
        c.clip_call, "max_norm")
    dose = Dose({name: bound}, f"the {name} the run's {c.clip_call} passed") if bound else None
    what = {"clip_grad_value_": "clips every value at a bound S times too tight",
            "adaptive_clip_grad": "compares gradients S times too large with the weights and "
                                  "cuts them S times too hard"
            }.get(c.clip_call, "measures a norm S times too large and shrinks every update by "
                               "the loss scale S")
    return (f"Call scaler.unscale_(optimizer) before {c.clip_call}: clipping the scaled "
            f"gradients {what}.", snippet, dose)


def _clip_line(c: Context) -> str:
    """The run's own clip, as it called it, with the bound it passed."""
    if c.clip_call == "adaptive_clip_grad":
        factor = literal(c.clip_value, "clip_factor") if c.clip_value else "clip_factor"
        return (f"timm.utils.adaptive_clip_grad(model.parameters(), {factor})"
                + ("  # your clip factor (--clip-grad with --clip-mode agc)" if c.clip_value
                   else ""))
    if c.clip_call == "clip_grad_value_":
        value = literal(c.clip_value, "clip_value") if c.clip_value else "clip_value"
        return (f"torch.nn.utils.clip_grad_value_(model.parameters(), clip_value={value})"
                + ("  # your clip_value" if c.clip_value else ""))
    norm = literal(c.clip_max_norm, "max_norm") if c.clip_max_norm else "max_norm"
    mine = "  # your max_norm" if c.clip_max_norm else ""
    if c.clip_call == "clip_grads_with_norm_":
        return ("params = list(model.parameters())\n"
                "total = torch.nn.utils.get_total_norm([p.grad for p in params])\n"
                f"torch.nn.utils.clip_grads_with_norm_(params, max_norm={norm}, "
                f"total_norm=total){mine}")
    return f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={norm}){mine}"


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


@fix("unscale_autograd_grad", "unscale torch.autograd.grad's gradients of the scaled loss "
     "before a penalty uses them", manual="the penalty's code must change")
def unscale_autograd_grad(c: Context) -> Advice:
    snippet = ("scaled_grads = torch.autograd.grad(scaler.scale(loss), model.parameters(),\n"
               "                                   create_graph=True)\n"
               "inv_scale = 1. / scaler.get_scale()\n"
               "grads = [g * inv_scale for g in scaled_grads]  # unscaled: their true size\n"
               f'with torch.autocast("{c.device}", dtype=torch.float16):\n'
               "    penalty = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()\n"
               "    loss = loss + penalty\n"
               "scaler.scale(loss).backward()")
    return ("Unscale the gradients torch.autograd.grad returns for the scaled loss before the "
            "penalty uses them (the AMP docs' gradient penalty): they are the loss scale "
            "times too large.", snippet)


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


@fix("scale_every_loss", "backward every loss through scaler.scale (their sum, or each)",
     manual="the loop's backward calls must change")
def scale_every_loss(c: Context) -> Advice:
    snippet = (f'with torch.autocast("{c.device}", dtype=torch.float16):\n'
               "    loss = main_loss(model, batch)\n"
               "    aux = aux_loss(model, batch)\n"
               "scaler.scale(loss + aux).backward()  # one backward, both losses scaled\n"
               "# or, each on its own: scaler.scale(loss).backward(); "
               "scaler.scale(aux).backward()\n"
               "scaler.step(optimizer)  # unscales every gradient once, by the same scale\n"
               "scaler.update()")
    return ("Send every loss that is backwarded through scaler.scale: scaler.step divides "
            "all the gradients by the loss scale, so a loss backwarded on its own arrives S "
            "times too small.", snippet)


@fix("unscale_after_last_backward", "call scaler.unscale_ after the step's last backward "
     "(SAM: the ascent from the scaled gradients)", manual="the order of the calls in the loop "
     "must change")
def unscale_after_last_backward(c: Context) -> Advice:
    snippet = (f'with torch.autocast("{c.device}", dtype=torch.float16):\n'
               "    loss = criterion(model(x), y)\n"
               "scaler.scale(loss).backward()\n"
               "# no unscale_ here: the ascent direction g / ||g|| is the same for scaled\n"
               "# gradients (skip the ascent when their norm is not finite)\n"
               "sam.first_step(zero_grad=True)\n"
               f'with torch.autocast("{c.device}", dtype=torch.float16):\n'
               "    loss2 = criterion(model(x), y)\n"
               "scaler.scale(loss2).backward()\n"
               "sam.restore()  # back to w\n"
               "scaler.unscale_(optimizer)  # once, after the last backward of the step\n"
               "scaler.step(optimizer)\n"
               "scaler.update()")
    return ("Call scaler.unscale_(optimizer) once, after the step's last backward: GradScaler "
            "unscales an optimizer only once per update(), so gradients backwarded after an "
            "earlier unscale_ reach scaler.step still multiplied by the loss scale. A pass "
            "that needs the gradients before that (SAM's ascent) uses the scaled ones, whose "
            "direction is the same, or divides by scaler.get_scale() itself.", snippet)


@fix("fix_scaler_calls", "one unscale_/step/update per optimizer step, in that order",
     manual="the order of the calls in the loop must change", premise=own_clip)
def fix_scaler_calls(c: Context) -> Advice:
    clip, dose = max_norm(c)
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


@fix("divide_loss_by_accum", "divide each micro-batch's loss by the number of micro-batches",
     manual="the loss's code must change")
def divide_loss_by_accum(c: Context) -> Advice:
    snippet = ("for micro, (x, y) in enumerate(micro_batches):\n"
               "    loss = criterion(model(x), y) / len(micro_batches)  # a mean, not a sum\n"
               "    scaler.scale(loss).backward()")
    return ("Divide each micro-batch's loss by the number of "
            "micro-batches: .grad then holds their mean, which stays the size of one "
            "micro-batch's gradient however many are accumulated.", snippet)


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


@fix("floor_lr", "keep the LR schedule at or above 0: a schedule that passes zero climbs the "
     "loss", manual="the schedule is the script's own arithmetic",
     replay="the replay of one step cannot try a schedule, which needs many steps")
def floor_lr(c: Context) -> Advice:
    snippet = ("min_lr = 1e-6  # the floor the schedule anneals to\n"
               "lr = max(min_lr, schedule(step))  # never below 0: a negative LR climbs the loss\n"
               "for group in optimizer.param_groups:\n"
               "    group[\"lr\"] = lr")
    return ("Keep the learning rate at or above 0: the schedule passed zero, and with a "
            "negative LR every step moves the weights up the gradient, so the loss climbs "
            "however small the step. Clamp the schedule at a floor (the annealing's end, a "
            "fraction of the minimum LR), or size it for the steps the run really takes.",
            snippet)


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


@fix("reload_finite_checkpoint", "resume from the newest checkpoint whose tensors are all "
     "finite, and check them before saving", manual="the resume must pick another checkpoint")
def reload_finite_checkpoint(c: Context) -> Advice:
    where = f" ({c.module})" if c.module else ""
    snippet = ("def finite(state):\n"
               "    return all(torch.isfinite(v).all() for v in state.values()\n"
               "               if torch.is_tensor(v) and v.is_floating_point())\n"
               "\n"
               "for path in sorted(checkpoints, key=os.path.getmtime, reverse=True):\n"
               "    ckpt = torch.load(path)\n"
               "    if finite(ckpt[\"model\"]):  # the newest one with finite weights\n"
               "        break\n"
               "model.load_state_dict(ckpt[\"model\"])\n"
               "# and when saving: only finite weights\n"
               "if finite(model.state_dict()):\n"
               "    torch.save({\"model\": model.state_dict()}, path)  # with the optimizer's, "
               "the scaler's")
    return (f"The weights{where} were already NaN/inf before the run's first update: they "
            "were loaded so (a checkpoint saved after an earlier run went non-finite). No "
            "precision, LR or data change helps: resume from the newest checkpoint whose "
            "tensors are all finite, and check them before writing one.", snippet)


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


@fix("fp32_buffers", "keep normalization layers, and their running statistics, in fp32",
     manual="the model's BatchNorm layers must be cast back to fp32 where it is built")
def fp32_buffers(c: Context) -> Advice:
    mod = f" {c.module}" if c.module else ""
    snippet = ("model.half()  # or a frozen backbone loaded in fp16\n"
               "for m in model.modules():  # the statistics overflow fp16 (max 65504)\n"
               "    if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):\n"
               "        m.float()\n"
               "# a frozen model needs no statistics at all: model.eval()")
    return (f"Keep the normalization layers{mod} in fp32: a BatchNorm's running_var is a "
            "mean of squared activations, and held in fp16 it turns inf once the activations "
            "pass about 256; every evaluation then divides by an infinite variance. A frozen "
            "model can stay in eval() so that its statistics never change.", snippet)
