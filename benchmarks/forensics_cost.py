"""What the forensic tier costs: capture on every step, and one replay on an event.

    OMP_NUM_THREADS=2 python benchmarks/forensics_cost.py            # ~5 min on 2 CPU cores
    python benchmarks/forensics_cost.py --steps 200 --pairs 6 --device cuda

1. **Capture, absolute.** A one-layer model whose step takes a fraction of a millisecond,
   recorded with ``watch(every=0, forensics=False)`` and ``forensics=True`` in alternating
   blocks: the difference of the median step times is what capturing adds to every step
   (microseconds: Python hooks on the root module and the loss, references, an RNG state).
2. **Capture, relative.** The same on a bf16 GPT-style model, interleaved in pairs; the
   figure is the median over pairs of the ratio of the 5th-percentile step times
   (``shared/notes/overhead-measurements.md``: noise only ever adds time). An A/A pair
   (forensics off twice) gives the noise floor. Without a GradScaler the tier also makes one
   host sync per step (finiteness of loss and grad norm before ``optimizer.step``), which
   costs nothing on a CPU and is part of what a GPU run measures.
3. **Replay (on an event).** A layer's output overflows bf16 at one step; the replay's wall
   time is printed as a multiple of the median step time.
4. **The replay's isolation** (``--isolation ROUNDS``, alone): the same replay with
   ``isolated.preserved`` as it is (the user's hooks set aside, Python state put back, output
   held back, writes refused) against a bare one that only forks the RNG and puts the buffers
   back, alternating in one process; the ratio of the medians is what isolation costs a
   replay.

    OMP_NUM_THREADS=1 python benchmarks/forensics_cost.py --isolation 4
"""

from __future__ import annotations

import argparse
import contextlib
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
from ampdoctor.record.forensic import forensics, isolated  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=256, dim=256, heads=4, layers=4, ctx=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(ctx, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        t = idx.shape[1]
        mask = torch.full((t, t), float("-inf"), device=idx.device).triu(1)
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


def run(steps: int, forensics: bool, device: str, bad_step: int = -1) -> tuple[list, float]:
    """Step times of one recorded run (and the replay's time when bad_step is hit)."""
    torch.manual_seed(0)
    model = GPT(dim=128, layers=2).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randint(0, 256, (steps, 8, 65), generator=torch.Generator().manual_seed(1))
    times, replay = [], float("nan")
    with tempfile.TemporaryDirectory() as tmp:
        with ampdoctor.watch(model, opt, path=os.path.join(tmp, "run.h5"), every=0,
                             forensics=forensics) as rec:
            for i in range(steps):
                batch = data[i].to(device)
                x, y = batch[:, :-1], batch[:, 1:]
                if i == bad_step:
                    with torch.no_grad():  # the head's output overflows bf16 on this step
                        model.ln.weight.mul_(1e3)
                        model.head.weight.mul_(1e36)
                t0 = time.perf_counter()
                with torch.autocast(device, dtype=torch.bfloat16):
                    logits = model(x)
                    loss = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
                loss.backward()
                t1 = time.perf_counter()
                opt.step()  # a replay runs here, in the optimizer's pre-step hook
                t2 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                if device == "cuda":
                    torch.cuda.synchronize()
                t3 = time.perf_counter()
                if i == bad_step:  # the NaN reached the weights: nothing after is timed
                    replay = t2 - t1
                    assert rec.events and rec.events[0].module == "head", rec.events
                    break
                times.append(t3 - t0)
    return times, replay


def tiny(steps: int, forensics: bool, device: str) -> list:
    """Step times of a model so small that the recorder's own per-step work shows."""
    torch.manual_seed(0)
    model = nn.Linear(16, 16).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 16, device=device)
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        with ampdoctor.watch(model, opt, path=os.path.join(tmp, "run.h5"), every=0,
                             forensics=forensics, flush_seconds=1e9):
            for _ in range(steps):
                t0 = time.perf_counter()
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
    return times


def isolation(rounds: int, device: str) -> None:
    """Section 4 of the module docstring."""
    full = isolated.preserved

    @contextlib.contextmanager
    def bare(roots: list, devices: list):
        saved = isolated.saved_buffers([m for r in roots for m in r.modules()])
        with torch.random.fork_rng(devices=devices):
            try:
                yield isolated.Isolation()
            finally:
                isolated.restore_buffers(saved)

    out: dict = {"isolated": [], "bare": []}
    try:
        for i in range(rounds):
            order = (("bare", bare), ("isolated", full))
            for name, impl in order if i % 2 else order[::-1]:
                forensics.preserved = impl
                out[name].append(run(12, True, device, bad_step=8)[1])
    finally:
        forensics.preserved = full
    for name, times in out.items():
        print(f"replay, {name}: median {statistics.median(times) * 1e3:.0f} ms "
              f"({', '.join(f'{t * 1e3:.0f}' for t in times)})")
    print(f"isolation: {statistics.median(out['isolated']) / statistics.median(out['bare']):.2f}x "
          "the bare replay's time")


def p5(times: list, warmup: int) -> float:
    steady = sorted(times[warmup:])
    return steady[max(0, len(steady) // 20)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--isolation", type=int, default=0, metavar="ROUNDS",
                        help="only measure what the replay's isolation costs (section 4)")
    args = parser.parse_args()
    if args.isolation:
        return isolation(args.isolation, args.device)
    warmup = min(20, args.steps // 4)
    diffs = []
    for _ in range(5):
        off = statistics.median(tiny(2000, False, args.device)[200:])
        with_capture = statistics.median(tiny(2000, True, args.device)[200:])
        diffs.append(with_capture - off)
    print(f"capture, absolute: {statistics.median(diffs) * 1e6:.1f} us per step "
          f"(blocks: {', '.join(f'{d * 1e6:.1f}' for d in diffs)})")
    on, aa = [], []
    for _ in range(args.pairs):
        off = p5(run(args.steps, False, args.device)[0], warmup)
        with_capture = p5(run(args.steps, True, args.device)[0], warmup)
        off2 = p5(run(args.steps, False, args.device)[0], warmup)
        on.append(with_capture / off)
        aa.append(off2 / off)
    print(f"capture every step: {statistics.median(on):.3f}x step time "
          f"(pairs: {', '.join(f'{r:.3f}' for r in on)})")
    print(f"A/A noise floor:    {statistics.median(aa):.3f}x "
          f"(pairs: {', '.join(f'{r:.3f}' for r in aa)})")
    times, replay = run(30, True, args.device, bad_step=25)
    step = statistics.median(times[5:])
    print(f"one replay: {replay * 1e3:.0f} ms = {replay / step:.1f}x the median step "
          f"({step * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
