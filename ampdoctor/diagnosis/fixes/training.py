"""Fixes that are not the precision: the learning rate (measured from the run), dead units, a
model that does not learn, and a NaN the replay does not reproduce (the device, determinism).
"""

from __future__ import annotations

import json
from typing import Optional

from .premises import lr_to_lower, units_can_die
from .registry import (
    Advice,
    Context,
    Dose,
    assign_module,
    clip_step,
    fix,
    joined,
    literal,
    max_norm,
    one_line,
)


def _tenth(peak: Optional[float]) -> Optional[Dose]:
    """The LR default with no update ratio to measure: a tenth of the peak."""
    if not peak:
        return None
    return Dose({"lr": float(f"{peak / 10:.2g}"), "lr_factor": 0.1},
                f"a tenth of the peak LR {literal(peak, '')}: the default, no update ratio "
                "was measured")


def _lr_apply(c: Context) -> Optional[str]:
    """``lr_factor=F``: the run's whole LR schedule scaled so that its peak becomes the
    measured LR (``lr=X`` when the run recorded no LR to scale)."""
    dose = c.dose("lr") or _tenth(c.lr)
    if dose is None or not dose.values.get("lr"):
        return None
    factor = dose.values.get("lr_factor")
    return f"lr_factor={literal(factor, '')}" if factor else \
        f"lr={literal(dose.values['lr'], '')}"


@fix("lower_lr", "lower the peak learning rate to the one an LR range test on the run's "
     "first state kept training (else a bound from the update ratios), clip after unscale_",
     apply=_lr_apply, manual="the run recorded no learning rate to scale",
     replay="the replay of one step cannot try a lower LR, which needs many steps (the LR "
     "range test, where one ran, tried it from the run's first state: see its numbers)",
     premise=lr_to_lower)
def lower_lr(c: Context) -> Advice:
    lr_dose = c.dose("lr") or _tenth(c.lr)
    new = literal(lr_dose.values.get("lr") if lr_dose else None, "lr / 10")
    clip, norm_dose = max_norm(c)
    peak = f"  # peak was {literal(c.lr, str(c.lr))}" if c.lr else ""
    snippet = (f"optimizer = torch.optim.{c.optimizer}(model.parameters(), lr={new}){peak}\n"
               "...\n" + clip_step(c.scaler, clip))
    after = " (after unscale_)" if c.scaler else ""
    clipping = f"keep clipping gradients at {clip}{after}, as the script does" \
        if c.clip_max_norm else f"clip gradients at {clip}{after}"
    return (f"Set the peak learning rate to {new} and {clipping}. Restart from the initial "
            "weights or "
            "a checkpoint before the weights grew: what a too-large step did to them does not "
            "undo itself.", snippet, joined(lr_dose, norm_dose))


@fix("revive_units", "an activation that cannot die (LeakyReLU/GELU), biases from 0, a restart",
     manual="the activations are in the model's code", replay="the replay of one step cannot "
     "try a restart, which needs many steps", premise=units_can_die)
def revive_units(c: Context) -> Advice:
    """Dead units (ReLU outputs 0 for every input) pass no gradient and never come back."""
    kind = (c.module_type or "").lower()
    at = f" before step {c.step}" if c.step is not None else ""
    if c.module and kind in ("relu", "relu6", "threshold", "hardtanh", ""):
        what = one_line(f"{c.module}{f' ({c.module_type})' if c.module_type else ''}")
        leaky = assign_module(c.module, "torch.nn.LeakyReLU(0.01)", c.handles)
        snippet = (f"# {what} outputs exactly 0 for every input: nothing before it learns\n"
                   f"{leaky}  # or torch.nn.GELU(): never flat, "
                   "so the gradient keeps flowing\n"
                   "# and restart from the initial weights (or a checkpoint"
                   f"{at}): dead units do not come back")
    else:
        snippet = ("# ReLU -> a non-saturating activation in the model's definition\n"
                   "act = torch.nn.LeakyReLU(0.01)  # or torch.nn.GELU()\n"
                   "# biases start at 0, not below it; a LayerNorm before the activation\n"
                   "torch.nn.init.zeros_(layer.bias)")
    return ("Units whose input is negative for every example output 0 "
            "and pass no gradient, so they never recover: use an activation with a slope "
            "everywhere (LeakyReLU, GELU, SiLU), start biases at 0 and normalise before the "
            "activation, keep the LR low enough that one update cannot push them all "
            "negative, and restart the run: the dead units stay dead.", snippet)


@fix("overfit_one_batch", "train on one fixed batch to tell a wiring bug from a data or LR "
     "problem", manual="it is a different loop, on one batch",
     replay="whether the model can learn is not told by one step")
