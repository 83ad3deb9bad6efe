"""What ``ampdoctor record`` costs a command: interpreter start, torch import, training steps.

    python benchmarks/record_overhead.py            # about two minutes on 2 CPU cores

Each measurement runs the same command plainly and as a recorded child would run (the
bootstrap first on PYTHONPATH and the recording variables set, exactly what ``record`` does),
interleaved, and reports medians and their ratio:

1. a script that never imports torch (the bootstrap must cost next to nothing);
2. ``import torch`` (ampdoctor's recorder is imported and started at that moment);
3. steady training steps of a bf16 MLP (sentinel tier every step, sampled tier every 100):
   the 5th percentile of per-step times after warm-up, as benchmarks should on a noisy box.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ampdoctor.record.command import launch  # noqa: E402

TRAIN = r"""
import time, torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.GELU())],
                      nn.Linear(256, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
times = []
for step in range(STEPS):
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - t0)
steady = sorted(times[50:])
print(steady[len(steady) // 20])
"""


def envs(folder):
    plain = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    plain.pop("PYTHONDONTWRITEBYTECODE", None)  # users' interpreters cache bytecode
    settings = launch.Settings(output=os.path.join(folder, "run.h5"))
    recorded = launch.child_env(settings, plain)
    return plain, recorded


def wall(cmd, env):
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def compare(name, measure, rounds, folder):
    plain_env, rec_env = envs(folder)
    plain, rec = [], []
    for _ in range(rounds):
        for f in os.listdir(folder):
            os.unlink(os.path.join(folder, f))
        plain.append(measure(plain_env))
        rec.append(measure(rec_env))
    p, r = statistics.median(plain), statistics.median(rec)
    print(f"{name:<34} plain {p * 1e3:8.2f} ms   recorded {r * 1e3:8.2f} ms   "
          f"ratio {r / p:.3f}x")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory() as folder:
        compare("python -c pass (no torch)", lambda env: wall([py, "-c", "pass"], env),
                args.rounds * 3, folder)
        compare("python -c 'import torch'", lambda env: wall([py, "-c", "import torch"], env),
                args.rounds, folder)

        def step_time(env):
            out = subprocess.run([py, "-c", TRAIN.replace("STEPS", str(args.steps))], env=env,
                                 check=True, capture_output=True, text=True).stdout
            return float(out.split()[-1])

        compare("bf16 MLP step (p5, steady)", step_time, args.rounds, folder)


if __name__ == "__main__":
    main()
