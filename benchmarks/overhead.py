"""Recording overhead as users train: step time and memory, side by side with the same loop.

    python benchmarks/overhead.py                        # the 5 configurations, reference GPT
    python benchmarks/overhead.py --memory               # between steps and at peak, large vocab
    python benchmarks/overhead.py --modes all --config clip --workload conv   # + --every 1 ...
    python benchmarks/overhead.py --curve                # overhead vs sampling interval
    python benchmarks/overhead.py --device cuda --workload gpt2   # on a GPU
    python benchmarks/overhead.py --json out.json        # also machine-readable
    python benchmarks/overhead.py --compile --config clip    # the model under torch.compile
    python benchmarks/compiled_overhead.py   # the same, by process CPU time: a loaded machine

**Configurations** (``--config``, default all), the loops users run:

    scaler       fp16 autocast, GradScaler, AdamW (foreach), no clipping
    scaler+clip  fp16 autocast, GradScaler, unscale_ + clip_grad_norm_, AdamW (foreach)
    fused        fp16 autocast, GradScaler, fused AdamW (nanoGPT's, the HF Trainer's default)
    clip         bf16 autocast, no scaler, clip_grad_norm_, AdamW (foreach)
    bf16         bf16 autocast, no scaler, no clipping, AdamW (foreach)

**Low precision that the CPU emulates.** The script first times a 512x1024x1024 GEMM in fp32,
bf16 and fp16 (``shared/notes/measuring-like-a-user.md``, probe 1) and prints it with the CPU's
capability. A dtype more than 3x slower than fp32 is emulated: compute that dwarfs any recorder
cost and flatters the ratio. A configuration whose dtype is emulated is then timed in fp32
compute (autocast off), with its GradScaler where it has one (the recorder's path is the same).

**Method** (``shared/notes/overhead-measurements.md``): the machine is noisy (an A/A test moves
+-3% in median step time), so the modes run interleaved in rounds on the same model, each
round timing ``--steps`` steady steps per mode after warm-up. Step times are ``perf_counter``
on CPU and CUDA events on a GPU (what the device ran, idle gaps included; the loop itself
never syncs). A round's *steady* figure for a mode is the 5th percentile of its step times
that did not run the sampled tier (noise only ever adds time), over the round's plain figure;
the median over rounds is reported. Sampled steps are costed apart: the median, over all of
them, of each one's time over its round's plain median. The *ratio* is what a long run pays on
average at interval N: ``steady + (sampled step - steady) / N``. ``plain-again`` (an A/A pair)
shows the floor. ``ampdoctor`` is the default recorder, amortized over the default interval
(100); within a block it samples every 10th step so that its own sampled steps are costed (a
sampled step costs the same whatever the interval, and the steps between are the same).

**Memory** (``--memory``, separate processes, plain and recorded in pairs): the large-vocabulary
model (16 x 256 x 8192 logits, 134 MB in fp32) trained in an ordinary loop whose ``logits``
stays bound until the next forward returns. *Between steps*: resident memory (CUDA: the
allocator's ``memory_allocated``) after ``zero_grad``, median over the steady steps; *peak*:
``ru_maxrss`` (CUDA: ``max_memory_allocated``). Targets: peak <= +5%; between steps within one
sampled step's statistics (what a sampled step leaves queued for the flush).

Models: the reference GPT of issue 6 (4 layers, width 256, sequence 64, batch 8), a small conv
net (BatchNorm, ReLU in place), GPT-2 small (12 layers, width 768, 50257-token vocabulary,
sequence 1024, batch 8: for GPUs), and the large-vocabulary LM (2 layers, width 256, vocabulary
8192, sequence 256, batch 16). ``--smoke`` shrinks every model to a few milliseconds per step,
to check the paths (``gpu_check.sh --device cpu`` uses it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import ampdoctor  # noqa: E402
from ampdoctor.record import recorder  # noqa: E402

DEVICE = torch.device("cpu")
SMOKE = False
COMPILE = False  # --compile: the model under torch.compile
EMULATED = 3.0  # a dtype this many times slower than fp32 at GEMM is emulated


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
    """A GPT: the reference model by default (4 layers, width 256, sequence 64)."""

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


# (vocab, dim, layers, heads, sequence, batch); --smoke: every one tiny
GPTS = {"gpt": (512, 256, 4, 4, 64, 8), "gpt2": (50257, 768, 12, 12, 1024, 8),
        "lm": (8192, 256, 2, 4, 256, 16)}
TINY = (512, 64, 2, 2, 32, 4)
WORKLOADS = ["gpt", "conv", "gpt2", "lm"]
NAMES = {"gpt": "reference GPT", "conv": "conv net", "gpt2": "GPT-2 small",
         "lm": "large-vocabulary LM"}


# ---------------------------------------------------------------------------------------------
# configurations: the loops users run


@dataclass(frozen=True)
class Config:
    scaler: bool
    clip: bool
    fused: bool
    dtype: torch.dtype


CONFIGS = {
    "scaler": Config(True, False, False, torch.float16),
    "scaler+clip": Config(True, True, False, torch.float16),
    "fused": Config(True, False, True, torch.float16),
    "clip": Config(False, True, False, torch.bfloat16),
    "bf16": Config(False, False, False, torch.bfloat16),
}


@dataclass
class Workload:
    """One model trained one way; ``step(i)`` is one training step as users write it."""

    model: nn.Module
    opt: Any
    scaler: Any
    batch: Callable[[int], tuple]
    config: Config
    autocast: Optional[torch.dtype]  # None: fp32 compute (the dtype is emulated here)

    def step(self, i: int):
        x, y = self.batch(i)
        with torch.autocast(DEVICE.type, dtype=self.autocast or torch.float32,
                            enabled=self.autocast is not None):
            out = self.model(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        sc = self.scaler
        (sc.scale(loss) if sc is not None else loss).backward()
        if self.config.clip:
            if sc is not None:
                sc.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        if sc is not None:
            sc.step(self.opt)
            sc.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return out


def make_workload(name: str, config: Config, native: dict, seed: int = 0) -> Workload:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    if name == "conv":
        model = ConvNet()
        side = 8 if SMOKE else 32
        data = torch.randn(16, 16, 3, side, side, generator=g)
        labels = torch.randint(0, 10, (16, 16), generator=g)
        pairs = [(data[i], labels[i]) for i in range(16)]
    else:
        vocab, dim, layers, heads, seq, batch = TINY if SMOKE else GPTS[name]
        model = GPT(vocab, dim, layers, heads, seq)
        tokens = torch.randint(0, vocab, (4, batch, seq + 1), generator=g)
        pairs = [(b[:, :-1], b[:, 1:]) for b in tokens]
    model.to(DEVICE)
    if COMPILE:  # as users compile: the wrapper is trained, watched and called
        model = torch.compile(model)  # type: ignore[assignment]
    pairs = [(x.to(DEVICE), y.to(DEVICE)) for x, y in pairs]  # on the device before timing
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=config.fused,
                            foreach=not config.fused)
    sc = torch.amp.GradScaler(DEVICE.type) if config.scaler else None
    dtype = config.dtype if native.get(config.dtype, True) else None
    return Workload(model, opt, sc, lambda i: pairs[i % len(pairs)], config, dtype)


# ---------------------------------------------------------------------------------------------
# the machine: GEMM speed per dtype, CPU capability


def gemm_probe() -> dict:
    """Milliseconds of a 512x1024 @ 1024x1024 matmul per dtype (probe 1 of the notes; a
    64x128 @ 128x128 one with --smoke)."""
    m, k = (64, 128) if SMOKE else (512, 1024)
    a, b = torch.randn(m, k, device=DEVICE), torch.randn(k, k, device=DEVICE)
    out = {}
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        x, y = a.to(dt), b.to(dt)
        x @ y
        _sync()
        reps = 3 if DEVICE.type == "cpu" else 50
        t = time.perf_counter()
        for _ in range(reps):
            x @ y
        _sync()
        out[str(dt).replace("torch.", "")] = (time.perf_counter() - t) / reps * 1e3
    return out


def native_dtypes(gemm: dict) -> dict:
    base = gemm["float32"]
    return {dt: gemm[str(dt).replace("torch.", "")] <= EMULATED * base
            for dt in (torch.bfloat16, torch.float16)}


def cpu_capability() -> str:
    """torch's CPU capability and the low-precision ISA flags of this CPU."""
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - older torch
        cap = "?"
    flags: set = set()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    wanted = ["avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16"]
    have = [f for f in wanted if f in flags]
    return f"{cap} ({' '.join(have) if have else 'no AVX2/AVX-512 flags read'})"


