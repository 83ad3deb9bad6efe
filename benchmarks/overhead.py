"""Recording overhead, measured side by side in one process: step-time ratios against plain.

    python benchmarks/overhead.py                     # reference GPT + conv net, table
    python benchmarks/overhead.py --json out.json     # also machine-readable
    python benchmarks/overhead.py --curve             # overhead vs sampling interval
    python benchmarks/overhead.py --memory            # peak RSS and file growth (subprocesses)

Method (``shared/notes/overhead-measurements.md``): the machine is noisy (an A/A test moves
+-3% in median step time), so the modes run interleaved in rounds on the same model, each
round timing ``--steps`` steady steps per mode after warm-up. A round's *steady* figure for a
mode is the 5th percentile of its step times that did not run the sampled tier (noise only
ever adds time), over the round's plain figure; the median over rounds is reported. Sampled
steps are costed apart: the median, over all of them, of each one's time over its round's
plain median (medians on both sides, as noise hits both). The *ratio* is what a long run pays
on average at interval N: ``steady + (sampled step - steady) / N``. ``plain-again`` (an A/A
pair) shows the floor.

Models: the reference GPT of issue 6 (4 layers, width 256, sequence 64, batch 8, bf16 autocast,
AdamW, clipping) and a small conv net (BatchNorm, ReLU in place). CPU, ``--threads`` threads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import ampdoctor  # noqa: E402
from ampdoctor import recorder  # noqa: E402


# ---------------------------------------------------------------------------------------------
# models


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.out = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)
        self.heads = heads

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads) \
            .permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.out(self.act(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """The reference model: 4 layers, width 256, sequence 64."""

    def __init__(self, vocab=512, dim=256, layers=4, heads=4, ctx=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(ctx, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        layers = []
        chans = [3, 32, 64, 64]
        for a, b in zip(chans, chans[1:]):
            layers += [nn.Conv2d(a, b, 3, padding=1), nn.BatchNorm2d(b), nn.ReLU(inplace=True)]
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


DEVICE = torch.device("cpu")
DTYPE = torch.bfloat16


def make_workload(name: str, seed: int = 0):
    """(model, optimizer, batch function, loss function) for a named workload."""
    torch.manual_seed(seed)
    model, opt, batch, loss_fn = _make_workload(name, seed)
    if DEVICE.type != "cpu":
        model.to(DEVICE)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        cpu_batch = batch

        def batch(i):
            return tuple(t.to(DEVICE, non_blocking=True) for t in cpu_batch(i))
    return model, opt, batch, loss_fn


def _make_workload(name: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    if name == "gpt":
        model = GPT()
        data = torch.randint(0, 512, (16, 8, 65), generator=g)

        def batch(i):
            b = data[i % len(data)]
            return b[:, :-1], b[:, 1:]

        def loss_fn(out, y):
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    else:
        model = ConvNet()
        data = torch.randn(16, 16, 3, 32, 32, generator=g)
        labels = torch.randint(0, 10, (16, 16), generator=g)

        def batch(i):
            return data[i % 16], labels[i % 16]

        loss_fn = F.cross_entropy
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, batch, loss_fn


def step(model, opt, batch, loss_fn, i):
    """One training step as users write it; on a GPU, it ends with the loss on the host
    (a logging ``loss.item()``), so that per-step times are real."""
    x, y = batch(i)
    with torch.autocast(DEVICE.type, dtype=DTYPE):
        loss = loss_fn(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if DEVICE.type != "cpu":
        loss.item()


# ---------------------------------------------------------------------------------------------
# modes: each a context manager factory around a block of steps


def mode_contexts(model, opt, tmp: str, curve: list[int] | None = None):
    """Mode name -> (context factory, sampled-tier interval or None, run file or None)."""
    def plain():
        return contextlib.nullcontext()

    def ampdoctor_every(n):
        path = os.path.join(tmp, f"every{n}.h5")

        def ctx():
            return recorder.Recorder(model, opt, path=path, every=n).start()
        return ctx, n, path

    modes = {"plain": (plain, None, None), "plain-again": (plain, None, None)}
    if curve:
        for n in curve:
            modes[f"every={n}"] = ampdoctor_every(n)
        return modes
    modes["ampdoctor"] = ampdoctor_every(recorder.DEFAULT_EVERY)
    modes["ampdoctor --every 1"] = ampdoctor_every(1)
    modes["detect_anomaly"] = (lambda: torch.autograd.detect_anomaly(check_nan=True), None, None)
    return modes


def hf_detector(model):
    """transformers' DebugUnderflowOverflow on its own copy of the model (its hooks are
    permanent), or None when transformers is not installed."""
    try:
        from transformers.debug_utils import DebugUnderflowOverflow
    except Exception:  # noqa: BLE001 - optional: the `bench` extra
        return None
    import copy

    twin = copy.deepcopy(model)
    DebugUnderflowOverflow(twin)
    return twin


def _sampled_flags(path: str, first: int, count: int) -> np.ndarray:
    """Which of the recorded steps ``first .. first+count-1`` ran the sampled tier."""
    steps = ampdoctor.load(path).steps
    by_index = dict(zip(steps["step"].tolist(), steps["sampled"].tolist()))
    return np.array([bool(by_index.get(first + k, 0)) for k in range(count)])


def measure(workload: str, rounds: int, steps: int, warmup: int, curve=None) -> dict:
    """Interleaved rounds; per mode a steady ratio (5th percentile of the steps that did not
    sample, over the round's plain 5th percentile), a sampled-step ratio (median of the sampled
    steps, pooled over rounds) and the amortized ratio a long run pays at interval N:
    ``steady + (sampled - steady) / N``. A sampled step costs the same whatever N is (the
    module hooks are installed for that step alone), so where a mode's window holds too few
    sampled steps (N > steps per round) the ``--every 1`` mode's sampled steps stand in."""
    model, opt, batch, loss_fn = make_workload(workload)
    settle = 2  # first steps of a block build hooks and caches; untimed
    with tempfile.TemporaryDirectory() as tmp:
        modes = mode_contexts(model, opt, tmp, curve)
        twin = None if curve else hf_detector(model)
        twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-4) if twin is not None else None
        if twin is not None:
            modes["transformers DebugUnderflowOverflow"] = (contextlib.nullcontext, None, None)
        steady: dict[str, list[float]] = {m: [] for m in modes}  # seconds, per round
        sampled: dict[str, list[float]] = {m: [] for m in modes}  # ratios to plain, per step
        plain_median = []
        i = 0
        for _ in range(warmup):
            step(model, opt, batch, loss_fn, i)
            i += 1
        for r in range(rounds):
            order = list(modes)
            if r % 2:
                order.reverse()  # no mode always runs right after the same other mode
            round_sampled: dict[str, np.ndarray] = {}
            for name in order:
                factory, every, path = modes[name]
                m, o = (twin, twin_opt) if name.startswith("transformers") else (model, opt)
                per_step = []
                with factory():
                    for _ in range(settle):
                        step(m, o, batch, loss_fn, i)
                        i += 1
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        step(m, o, batch, loss_fn, i)
                        per_step.append(time.perf_counter() - t0)
                        i += 1
                per_step = np.array(per_step)
                flags = (_sampled_flags(path, settle, steps) if path
                         else np.zeros(steps, dtype=bool))
                calm = per_step[~flags] if (~flags).sum() >= 5 else per_step
                steady[name].append(float(np.percentile(calm, 5)))
                round_sampled[name] = per_step[flags]
                if name == "plain":
                    plain_median.append(float(np.median(per_step)))
            for name, times in round_sampled.items():
                sampled[name].extend((times / plain_median[-1]).tolist())
    plain = np.array(steady["plain"])
    every_step = [name for name, (_, every, _) in modes.items() if every == 1]
    reference = float(np.median(sampled[every_step[0]])) if every_step else None
    out = {"workload": workload, "rounds": rounds, "steps_per_round": steps,
           "plain_p5_ms": round(float(np.median(plain)) * 1e3, 2), "modes": {}}
    for name, series in steady.items():
        ratios = np.array(series) / plain
        floor = float(np.median(ratios))
        every = modes[name][1]
        row = {"steady": round(floor, 4), "steady_min": round(float(ratios.min()), 4),
               "steady_max": round(float(ratios.max()), 4),
               "steady_ms": round(float(np.median(series)) * 1e3, 2), "every": every}
        ratio = floor
        if every:
            own = len(sampled[name]) >= 3
            cost = float(np.median(sampled[name])) if own else reference
            row.update(sampled_step=round(cost, 4), sampled_from="own" if own else "every=1")
            ratio = floor + (cost - floor) / every if every > 1 else cost
        row["ratio"] = round(ratio, 4)
        out["modes"][name] = row
    return out


