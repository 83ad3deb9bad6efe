"""CUDA checks: the same code paths on a GPU (skipped cleanly without one).

Run on a machine with CUDA with ``python -m pytest -m gpu`` (benchmarks/gpu_check.sh does).
"""

import numpy as np
import pytest
import torch

import ampdoctor
from ampdoctor import stats

from helpers import fresh

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


def _train_cuda(model, opt, scaler, ctx=None, steps=6):
    import contextlib

    from helpers import batches

    losses = []
    with ctx if ctx is not None else contextlib.nullcontext():
        for i, (x, y) in enumerate(batches(steps, bad_step=3)):
            x, y = x.cuda(), y.cuda()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            losses.append(loss.item())
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    return losses


def test_observer_effect_is_zero_on_cuda(tmp_path):
    torch.use_deterministic_algorithms(True, warn_only=True)
    model, opt = _cuda_model()
    plain = _train_cuda(model, opt, torch.amp.GradScaler("cuda"))
    w_plain = [p.detach().cpu() for p in model.parameters()]
    model, opt = _cuda_model()
    scaler = torch.amp.GradScaler("cuda")
    rec = ampdoctor.watch(model, opt, scaler, path=str(tmp_path / "run.h5"), every=1,
                          strict=True)
    recorded = _train_cuda(model, opt, scaler, ctx=rec)
    w_rec = [p.detach().cpu() for p in model.parameters()]
    assert np.array_equal(np.array(plain), np.array(recorded), equal_nan=True)
    for a, b in zip(w_plain, w_rec):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    run = ampdoctor.load(str(tmp_path / "run.h5"))
    assert run.meta["device"]["type"] == "cuda"
    assert run.meta["device"]["capability"]
    assert list(run.steps["skipped"]) == [0, 0, 0, 1, 0, 0]
    assert np.all(run.steps["peak_mem"] > 0)