def machine() -> dict:
    gemm = gemm_probe()
    info = {"device": str(DEVICE), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "gemm": "64x128x128" if SMOKE else "512x1024x1024",
            "gemm_ms": {k: round(v, 3) for k, v in gemm.items()}}
    if DEVICE.type == "cuda":
        info["name"] = torch.cuda.get_device_name(DEVICE)
        info["native"] = {"bfloat16": True, "float16": True}
    else:
        info["name"] = platform.processor() or platform.machine()
        info["capability"] = cpu_capability()
        info["native"] = {str(k).replace("torch.", ""): v for k, v in native_dtypes(gemm).items()}
    return info


def machine_line(info: dict) -> str:
    g = info["gemm_ms"]
    parts = []
    for dt in ("bfloat16", "float16"):
        how = "native" if info["native"][dt] else "EMULATED: timed in fp32 compute"
        parts.append(f"{dt} {g[dt]:.2f} ms ({g[dt] / g['float32']:.1f}x fp32, {how})")
    where = info.get("capability", info["name"])
    return (f"{info['name']} [{where}], torch {info['torch']}, {info['threads']} threads; GEMM "
            f"{info['gemm']}: float32 {g['float32']:.2f} ms, " + ", ".join(parts))


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


# ---------------------------------------------------------------------------------------------
# step times as the device sees them