# ---------------------------------------------------------------------------------------------
# memory and file size: separate processes (peak RSS only ever grows within a process)


def _memory_child(mode: str, workload: str, steps: int, path: str) -> None:
    import resource

    model, opt, batch, loss_fn = make_workload(workload)
    ctx = contextlib.nullcontext() if mode == "plain" else recorder.Recorder(
        model, opt, path=path).start()
    with ctx:
        for i in range(steps):
            step(model, opt, batch, loss_fn, i)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if DEVICE.type == "cuda":
        peak = torch.cuda.max_memory_allocated(DEVICE)  # the allocator's peak, not RSS
    print(json.dumps({"peak_rss": peak,
                      "file_bytes": os.path.getsize(path) if os.path.exists(path) else 0}))


def memory(workload: str, steps: int, pairs: int) -> dict:
    rss = {"plain": [], "ampdoctor": []}
    size = []
    with tempfile.TemporaryDirectory() as tmp:
        for p in range(pairs):
            for mode in ("plain", "ampdoctor") if p % 2 == 0 else ("ampdoctor", "plain"):
                path = os.path.join(tmp, f"{mode}{p}.h5")
                out = subprocess.run(
                    [sys.executable, __file__, "--memory-child", mode, "--workload", workload,
                     "--steps", str(steps), "--path", path, "--device", str(DEVICE),
                     "--dtype", str(DTYPE).replace("torch.", "")],
                    capture_output=True, text=True, check=True)
                res = json.loads(out.stdout.strip().splitlines()[-1])
                rss[mode].append(res["peak_rss"])
                if mode == "ampdoctor":
                    size.append(res["file_bytes"])
    ratio = float(np.median(np.array(rss["ampdoctor"]) / np.array(rss["plain"])))
    return {"workload": workload, "steps": steps, "pairs": pairs,
            "peak_memory": "CUDA allocator peak" if DEVICE.type == "cuda" else "peak RSS",
            "peak_plain_mb": round(float(np.median(rss["plain"])) / 2**20, 1),
            "peak_ratio": round(ratio, 4),
            "file_bytes_per_step": round(float(np.median(size)) / steps, 1)}


