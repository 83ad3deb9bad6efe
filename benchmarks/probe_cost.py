"""What the sampled step's op probe costs: a sampled step with and without it, side by side.

    OMP_NUM_THREADS=1 python benchmarks/probe_cost.py                 # reference GPT, ~2 min
    python benchmarks/probe_cost.py --rounds 9 --steps 20 --device cuda
    python benchmarks/probe_cost.py --smoke                           # seconds: the paths only

The op probe (``record/opprobe.StepProbe``, issue 23) runs only on sampled steps: a
``TorchFunctionMode`` over the root module's forward that takes one ``aminmax`` of every
floating tensor an op returns (no host read until the step's end) and reads them all at the
drain. It adds Python per op and one reduction per result; this measures what that is on the
reference GPT (4 layers, width 256, sequence 64, batch 8, AdamW) in fp32 compute (the CPU
emulates fp16, which would dwarf and flatter the cost; ``docs/performance.md``).

Three modes, interleaved in rounds on the same model: ``plain`` (no recorder), ``sampled``
(``watch(every=1, op_probe=False)``: every step a sampled step, as before issue 23) and
``probed`` (``watch(every=1)``, the default). Each round times ``--steps`` steps per mode
after a warm-up; a mode's figure is the median over rounds of its median step time. Printed:
both ratios to ``plain``, the probe's own ratio ``probed / sampled`` (a sampled step's cost
with the probe against without it), and what it adds at the default interval, 100:
``(probed - sampled) / plain / 100``. The ops probed per forward are counted once.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ampdoctor  # noqa: E402
from ampdoctor.record import opprobe  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.act = nn.GELU()

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads) \
            .permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(self.act(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=512, dim=256, layers=4, heads=4, ctx=64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(ctx, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


def step(model, opt, idx, device):
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=False):  # fp32 compute
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed(model, opt, data, device, steps: int) -> float:
    """Median step time (s) over ``steps`` steps; CUDA steps are synchronised at the end of
    each step, after the recorder's own work."""
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        step(model, opt, data[i % len(data)], device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def mode_time(mode: str, model, opt, data, device, steps: int, path: str) -> float:
    if mode == "plain":
        return timed(model, opt, data, device, steps)
    rec = ampdoctor.watch(model, opt, path=path, every=1, op_probe=(mode == "probed"),
                          forensics=False)
    with rec:
        step(model, opt, data[0], device)  # the first step: discovery, metadata
        return timed(model, opt, data, device, steps)


def ops_per_forward(model, idx) -> int:
    """Floating results the probe measures in one forward."""
    probe = opprobe.StepProbe()
    probe.open_call(model, "GPT")
    probe.enter(model, "GPT")
    try:
        model(idx[:, :-1])
    finally:
        probe.leave(model)
    count = len(probe._lo)
    probe.reset()
    return count


def reference(doc: str) -> tuple:
    """The command line both this benchmark and ``fp8_cost.py`` take, and the reference GPT
    they time, warmed up: (device, rounds, steps, model, opt, data)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 2 rounds")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    dims = dict(vocab=512, dim=32, layers=2, heads=2, ctx=16) if args.smoke else {}
    rounds, steps = (2, 3) if args.smoke else (args.rounds, args.steps)
    model = GPT(**dims).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ctx = model.pos.num_embeddings
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 512, (8, ctx + 1), generator=g).to(device) for _ in range(8)]
    for _ in range(3):
        step(model, opt, data[0], device)  # warm-up
    return device, rounds, steps, model, opt, data


def main() -> None:
    device, rounds, steps, model, opt, data = reference(__doc__ or "")
    results: dict[str, list[float]] = {"plain": [], "sampled": [], "probed": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for mode in results:
                results[mode].append(mode_time(mode, model, opt, data, device, steps,
                                               os.path.join(tmp, f"{mode}{r}.h5")))
    med = {m: statistics.median(v) for m, v in results.items()}
    ops = ops_per_forward(model, data[0])
    print(f"torch {torch.__version__}, {device}, threads {torch.get_num_threads()}, "
          f"{rounds} rounds x {steps} steps, {ops} results probed per forward")
    print(f"plain step           {med['plain'] * 1e3:8.2f} ms")
    print(f"sampled step         {med['sampled'] * 1e3:8.2f} ms  "
          f"{med['sampled'] / med['plain']:.3f}x plain")
    print(f"sampled + op probe   {med['probed'] * 1e3:8.2f} ms  "
          f"{med['probed'] / med['plain']:.3f}x plain")
    print(f"op probe on a sampled step: {med['probed'] / med['sampled']:.3f}x "
          f"(+{(med['probed'] - med['sampled']) * 1e3:.2f} ms, "
          f"{(med['probed'] - med['sampled']) / max(ops, 1) * 1e6:.1f} us per result)")
    print(f"at the default interval (100): "
          f"+{(med['probed'] - med['sampled']) / med['plain'] / 100:.3%} of a step")


if __name__ == "__main__":
    main()