class Timer:
    """Per-step times of a block of steps: perf_counter on CPU; CUDA events around each step
    on a GPU, read after the block (the loop itself never syncs)."""

    def __init__(self):
        self.marks: list = []

    def mark(self) -> None:
        if DEVICE.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> np.ndarray:
        if DEVICE.type != "cuda":
            return np.diff(np.array(self.marks))
        self.marks[-1].synchronize()
        return np.array([a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])])


# ---------------------------------------------------------------------------------------------
# modes: each a context manager factory around a block of steps


def mode_contexts(w: Workload, tmp: str, modes: str, curve: Optional[list],
                  steps: int) -> dict:
    """Mode name -> (context factory, sampled-tier interval it is amortized over or None, run
    file or None). The default mode samples every ``steps // 3`` steps (at most 10) within a
    block, so that its own sampled steps are costed; amortized over the default interval that
    is the default's figure (a sampled step costs the same whatever the interval, and the
    steps between are the same steps)."""
    def plain():
        return contextlib.nullcontext()

    def ampdoctor_every(n, amortized=None):
        path = os.path.join(tmp, f"every{n}.h5")

        def ctx():
            return recorder.Recorder(w.model, w.opt, w.scaler,
                                     recorder.RecorderConfig(path=path, every=n)).start()
        return ctx, amortized or n, path

    out = {"plain": (plain, None, None), "plain-again": (plain, None, None)}
    if curve:
        for n in curve:
            out[f"every={n}"] = ampdoctor_every(n)
        return out
    out["ampdoctor"] = ampdoctor_every(max(2, min(10, steps // 3)), recorder.DEFAULT_EVERY)
    if modes == "all":
        out["ampdoctor --every 1"] = ampdoctor_every(1)
        out["detect_anomaly"] = (lambda: torch.autograd.detect_anomaly(check_nan=True), None,
                                 None)
    return out


def _sampled_flags(path: str, first: int, count: int) -> np.ndarray:
    """Which of the recorded steps ``first .. first+count-1`` ran the sampled tier."""
    steps = ampdoctor.load(path).steps
    by_index = dict(zip(steps["step"].tolist(), steps["sampled"].tolist()))
    return np.array([bool(by_index.get(first + k, 0)) for k in range(count)])


def _block(w: Workload, factory, steps: int, settle: int, i: int) -> tuple[np.ndarray, int]:
    """``settle`` untimed steps, then ``steps`` timed ones, under one mode."""
    timer = Timer()
    with factory():
        for _ in range(settle):
            w.step(i)
            i += 1
        for _ in range(steps):
            timer.mark()
            w.step(i)
            i += 1
        timer.mark()
        times = timer.seconds()
    return times, i


def measure(workload: str, cname: str, native: dict, rounds: int, steps: int, warmup: int,
            modes: str = "default", curve: Optional[list] = None) -> dict:
    """Interleaved rounds; per mode a steady ratio (5th percentile of the steps that did not
    sample, over the round's plain 5th percentile), a sampled-step ratio (median of the sampled
    steps, pooled over rounds) and the amortized ratio a long run pays at interval N:
    ``steady + (sampled - steady) / N``. A sampled step costs the same whatever N is (the
    module hooks are installed for that step alone), so where a mode's window holds too few
    sampled steps (N > steps per round) the ``--every 1`` mode's stands in."""
    w = make_workload(workload, CONFIGS[cname], native)
    settle = 2  # first steps of a block build hooks and caches; untimed
    with tempfile.TemporaryDirectory() as tmp:
        table = mode_contexts(w, tmp, modes, curve, steps)
        steady: dict[str, list[float]] = {m: [] for m in table}
        sampled: dict[str, list[float]] = {m: [] for m in table}
        plain_median = []
        i = 0
        for _ in range(warmup):
            w.step(i)
            i += 1
        _sync()
        for r in range(rounds):
            order = list(table) if r % 2 == 0 else list(table)[::-1]
            round_sampled: dict[str, np.ndarray] = {}
            for name in order:
                factory, every, path = table[name]
                times, i = _block(w, factory, steps, settle, i)
                flags = (_sampled_flags(path, settle, steps) if path
                         else np.zeros(steps, dtype=bool))
                calm = times[~flags] if (~flags).sum() >= 5 else times
                steady[name].append(float(np.percentile(calm, 5)))
                round_sampled[name] = times[flags]
                if name == "plain":
                    plain_median.append(float(np.median(times)))
            for name, times in round_sampled.items():
                sampled[name].extend((times / plain_median[-1]).tolist())
    out = _summary(workload, cname, w, table, steady, sampled, rounds, steps)
    if curve is None:
        out["modes"]["ampdoctor"]["own_us"] = round(own_time(w, steps) * 1e6, 1)
    return out


def own_time(w: Workload, steps: int) -> float:
    """Seconds per steady step spent in ampdoctor's own code (every hook goes through
    ``patches.guard``): the median over steps of the time inside it, a figure the machine's
    load moves far less than the ratios. On CPU it includes the recorder's kernels (they run
    inside its hooks) and the flushes, about one a second; on a GPU, the host time only."""
    from ampdoctor.record import clipdoors, moduledoors, patches

    doors = (patches, clipdoors, moduledoors)  # each door's wrappers call its module's guard
    spent = [0.0]
    original = patches.guard

    def timed(fault, fn, *args):
        t = time.perf_counter()
        try:
            return original(fault, fn, *args)
        finally:
            spent[0] += time.perf_counter() - t

    per_step = []
    with tempfile.TemporaryDirectory() as tmp:
        rec = recorder.Recorder(w.model, w.opt, w.scaler,
                                recorder.RecorderConfig(path=os.path.join(tmp, "own.h5")))
        with rec.start():
            w.step(0)  # step 0: sampled, metadata; not counted
            for module in doors:
                module.guard = timed
            try:
                for i in range(1, steps + 1):
                    spent[0] = 0.0
                    w.step(i)
                    per_step.append(spent[0])
            finally:
                for module in doors:
                    module.guard = original
    return float(np.median(per_step))


def _summary(workload, cname, w, table, steady, sampled, rounds, steps) -> dict:
    plain = np.array(steady["plain"])
    every_step = [n for n, (_, every, _) in table.items() if every == 1 and sampled[n]]
    reference = float(np.median(sampled[every_step[0]])) if every_step else None
    compute = str(w.autocast).replace("torch.", "") if w.autocast else "float32"
    out = {"workload": workload, "config": cname, "compute": compute,
           "scaler": w.scaler is not None, "rounds": rounds, "steps_per_round": steps,
           "plain_p5_ms": round(float(np.median(plain)) * 1e3, 2), "modes": {}}
    for name, series in steady.items():
        ratios = np.array(series) / plain
        floor = float(np.median(ratios))
        every = table[name][1]
        row = {"steady": round(floor, 4), "steady_min": round(float(ratios.min()), 4),
               "steady_max": round(float(ratios.max()), 4),
               "steady_ms": round(float(np.median(series)) * 1e3, 2), "every": every}
        ratio = floor
        if every:
            own = len(sampled[name]) >= 3
            cost = float(np.median(sampled[name])) if own else reference
            source = "own" if own else "every=1"
            if cost is None:  # no sampled step measured at all: the steady figure stands
                cost, source = floor, "none measured"
            row.update(sampled_step=round(cost, 4), sampled_from=source)
            ratio = floor + (cost - floor) / every if every > 1 else cost
        row["ratio"] = round(ratio, 4)
        out["modes"][name] = row
    return out


def table_text(results: list[dict]) -> str:
    """The overhead table, one row per configuration and mode (what docs/performance.md quotes)."""
    lines = [f"  {'workload':<20} {'config':<12} {'compute':<21} {'plain step':>11}  "
             f"{'mode':<22} {'ratio':>7}  {'steady':>7} {'steady range':>15}  sampled step"
             f"  own time/step"]
    for res in results:
        compute = res["compute"] + (" + GradScaler" if res["scaler"] else "")
        first = True
        for name, m in res["modes"].items():
            if name == "plain":
                continue
            head = (f"  {NAMES.get(res['workload'], res['workload']):<20} {res['config']:<12} "
                    f"{compute:<21} {res['plain_p5_ms']:>8.2f} ms  ")
            head = head if first else " " * len(head)
            first = False
            cost = (f"{m['sampled_step']:.3f}x" + (f" ({m['sampled_from']})"
                                                   if m["sampled_from"] != "own" else "")
                    if m["every"] else "")
            own = f"{m['own_us']:.0f} us" if "own_us" in m else ""
            lines.append(f"{head}{name:<22} {m['ratio']:>6.3f}x  {m['steady']:>6.3f}x "
                         f"[{m['steady_min']:.3f}, {m['steady_max']:.3f}]  {cost:<12}  {own}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# memory: separate processes (peak RSS only ever grows within a process)


def _resident() -> int:
    if DEVICE.type == "cuda":
        return int(torch.cuda.memory_allocated(DEVICE))
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    if DEVICE.type == "cuda":
        return int(torch.cuda.max_memory_allocated(DEVICE))
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _memory_child(mode: str, workload: str, cname: str, native: dict, steps: int,
                  path: str) -> None:
    w = make_workload(workload, CONFIGS[cname], native)
    ctx = contextlib.nullcontext() if mode == "plain" else recorder.Recorder(
        w.model, w.opt, w.scaler, recorder.RecorderConfig(path=path)).start()
    between = []
    with ctx:
        _sync()
        base = _resident()  # before training: the recorder's own footprint is in it
        for i in range(steps):
            logits = w.step(i)  # the loop's own: bound until the next forward returns
            if i >= steps // 4:
                _sync()
                between.append(_resident())
        del logits
    stats_bytes = 0
    if mode != "plain" and os.path.exists(path):  # step 0 is sampled: its rows, in bytes
        stats = ampdoctor.load(path).stats
        stats_bytes = int((stats.column("step") == 0).sum()) * stats.dtype.itemsize
    print(json.dumps({"base": base, "between": float(np.median(between)), "between_iqr": float(
        np.subtract(*np.percentile(between, [75, 25]))), "peak": _peak(),
        "sampled_stats_bytes": stats_bytes,
        "file_bytes": os.path.getsize(path) if os.path.exists(path) else 0}))


def memory(workload: str, cname: str, native: dict, steps: int, pairs: int) -> dict:
    res: dict = {"plain": [], "ampdoctor": []}
    with tempfile.TemporaryDirectory() as tmp:
        for p in range(pairs):
            for mode in ("plain", "ampdoctor") if p % 2 == 0 else ("ampdoctor", "plain"):
                path = os.path.join(tmp, f"{mode}{p}.h5")
                cmd = [sys.executable, __file__, "--memory-child", mode, "--workload",
                       workload, "--config", cname, "--steps", str(steps), "--path", path,
                       "--device", str(DEVICE), "--native", json.dumps(
                           {str(k).replace("torch.", ""): v for k, v in native.items()})]
                if SMOKE:
                    cmd.append("--smoke")
                out = subprocess.run(cmd, capture_output=True, text=True, check=True)
                res[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {m: {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
           for m, rows in res.items()}
    vocab, _, _, _, seq, batch = TINY if SMOKE else GPTS.get(workload, (0,) * 6)
    return {"workload": workload, "config": cname, "steps": steps, "pairs": pairs,
            "measure": "CUDA allocator" if DEVICE.type == "cuda" else "RSS",
            "logits_mb": round(batch * seq * vocab * 4 / 2**20, 1),
            "between_plain_mb": round(med["plain"]["between"] / 2**20, 1),
            "between_delta_mb": round((med["ampdoctor"]["between"] - med["plain"]["between"])
                                      / 2**20, 2),
            # of which the recorder's footprint before the first step (modules, file, caches),
            # and what it allocated once training began (the sampled tier, HDF5 chunk caches)
            "static_mb": round((med["ampdoctor"]["base"] - med["plain"]["base"]) / 2**20, 2),
            "training_mb": round((med["ampdoctor"]["between"] - med["ampdoctor"]["base"]
                              - med["plain"]["between"] + med["plain"]["base"]) / 2**20, 2),
            "between_iqr_mb": round(med["plain"]["between_iqr"] / 2**20, 2),
            "sampled_stats_kb": round(med["ampdoctor"]["sampled_stats_bytes"] / 1024, 1),
            "peak_plain_mb": round(med["plain"]["peak"] / 2**20, 1),
            "peak_ratio": round(med["ampdoctor"]["peak"] / med["plain"]["peak"], 4),
            "file_bytes_per_step": round(med["ampdoctor"]["file_bytes"] / steps, 1)}


def memory_text(m: dict) -> str:
    return (f"  memory, {NAMES.get(m['workload'], m['workload'])}, {m['config']} "
            f"({m['measure']}, logits {m['logits_mb']} MB, median of {m['pairs']} pairs): "
            f"between steps {m['between_plain_mb']} MB plain, {m['between_delta_mb']:+.2f} MB "
            f"recorded = {m['static_mb']:+.2f} MB before the first step {m['training_mb']:+.2f} "
            f"MB after (steps' own spread {m['between_iqr_mb']} MB; a sampled step's "
            f"statistics {m['sampled_stats_kb']} KB); peak {m['peak_plain_mb']} MB plain, "
            f"{m['peak_ratio']:.3f}x recorded; file {m['file_bytes_per_step']} bytes/step")


# ---------------------------------------------------------------------------------------------
# markdown: docs/performance.md's tables (gpu_check.sh writes its summary with it)


def markdown(paths: list[str]) -> str:
    """The overhead and memory results of ``--json`` files as docs/performance.md's markdown tables."""
    speed = ["| workload | config | compute | plain step | A/A | ampdoctor (default) | "
             "steady range | ampdoctor's own time | machine |",
             "|---|---|---|---|---|---|---|---|---|"]
    mem = ["| workload | config | measured | between steps, plain | recorded | of which after "
           "the first step | peak, plain | peak, recorded |", "|---|---|---|---|---|---|---|---|"]
    for path in paths:
        with open(path) as fh:
            data = json.load(fh)
        where = data["machine"].get("capability") or data["machine"]["name"]
        for r in data["results"]:
            name = NAMES.get(r["workload"], r["workload"])
            if "modes" in r:
                m, aa = r["modes"]["ampdoctor"], r["modes"]["plain-again"]
                compute = r["compute"] + (" + GradScaler" if r["scaler"] else "")
                speed.append(f"| {name} | {r['config']} | {compute} | {r['plain_p5_ms']} ms | "
                             f"{aa['ratio']:.3f}x | **{m['ratio']:.3f}x** | "
                             f"{m['steady_min']:.3f}-{m['steady_max']:.3f} | "
                             f"{m.get('own_us', float('nan')):.0f} µs/step | {where} |")
            else:
                mem.append(f"| {name} | {r['config']} | {r['measure']} | "
                           f"{r['between_plain_mb']} MB | {r['between_delta_mb']:+.2f} MB | "
                           f"{r['training_mb']:+.2f} MB | {r['peak_plain_mb']} MB | "
                           f"{r['peak_ratio']:.3f}x |")
    tables = [t for t in (speed, mem) if len(t) > 2]
    return "\n\n".join("\n".join(t) for t in tables)


# ---------------------------------------------------------------------------------------------


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=WORKLOADS + ["all"], default="gpt",
                        help="all: gpt and conv (the CPU-sized ones)")
    parser.add_argument("--config", default="all",
                        help=f"comma-separated, of: {', '.join(CONFIGS)} (default all)")
    parser.add_argument("--modes", choices=["default", "all"], default="default",
                        help="all: also --every 1 and detect_anomaly")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--curve", action="store_true", help="overhead vs sampling interval")
    parser.add_argument("--memory", action="store_true", help="between steps and at peak")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny models: check the paths")
    parser.add_argument("--compile", action="store_true",
                        help="the model under torch.compile (inductor)")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--markdown", nargs="+", metavar="JSON",
                        help="print these --json results as docs/performance.md's markdown tables")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--native", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    global DEVICE, SMOKE, COMPILE
    args = parse()
    if args.markdown:
        return print(markdown(args.markdown))
    DEVICE, SMOKE, COMPILE = torch.device(args.device), args.smoke, args.compile
    torch.set_num_threads(args.threads)
    configs = list(CONFIGS) if args.config == "all" else args.config.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        sys.exit(f"unknown configuration {unknown[0]!r}; known: {', '.join(CONFIGS)}")
    workloads = ["gpt", "conv"] if args.workload == "all" else [args.workload]
    if args.memory_child:
        native = {getattr(torch, k): v for k, v in json.loads(args.native).items()}
        return _memory_child(args.memory_child, workloads[0], configs[0], native, args.steps,
                             args.path)
    info = machine()
    print(machine_line(info), flush=True)
    native = {getattr(torch, k): v for k, v in info["native"].items()}
    results = []
    for wl in workloads:
        for cname in configs:
            if args.memory:
                res = memory(wl, cname, native, args.steps, args.pairs)
                print(memory_text(res), flush=True)
            else:
                curve = [1, 2, 5, 10, 20, 50, 100, 200, 1000] if args.curve else None
                res = measure(wl, cname, native, args.rounds, args.steps, args.warmup,
                              args.modes, curve)
            results.append(res)
    if not args.memory:
        print(table_text(results), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": info, "default_every": recorder.DEFAULT_EVERY,
                       "results": results}, fh, indent=2)


if __name__ == "__main__":
    main()
