"""The recorder's own memory over a long run: resident size at 10% of the run and at its end.

    python benchmarks/recorder_memory.py                  # 20 000 steps, 300 modules, every 100
    python benchmarks/recorder_memory.py --steps 5000 --modules 100 --every 10

A real ``ampdoctor.watch`` recording of a small CPU model made of ``--modules`` modules (an MLP of
Linear/ReLU pairs, width 16, bf16 autocast, AdamW, clipping), trained on random batches. The
same loop runs unrecorded first, so that torch's own allocations are in place: what grows after
that is the recorder (its id maps, queued rows, sampled statistics) or the file's HDF5 caches.
Resident memory comes from /proc/self/statm (Linux). One process, one thread.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ampdoctor  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def model(modules: int) -> nn.Module:
    layers = []
    for _ in range(modules // 2):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(16, 4))


def train(net, opt, steps, on_step=None):
    g = torch.Generator().manual_seed(0)
    for i in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(net(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step(i)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--modules", type=int, default=300)
    parser.add_argument("--every", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = model(args.modules)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    train(net, opt, min(args.steps, 2000))  # torch's allocations settle
    base = rss_mib()
    marks = {}
    path = os.path.join(tempfile.mkdtemp(prefix="ampdoctor-recmem-"), "run.h5")
    t0 = time.perf_counter()
    with ampdoctor.watch(net, opt, path=path, every=args.every):
        train(net, opt, args.steps,
              lambda i: marks.__setitem__(i, rss_mib()) if i + 1 in (args.steps // 10,
                                                                      args.steps) else None)
    seconds = time.perf_counter() - t0
    early, late = marks[args.steps // 10 - 1], marks[args.steps - 1]
    print(f"{args.steps} steps, {args.modules} modules, sampled every {args.every}: "
          f"{seconds:.0f} s, file {os.path.getsize(path) / 2**20:.1f} MiB")
    print(f"resident memory: {base:.0f} MiB before recording, {early:.0f} MiB at step "
          f"{args.steps // 10}, {late:.0f} MiB at step {args.steps} "
          f"(+{late - early:.1f} MiB over the last 90% of the run)")
    os.remove(path)


if __name__ == "__main__":
    main()
