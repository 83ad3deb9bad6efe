"""The always-on cost of recording a compiled model, measured so that a loaded machine cannot
move it: process CPU time, short blocks interleaved A/A'/B in one process, median of ratios.

    python benchmarks/compiled_overhead.py                       # reference GPT, compiled
    python benchmarks/compiled_overhead.py --rounds 40 --json benchmarks/results/compiled_overhead.json
    python benchmarks/compiled_overhead.py --eager               # the same model, not compiled

``overhead.py --compile`` times steps by wall clock. On 2 CPU cores shared with other jobs a
step waits for a core as often as it computes, and its A/A pair moved from 0.93x to 1.35x
between two runs. Here each block's cost is the CPU time this process spent in it
(``time.process_time``: every thread of the process, ampdoctor's included, and nothing of any
other process), so waiting for a core adds nothing. The model is ``overhead.py``'s reference
GPT trained in its ``clip`` loop (bf16 autocast where the CPU has bf16, else fp32 compute, as
``overhead.py`` decides), compiled with inductor (the wrapper trained, watched and called).

**Method.** After warm-up (the compile, and one recorded block so that every recompile the
recorder could cause has happened, and is counted), each round runs three blocks in a rotating
order: ``plain``, ``plain-again`` (the A/A pair) and ``ampdoctor`` (the default recorder,
``watch()`` entered for the block). A block is ``--settle`` untimed steps (the recorder's first
step samples: costed apart below), then ``--steps`` timed ones. A round's ratio is a block's
CPU seconds per step over its round's ``plain`` block; the figure is the median over rounds,
with the A/A median beside it: the A/A's distance from 1.00 is the measure's floor. The
default recorder's sampled step (every ``DEFAULT_EVERY`` steps) is costed as ``overhead.py``
does: ``--every 1`` blocks' median step over the plain one, amortized over the interval:
``always-on = steady + (sampled - steady) / DEFAULT_EVERY``. Dynamo's compile counters are read
around the timed rounds: a recorder that recompiled or broke the graph would show there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from typing import Callable

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import overhead  # noqa: E402

from ampdoctor.record import recorder  # noqa: E402


def block(w: overhead.Workload, ctx: Callable, steps: int, settle: int, i: int) -> tuple:
    """CPU seconds per step of ``steps`` steps under ``ctx()``, after ``settle`` untimed."""
    with ctx():
        for _ in range(settle):
            w.step(i)
            i += 1
        began = time.process_time()
        for _ in range(steps):
            w.step(i)
            i += 1
        spent = time.process_time() - began
    return spent / steps, i


def compiles() -> dict:
    """Dynamo's counters: frames compiled, graph breaks, recompiles."""
    from torch._dynamo.utils import counters
    return {"frames": int(sum(counters["frames"].values())),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "recompiles": int(counters["recompiles"].get("total", 0)
                              if "recompiles" in counters else 0)}


def measure(args: argparse.Namespace) -> dict:
    overhead.COMPILE = not args.eager
    native = overhead.native_dtypes(overhead.gemm_probe())
    w = overhead.make_workload("gpt", overhead.CONFIGS["clip"], native)
    with tempfile.TemporaryDirectory() as tmp:
        def recorded(every: int) -> Callable:
            path = os.path.join(tmp, f"every{every}.h5")
            return lambda: recorder.Recorder(w.model, w.opt, w.scaler, path=path,
                                             every=every).start()
        modes = {"plain": contextlib.nullcontext, "plain-again": contextlib.nullcontext,
                 "ampdoctor": recorded(recorder.DEFAULT_EVERY)}
        i = 0
        for _ in range(args.warmup):
            w.step(i)
            i += 1
        _, i = block(w, modes["ampdoctor"], args.steps, args.settle, i)  # its compiles, if any
        before = compiles()
        per_step: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(args.rounds):
            names = list(modes)
            for name in names[r % 3:] + names[:r % 3]:
                seconds, i = block(w, modes[name], args.steps, args.settle, i)
                per_step[name].append(seconds)
        after = compiles()
        sampled = []
        for _ in range(max(1, args.rounds // 4)):  # --every 1: every step samples
            s, i = block(w, recorded(1), args.steps, args.settle, i)
            p, i = block(w, modes["plain"], args.steps, args.settle, i)
            sampled.append(s / p)
    plain = np.array(per_step["plain"])
    ratio = {m: float(np.median(np.array(v) / plain)) for m, v in per_step.items()}
    spread = {m: [float(x) for x in np.percentile(np.array(v) / plain, [25, 75])]
              for m, v in per_step.items()}
    steady, sampled_ratio = ratio["ampdoctor"], float(np.median(sampled))
    always_on = steady + (sampled_ratio - steady) / recorder.DEFAULT_EVERY
    return {"model": "reference GPT (overhead.py gpt), clip loop",
            "compiled": not args.eager, "autocast": str(w.autocast),
            "threads": torch.get_num_threads(), "rounds": args.rounds, "steps": args.steps,
            "plain_ms_cpu": round(float(np.median(plain)) * 1e3, 2),
            "aa": round(ratio["plain-again"], 4), "aa_iqr": spread["plain-again"],
            "steady": round(steady, 4), "steady_iqr": spread["ampdoctor"],
            "sampled_step": round(sampled_ratio, 3), "every": recorder.DEFAULT_EVERY,
            "always_on": round(always_on, 4),
            "dynamo_during_rounds": {k: after[k] - before[k] for k in after},
            "load": [round(x, 2) for x in os.getloadavg()]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per block")
    parser.add_argument("--settle", type=int, default=2, help="untimed steps per block")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--eager", action="store_true", help="the model not compiled")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = measure(args)
    print(f"{'compiled' if out['compiled'] else 'eager'} {out['model']}, {out['autocast']}, "
          f"{out['threads']} thread(s), {out['rounds']} rounds x {out['steps']} steps, "
          f"load {out['load']}")
    print(f"  plain step {out['plain_ms_cpu']} ms CPU; A/A {out['aa']:.3f}x "
          f"(IQR {out['aa_iqr'][0]:.3f}-{out['aa_iqr'][1]:.3f})")
    print(f"  ampdoctor steady {out['steady']:.3f}x (IQR {out['steady_iqr'][0]:.3f}-"
          f"{out['steady_iqr'][1]:.3f}), sampled step {out['sampled_step']:.2f}x, "
          f"always-on at every={out['every']}: {out['always_on']:.3f}x")
    print(f"  dynamo during the rounds: {out['dynamo_during_rounds']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