# ---------------------------------------------------------------------------------------------


def table(result: dict) -> str:
    lines = [f"{result['workload']}: plain step {result['plain_p5_ms']} ms (5th pct), "
             f"{result['rounds']} rounds x {result['steps_per_round']} steps",
             f"  {'mode':<36} {'ratio':>7}  {'steady':>7} {'steady range':>15}  "
             f"{'sampled step':>12}"]
    for name, m in result["modes"].items():
        if name == "plain":
            continue
        cost = (f"{m['sampled_step']:>11.3f}x" + (" (every=1)" if m["sampled_from"] != "own"
                                                  else "")) if m["every"] else ""
        lines.append(f"  {name:<36} {m['ratio']:>6.3f}x  {m['steady']:>6.3f}x "
                     f"[{m['steady_min']:.3f}, {m['steady_max']:.3f}]  {cost}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["gpt", "conv", "all"], default="all")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--curve", action="store_true", help="overhead vs sampling interval")
    parser.add_argument("--memory", action="store_true", help="peak RSS and file growth")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global DEVICE, DTYPE
    DEVICE, DTYPE = torch.device(args.device), getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    workloads = ["gpt", "conv"] if args.workload == "all" else [args.workload]
    if args.memory_child:
        return _memory_child(args.memory_child, workloads[0], args.steps, args.path)
    results = []
    for w in workloads:
        if args.memory:
            res = memory(w, max(args.steps, 200), args.pairs)
            print(json.dumps(res))
        else:
            curve = [1, 2, 5, 10, 20, 50, 100, 200, 1000] if args.curve else None
            res = measure(w, args.rounds, args.steps, args.warmup, curve)
            print(table(res), flush=True)
        results.append(res)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"torch": torch.__version__, "threads": args.threads,
                       "device": str(DEVICE), "dtype": args.dtype,
                       "default_every": recorder.DEFAULT_EVERY, "results": results}, fh,
                      indent=2)


if __name__ == "__main__":
    main()
