"""The fp8 path on a GPU with fp8 matmuls (an H100): a tiny run recorded in bf16 and again with
its Linears in torchao's fp8 (real fp8 matmuls, not emulated), diagnosed against each other,
and the bf16 run's fp8 readiness and early warning printed.

    python benchmarks/fp8_gpu.py --device cuda [--out DIR]    # what gpu_check.sh runs
    python benchmarks/fp8_gpu.py --device cpu --steps 12       # the same paths, emulated

The model is an MLP (256 -> 1024 -> 1024 -> 64, sizes multiples of 16 as fp8 matmuls need)
whose hidden channel 7 grows to 300x the others over the run, as in
``fixtures/fp8/outlier_growing.py``. Both runs go through ``ampdoctor record`` (the second with
``--apply fp8=tensorwise``, which converts with ``emulate=False`` on compute capability 8.9 and
up); the script then checks that the fp8 run's Linears were converted and not emulated
(``/meta applied``), prints ``diagnose fp8.h5 --baseline bf16.h5``'s verdict, ``compare``'s,
each recipe's layers to keep in bf16 (``fp8_readiness``) and the Linears at risk
(``diagnosis.fp8watch``), and writes them to ``OUT/fp8.json``. On a GPU without fp8 matmuls,
or without torchao, it says so in one sentence and exits 0. Exit 1 when a step fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FP8_CAPABILITY = (8, 9)  # torch._scaled_mm and torchao's float8 training: Ada, Hopper and up


def train(device: str, steps: int) -> None:
    """The training the two recordings run (``--train``): bf16 autocast on CUDA, fp32 on CPU."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(),
                                torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 64)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gain = torch.ones(1024, device=device)
    data = torch.randn(4096, 256, device=device)
    labels = (data @ torch.randn(256, 64, device=device)).argmax(1)
    growth = 300.0 ** (1 / max(steps - 1, 1))
    hidden = model[1]
    hidden.register_forward_hook(lambda m, i, out: out * gain)  # channel 7: the outlier
    for step in range(steps):
        gain[7] = growth ** step
        idx = torch.randint(0, len(data), (256,), device=device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = F.cross_entropy(model(data[idx]), labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"final loss {loss.item():.4f}")


def skip_reason(device: str) -> str:
    """One sentence where this machine cannot run the fp8 path as meant; "" where it can."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        return "fp8 path skipped: torchao is not installed (pip install 'ampdoctor[fp8]')."
    if device != "cuda":
        return ""
    import torch

    if not torch.cuda.is_available():
        return "fp8 path skipped: no CUDA device (--device cpu runs the same paths, emulated)."
    cap = torch.cuda.get_device_capability()
    if cap < FP8_CAPABILITY:
        return (f"fp8 path skipped: {torch.cuda.get_device_name()} (compute capability "
                f"{cap[0]}.{cap[1]}) has no fp8 matmuls; they start at 8.9 (Ada, Hopper).")
    return ""


def record(out: str, name: str, device: str, steps: int, *apply: str) -> str:
    path = os.path.join(out, f"{name}.h5")
    cmd = [sys.executable, "-m", "ampdoctor", "record", "-o", path, "--every", "5", "--force",
           "--fp8-trial", "10", *(a for x in apply for a in ("--apply", x)), "--", sys.executable,
           os.path.abspath(__file__), "--train", "--device", device, "--steps", str(steps)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    sys.stdout.write(proc.stderr[-2000:])
    if proc.returncode != 0:
        raise SystemExit(f"fp8_gpu: recording {name} failed (exit {proc.returncode})")
    return path


def check(base: str, fp8: str, device: str) -> dict:
    import ampdoctor
    from ampdoctor.diagnosis import fp8watch

    with ampdoctor.load(fp8) as run:
        applied = (run.meta.get("applied") or [{}])[0]
        layers = run.fp8_layers
    emulated = applied.get("emulated")
    print(f"fp8 run: converted {applied.get('converted')}, emulated {emulated}, "
          f"{len(layers)} layers recorded in fp8")
    if not applied.get("converted") or (device == "cuda" and emulated is not False):
        raise SystemExit("fp8_gpu: the fp8 run's Linears were not converted to real fp8")
    d = ampdoctor.diagnose(fp8, baseline=base)
    c = ampdoctor.compare(base, fp8)
    r = ampdoctor.fp8_readiness(base)
    with ampdoctor.load(base) as run:
        w = fp8watch.read(run)
    print(f"diagnose fp8.h5 --baseline bf16.h5: {d.verdict}: {d.summary}")
    print(f"compare bf16.h5 fp8.h5: {c.verdict}: {c.summary}")
    for name, recipe in r.recipes.items():
        print(f"readiness {name:<10} decided by {recipe.decided_by:<10} keep in bf16: "
              f"{recipe.keep_high_precision}")
    print(f"the recipe that suits: {r.suits or '(none found)'}")
    print("early warning: " + ("; ".join(f"{x.name} from step {x.first_warned} ({x.why()})"
                                         for x in w.at_risk) or "no Linear at risk"))
    return {"applied": applied, "verdict": d.verdict, "compare": c.verdict,
            "readiness": r.to_dict(), "watch": w.to_dict()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="gpu_check_out")
    parser.add_argument("--train", action="store_true", help="the recorded training itself")
    args = parser.parse_args()
    if args.train:
        train(args.device, args.steps)
        return 0
    why = skip_reason(args.device)
    if why:
        print(why)
        return 0
    os.makedirs(args.out, exist_ok=True)
    base = record(args.out, "bf16", args.device, args.steps)
    fp8 = record(args.out, "fp8", args.device, args.steps, "fp8=tensorwise")
    found = check(base, fp8, args.device)
    with open(os.path.join(args.out, "fp8.json"), "w") as f:
        json.dump(found, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
