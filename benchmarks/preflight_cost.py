"""What the tools that act before a run cost: ``ampdoctor.parity`` and ``check_amp_step``.

    OMP_NUM_THREADS=2 python benchmarks/preflight_cost.py               # a few minutes
    python benchmarks/preflight_cost.py --width 256 --layers 4 --device cuda --json out.json

1. **parity**, on docs/before-a-long-run.md's example language model (``fixtures/examples/layer_parity.py``,
   widened with ``--width``/``--layers``), in bf16: its wall time as a multiple of what the
   same work costs the model itself, one fp32 forward plus one autocast forward (without a
   loss) or one fp32 and one autocast forward and backward (with ``loss_fn``). The design says
   three forwards, or four forwards and three backwards.
2. **check_amp_step**, on a correct fp16 + GradScaler step of the same model: its wall time as
   a multiple of two plain calls of the step (it calls the step twice, inside a recorder that
   writes a temporary file).

Rounds are interleaved (reference, tool, reference again as an A/A pair) and the figures are
medians over rounds of per-round ratios; on a shared machine noise only ever adds time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "fixtures", "examples"))

import layer_parity as example  # noqa: E402

import ampdoctor  # noqa: E402
from ampdoctor.testing import check_amp_step  # noqa: E402


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def build(width: int, layers: int, device: str):
    example.WIDTH = width
    torch.manual_seed(0)
    model = example.TinyLM(layers).to(device)
    ids = torch.randint(0, example.VOCAB, (8, example.CONTEXT), device=device)

    def loss_fn(logits):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    return model, ids, loss_fn


def parity_rounds(model, ids, loss_fn, device: str, rounds: int, with_loss: bool) -> dict:
    dev = torch.device(device).type

    def plain():
        for low in (False, True):
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=low):
                out = model(ids)
                if with_loss:
                    loss_fn(out).backward()
        model.zero_grad(set_to_none=True)

    def tool():
        ampdoctor.parity(model, ids, torch.bfloat16, loss_fn if with_loss else None)

    plain(), tool()  # warm-up
    ratios, aa = [], []
    for _ in range(rounds):
        a, t, b = timed(plain), timed(tool), timed(plain)
        ratios.append(t / a)
        aa.append(b / a)
    return {"ratio": statistics.median(ratios), "aa": statistics.median(aa),
            "plain_s": a, "tool_s": t}


def step_rounds(model, ids, loss_fn, device: str, rounds: int) -> dict:
    dev = torch.device(device).type
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(dev)

    def train_step(model, opt, scaler, ids):
        with torch.autocast(dev, dtype=torch.float16):
            loss = loss_fn(model(ids))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    state = {k: v.clone() for k, v in model.state_dict().items()}

    def plain():
        for _ in range(2):
            train_step(model, opt, scaler, ids)
        model.load_state_dict(state)

    def tool():
        check_amp_step(train_step, model, opt, scaler, ids)

    plain(), tool()
    ratios, aa = [], []
    for _ in range(rounds):
        a, t, b = timed(plain), timed(tool), timed(plain)
        ratios.append(t / a)
        aa.append(b / a)
    return {"ratio": statistics.median(ratios), "aa": statistics.median(aa),
            "plain_s": a, "tool_s": t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    model, ids, loss_fn = build(args.width, args.layers, args.device)
    result = {"width": args.width, "layers": args.layers, "device": args.device,
              "threads": torch.get_num_threads(),
              "parity_forward": parity_rounds(model, ids, loss_fn, args.device, args.rounds,
                                              False),
              "parity_with_loss": parity_rounds(model, ids, loss_fn, args.device, args.rounds,
                                                True),
              "check_amp_step": step_rounds(model, ids, loss_fn, args.device, args.rounds)}
    for name in ("parity_forward", "parity_with_loss", "check_amp_step"):
        r = result[name]
        print(f"{name:18} {r['ratio']:.2f}x its reference (A/A {r['aa']:.2f}x; "
              f"{r['tool_s'] * 1e3:.0f} ms against {r['plain_s'] * 1e3:.0f} ms)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
