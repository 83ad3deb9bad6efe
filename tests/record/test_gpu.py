"""CUDA checks: the same code paths on a GPU (skipped cleanly without one).

Run on a machine with CUDA with ``python -m pytest -m gpu`` (benchmarks/gpu_check.sh does).
"""

import contextlib

import numpy as np
import pytest
import torch
from helpers import fresh, train

import ampdoctor
from ampdoctor.record import stats

pytestmark = pytest.mark.gpu


def test_stats_on_cuda_match_cpu():
    torch.manual_seed(0)
    t = torch.randn(300, 257) * 1e-5
    t[3, 4] = 70000.0
    t[7, 7] = float("nan")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = t.to(dtype)
        cpu, gpu = stats.exact(x), stats.exact(x.cuda())
        for key in ("nan", "posinf", "zeros", "over16", "sub16", "flush16", "nonfinite"):
            assert cpu[key] == gpu[key], (dtype, key)
        np.testing.assert_allclose(cpu["absmax"], gpu["absmax"], rtol=1e-6)
        c = stats.Collector()
        c.add(x.cuda())
        sampled = c.drain()[0]
        assert sampled["nonfinite"] & 1 and sampled["sample_n"] == stats.SAMPLE


def _cuda_model():
    model, opt = fresh()
    model.cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_observer_effect_is_zero_on_cuda(tmp_path):
    torch.use_deterministic_algorithms(True, warn_only=True)
    model, opt = _cuda_model()
    plain = train(model, opt, torch.amp.GradScaler("cuda"), bad_step=3, clip=1.0, device="cuda")
    w_plain = [p.detach().cpu() for p in model.parameters()]
    model, opt = _cuda_model()
    scaler = torch.amp.GradScaler("cuda")
    rec = ampdoctor.watch(model, opt, scaler, path=str(tmp_path / "run.h5"), every=1,
                          strict=True)
    recorded = train(model, opt, scaler, bad_step=3, clip=1.0, recorder_ctx=rec, device="cuda")
    w_rec = [p.detach().cpu() for p in model.parameters()]
    assert np.array_equal(np.array(plain), np.array(recorded), equal_nan=True)
    for a, b in zip(w_plain, w_rec):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    run = ampdoctor.load(str(tmp_path / "run.h5"))
    assert run.meta["device"]["type"] == "cuda"
    assert run.meta["device"]["capability"]
    assert list(run.steps["skipped"]) == [0, 0, 0, 1, 0, 0]
    assert np.all(run.steps["peak_mem"] > 0)


# ---------------------------------------------------------------------------------------------
# always on: no sync of ampdoctor's own on a steady step, nothing held past it, step time from
# CUDA events (tests/record/test_host_reads.py has the same loops on CPU)