def overfit_one_batch(c: Context) -> Advice:
    """A flat loss with no numeric cause: the classic first check of a training setup."""
    lr = f", lr={literal(c.lr, 'lr')}" if c.lr else ""
    snippet = ("batch = next(iter(loader))  # one fixed batch, used again and again\n"
               "for i in range(300):\n"
               "    loss = compute_loss(model, batch)\n"
               "    loss.backward()\n"
               f"    optimizer.step()  # {c.optimizer}{lr}, as in the run\n"
               "    optimizer.zero_grad(set_to_none=True)\n"
               "print(loss.item())  # near 0: the model can learn; look at the data and the LR\n"
               "# the labels must stay paired with their inputs: shuffle them together\n"
               "perm = torch.randperm(len(x)); x, y = x[perm], y[perm]")
    return ("Check that the model can learn at all: train it on one fixed batch for a few "
            "hundred steps. If the loss cannot get near 0 there, the model, the loss or the "
            "optimizer is wired wrong (parameters the loss does not reach or the optimizer "
            "does not hold, an LR far off); if it can, look at the data: labels that are not "
            "paired with their inputs (shuffled separately, an off-by-one) leave nothing to "
            "learn.", snippet)


@fix("test_device", "test or exclude the device the failure began on (vendor diagnostics)",
     manual="the device is tested with the vendor's tools, outside the run",
     replay="the replay ran on the same device")
def test_device(c: Context) -> Advice:
    """A failure that did not reproduce on the same batch and weights: the device first."""
    where = f"rank {c.rank}'s device" if c.rank is not None else "the device"
    who = f"rank {c.rank}" if c.rank is not None else "each rank"
    if c.device == "cuda":
        snippet = ("import socket, subprocess\n"
                   f"# where {who} runs (log it on every rank):\n"
                   "print(socket.gethostname(), torch.cuda.current_device(), "
                   "torch.cuda.get_device_name())\n"
                   "# on that host, the vendor's diagnostics (AMD: rocm-smi --showrasinfo all, "
                   "rvs)\n"
                   'subprocess.run(["nvidia-smi", "-q", "-d", "ECC,PAGE_RETIREMENT,'
                   'ROW_REMAPPER"])\n'
                   'subprocess.run(["dcgmi", "diag", "-r", "3"])  # memory, compute, PCIe '
                   "stress\n"
                   "# and keep the node out of the job (the scheduler's exclude list) until it "
                   "passes")
    else:
        snippet = ("import socket\n"
                   f"# where {who} runs (log it on every rank):\n"
                   "print(socket.gethostname())\n"
                   "# on that host: the kernel's record of corrected and uncorrected memory "
                   "errors,\n"
                   "#   grep . /sys/devices/system/edac/mc/mc*/[cu]e_count; journalctl -k | grep "
                   "-i mce\n"
                   "# a memory test (memtester, or the vendor's), and keep the host out of the "
                   "job until it passes")
    return (f"Test {where} with the vendor's diagnostics, and keep it out of the job until it "
            "passes: a NaN that the same step on the same batch and weights does not repeat "
            "is the machine's, and a faulty GPU tends to do it again.", snippet)


@fix("rerun_elsewhere", "re-run the failing step on another device, from a checkpoint before it",
     manual="it needs another device and the job's checkpoint",
     replay="the replay ran on the same device")
def rerun_elsewhere(c: Context) -> Advice:
    step = c.step if c.step is not None else "S"
    command = json.dumps(["ampdoctor", "record", "-o", "rerun.h5", "--", "python",
                          *(c.argv or ["train.py"])])
    launched = (f"# (one rank of {c.world_size}: re-run it the way the job was launched, "
                "torchrun included)\n" if c.world_size > 1 else "")
    run = (f'subprocess.run({command},\n'
           '               env={**os.environ, "CUDA_VISIBLE_DEVICES": "1"})  # another GPU\n'
           if c.device == "cuda" else f"subprocess.run({command})  # on another host\n")
    snippet = ("import os, subprocess\n"
               f"# resume from the last checkpoint before step {step}, same data order, on "
               "another device\n" + launched + run +
               f"# step {step} finite there: this device is at fault; non-finite again: the "
               "numbers are")
    return ("Re-run the failing step on another device: resume from a checkpoint before it "
            "with the same batches. Finite there and non-finite here is a faulty device; "
            "non-finite on both is the numbers after all.", snippet)


@fix("deterministic_algorithms", "rule out nondeterministic kernels: deterministic algorithms",
     manual="the script must switch them on before training starts")
def deterministic_algorithms(c: Context) -> Advice:
    snippet = ('import os\n'
               'os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before CUDA starts\n'
               "torch.use_deterministic_algorithms(True)  # raises on an op with no "
               "deterministic kernel\n"
               "torch.backends.cudnn.benchmark = False")
    return ("Make the run deterministic to rule out a kernel whose result depends on "
            "scheduling (atomics in scatter/index_add, cuDNN autotuning): a NaN that still "
            "does not reproduce then is the hardware, or code outside the model that the "
            "replay does not run (hooks, a hand-written loss, communication).", snippet)
