"""What the sampled step's fp8 counts cost: a sampled step with and without them, side by side.

    OMP_NUM_THREADS=1 python benchmarks/fp8_cost.py                  # reference GPT, ~3 min
    python benchmarks/fp8_cost.py --rounds 9 --steps 20 --device cuda
    python benchmarks/fp8_cost.py --smoke                            # seconds: the paths only

The fp8 counts (``record/fp8.Fp8Probe``, issue 36) run only on sampled steps: for every
Linear's input, weight and output gradient, one ``aminmax`` pass per 32-element block in the
hook, a gather of ``sample`` elements with each recipe's scale, and at the drain the rounding
and counting of all of them together. Measured on the reference GPT (4 layers, width 256,
sequence 64, batch 8, AdamW; 25 Linear layers) in fp32 compute, as ``probe_cost.py`` does
(the CPU emulates fp16, which would dwarf and flatter the cost; ``docs/performance.md``).

Five modes, interleaved in rounds on the same model: ``plain`` (no recorder); ``sampled``
(``watch(every=1, fp8=False)``: every step a sampled step, as before issue 36) and
``sampled+fp8`` (``watch(every=1)``, the default); ``steady`` and ``steady+fp8``
(``every=10**6``: after the first step no step is sampled, the always-on tier alone, with the
fp8 counts off and on). Each round times ``--steps`` steps per mode after a warm-up; a mode's
figure is the median over rounds of its median step time; in ``sampled+fp8`` the time spent
inside the fp8 counts' own entry points is also taken (``own_time``: on a CPU their device
work runs inside them), a measure that the step's noise does not swamp. Printed: each ratio
to ``plain``,
the fp8 counts' own ratio ``sampled+fp8 / sampled`` (a sampled step's cost with them against
without), ``steady+fp8 / steady`` (the always-on step: 1 within noise, since nothing of the
fp8 counts runs there), the own time per sampled step, and what it adds at the default
interval, 100; and of the own time, what the kurtosis of each operand takes (the fp8 early
warning's outlier figure, ``fp8.kurtosis``, at the drain).
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from probe_cost import reference, step, timed  # noqa: E402  (the same model and loop)

import ampdoctor  # noqa: E402
from ampdoctor.record import fp8  # noqa: E402

MODES = {"plain": None, "sampled": dict(every=1, fp8=False), "sampled+fp8": dict(every=1),
         "steady": dict(every=10**6, fp8=False), "steady+fp8": dict(every=10**6)}


OWN = [0.0]  # seconds spent inside the fp8 counts' own code (hooks and drain)
KURTOSIS = [0.0]  # of which in the kurtosis of each operand (the fp8 early warning's figure)


@contextlib.contextmanager
def own_time():
    """Time the fp8 counts' entry points (their forward hook, gradient hook and drain) with
    perf_counter: on a CPU their device work runs inside them, so this is their whole cost,
    measured apart from the step's noise. (On CUDA it would be the launch time only.)"""
    saved = {name: getattr(fp8.Fp8Probe, name) for name in ("on_module", "_on_grad", "stage")}
    kurtosis = fp8.kurtosis

    def timer(fn, into):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                into[0] += time.perf_counter() - t0
        return wrapped

    for name, fn in saved.items():
        setattr(fp8.Fp8Probe, name, timer(fn, OWN))
    fp8.kurtosis = timer(kurtosis, KURTOSIS)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(fp8.Fp8Probe, name, fn)
        fp8.kurtosis = kurtosis


def mode_time(mode: str, model, opt, data, device, steps: int, path: str) -> float:
    options = MODES[mode]
    if options is None:
        return timed(model, opt, data, device, steps)
    with ampdoctor.watch(model, opt, path=path, forensics=False, **options):
        step(model, opt, data[0], device)  # the first step: discovery, metadata (sampled)
        if mode != "sampled+fp8":
            return timed(model, opt, data, device, steps)
        OWN[0] = KURTOSIS[0] = 0.0
        with own_time():
            median = timed(model, opt, data, device, steps)
        OWN_PER_STEP.append(OWN[0] / steps)
        KURTOSIS_PER_STEP.append(KURTOSIS[0] / steps)
        return median


OWN_PER_STEP: list[float] = []
KURTOSIS_PER_STEP: list[float] = []


def operands(model, opt, data, device, path: str) -> int:
    """/fp8 operands (input, weight, output gradient of each Linear call) per sampled step."""
    with ampdoctor.watch(model, opt, path=path, every=1, forensics=False):
        step(model, opt, data[0], device)
    with ampdoctor.load(path) as run:
        return len(run.fp8) // 4


def main() -> None:
    device, rounds, steps, model, opt, data = reference(__doc__ or "")
    results: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for mode in results:
                results[mode].append(mode_time(mode, model, opt, data, device, steps,
                                               os.path.join(tmp, f"{mode}{r}.h5")))
        n = operands(model, opt, data, device, os.path.join(tmp, "count.h5"))
    med = {m: statistics.median(v) for m, v in results.items()}
    print(f"torch {torch.__version__}, {device}, threads {torch.get_num_threads()}, "
          f"{rounds} rounds x {steps} steps, {n} operands x 4 recipes per sampled step")
    for mode in MODES:
        print(f"{mode:<14} {med[mode] * 1e3:8.2f} ms  {med[mode] / med['plain']:.3f}x plain")
    extra = med["sampled+fp8"] - med["sampled"]
    own = statistics.median(OWN_PER_STEP)
    print(f"fp8 counts on a sampled step: {med['sampled+fp8'] / med['sampled']:.3f}x "
          f"(+{extra * 1e3:.2f} ms, {extra / max(n, 1) * 1e6:.0f} us per operand)")
    print(f"fp8 counts' own time: {own * 1e3:.2f} ms per sampled step "
          f"({own / med['plain']:.1%} of a plain step, {own / max(n, 1) * 1e6:.0f} us per "
          f"operand; the step-time ratio above is within the machine's noise where smaller)")
    kurt = statistics.median(KURTOSIS_PER_STEP)
    print(f"of which the kurtosis (the early warning's outlier figure): {kurt * 1e3:.2f} ms per "
          f"sampled step ({kurt / max(own, 1e-12):.1%} of the own time)")
    print(f"always-on step with the fp8 counts on: {med['steady+fp8'] / med['steady']:.3f}x "
          f"the same without them")
    print(f"at the default interval (100): +{own / med['plain'] / 100:.3%} of a step "
          "(from the own time)")


if __name__ == "__main__":
    main()