def _sync_count(fn) -> int:
    """Synchronizing CUDA operations made by ``fn()``, as torch's sync debug mode reports
    them (``.item()``, ``.cpu()``, stream synchronizes; an event wait is not one of them)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("path", ["scaler-foreach", "scaler-foreach-clip", "scaler-fused",
                                  "scaler-fused-clip", "clip-no-scaler", "no-scaler",
                                  "no-scaler-fused"])
def test_steady_steps_add_only_the_documented_syncs_on_cuda(path, tmp_path, monkeypatch):
    from test_host_reads import PATHS, STEADY, WARMUP, HostReads, batch, make, step

    data = [batch(i, "cuda") for i in range(WARMUP + STEADY)]

    def loop(recorded: bool, mode: str = "warn"):
        model, opt, sc, clip, dtype = make(path, device="cuda", width=256)
        rec = ampdoctor.watch(model, opt, sc, path=str(tmp_path / f"{path}.h5"), strict=True,
                              flush_seconds=1e9) if recorded else None
        reads = HostReads()
        reads.watch_cuda(monkeypatch)

        def steady():
            reads.on = True
            for x, y in data[WARMUP:]:
                step(model, opt, sc, clip, dtype, x, y)
            reads.on = False

        with rec if rec is not None else contextlib.nullcontext(), reads:
            for x, y in data[:WARMUP]:
                step(model, opt, sc, clip, dtype, x, y)
            torch.cuda.synchronize()
            if mode == "error":
                torch.cuda.set_sync_debug_mode("error")
                try:
                    steady()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                syncs = 0
            else:
                syncs = _sync_count(steady)
        return syncs, reads, rec

    expected = PATHS[path][-1] * STEADY  # 0 with GradScaler, 1 per step without
    plain, _, _ = loop(False)
    syncs, reads, rec = loop(True)
    assert syncs - plain == expected
    assert len(reads.device) == expected, reads.device
    assert not rec.faulted and rec.forensics.armed
    if plain == 0 and expected == 0:  # fused under GradScaler: nothing syncs at all
        loop(True, mode="error")  # strict: a sync of ours would raise RecorderFault
    run = ampdoctor.load(str(tmp_path / f"{path}.h5"))
    assert np.isfinite(run.steps["loss"]).all() and (run.steps["dt"] > 0).all()


@pytest.mark.parametrize("path", ["scaler-foreach", "scaler-fused", "no-scaler"])
def test_output_gradient_and_inputs_are_released_on_cuda(path, run_path):
    from test_host_reads import _lifetimes

    after_step, at_next_forward, closed = _lifetimes(path, run_path, device="cuda")
    assert at_next_forward == [(True, True)] * 3 and closed == (True, True)
    if path != "scaler-fused":  # fused: held until the skip is known, if the GPU was behind
        assert after_step == [(True, True)] * 4


def _sleep_cycles(ms: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for about ``ms`` milliseconds."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * ms / max(start.elapsed_time(end), 1e-3))


def test_step_time_is_what_the_gpu_ran(run_path):
    """Nothing syncs in this loop (no scaler, forensics off): the host launches steps far ahead
    of the GPU, and perf_counter would time the launches. The recorded step time is the span
    between CUDA events at the step boundaries: the GPU's 20 ms of work per step."""
    from test_host_reads import batch, make, step

    model, opt, sc, clip, dtype = make("no-scaler", device="cuda")
    cycles = _sleep_cycles(20.0)
    model.register_forward_pre_hook(lambda m, a: torch.cuda._sleep(cycles))
    data = [batch(i, "cuda") for i in range(10)]
    with ampdoctor.watch(model, opt, path=run_path, forensics=False, strict=True):
        for x, y in data:
            step(model, opt, sc, clip, dtype, x, y)
    dt = ampdoctor.load(run_path).steps["dt"][2:]
    assert np.all(dt > 0.018) and np.all(dt < 0.2), dt


def test_a_skip_the_gpu_had_not_finished_is_decided_at_the_next_step(tmp_path):
    """Fused AdamW under GradScaler on CUDA: GradScaler syncs on nothing, and a 30 ms kernel
    in each forward keeps the GPU behind the host, so the skip is not known at update(). It is
    decided at the next forward (after one event wait) and replayed with the right culprit;
    the only synchronizing CUDA operations are the replay's own, in that next step."""
    from culprits import ExpNet, batches
    from culprits import make as make_model

    torch.manual_seed(0)
    model = make_model(ExpNet).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    sc = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    data = [(x.cuda(), y.cuda()) for x, y in batches(6)]
    data[3] = (data[3][0] * 40, data[3][1])
    cycles = _sleep_cycles(30.0)

    def one_step(x, y):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        sc.scale(loss).backward()
        sc.step(opt)
        sc.update()
        opt.zero_grad(set_to_none=True)

    rec = ampdoctor.watch(model, opt, sc, path=str(tmp_path / "run.h5"), every=0, strict=True,
                          flush_seconds=1e9)
    with rec:
        model.register_forward_pre_hook(lambda m, a: torch.cuda._sleep(cycles))
        one_step(*data[0])  # first step: metadata, mirrors and events made
        syncs = [_sync_count(lambda: one_step(x, y)) for x, y in data[1:]]
    ev = rec.events[0]
    assert (ev.step, ev.phase, ev.module, ev.fp32) == (3, "forward", "body.1", "finite")
    assert ev.result.faithful
    assert sum(p.blocked for p in rec._skips.pools.values()) >= 1  # the GPU was behind: it waited
    assert syncs[:3] == [0, 0, 0] and syncs[4] == 0  # steps 1, 2, 3 and 5
    assert syncs[3] > 0  # step 4: the replay of step 3, and its flush (the event path syncs)
    assert list(ampdoctor.load(str(tmp_path / "run.h5")).steps["skipped"]) == [0, 0, 0, 1, 0, 0]
