"""The LR range test on a loss built as litgpt's ``chunked_cross_entropy`` builds it: the
logits sliced (``[..., :-1, :]``), reshaped (a copy: the slice is not contiguous over the
batch), split in chunks, ``cross_entropy(reduction="none")`` per chunk, and the elements
summed over the targets that are not ``ignore_index``. The chunks are rebuilt from the
replayed logits (``losscall.rearranged``), the calls combined as verified at the failing step
(``losssum``), the dose is tried, and the run stays bit-identical to the plain run."""

import contextlib

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampdoctor
from ampdoctor.record.forensic import losscall, lrrange
from ampdoctor.runfile.payloads import LrRange

VOCAB, WIDTH, BATCH, SEQ = 16, 16, 4, 9
RISING_LR = 3.0  # Adam, no scaler: the loss 2.75, then 75 at step 1, finite throughout


def chunked(logits, targets, chunk=8, ignore_index=-100, extra=0.0):
    """litgpt.utils.chunked_cross_entropy's unchunked-logits branch, written again;
    ``extra`` adds a term by hand (no combination of the calls then gives the loss)."""
    logits = logits.reshape(-1, logits.size(-1))
    targets = targets.reshape(-1)
    parts = [F.cross_entropy(a, b, ignore_index=ignore_index, reduction="none")
             for a, b in zip(logits.split(chunk), targets.split(chunk))]
    n = (targets != ignore_index).sum()
    loss = torch.cat(parts).sum() / n.maximum(torch.ones_like(n))
    return loss + extra * logits.float().pow(2).mean() if extra else loss


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        targets = ids.clone()
        targets[:, -2:] = -100  # padding, as litgpt's collate leaves it
        out.append((ids, targets))
    return out


def _train(lr, path=None, steps=30, extra=0.0, divide=1):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    watch = ampdoctor.watch(model, opt, path=str(path), strict=True) if path else \
        contextlib.nullcontext()
    losses = []
    with watch:
        for ids, targets in _batches(steps):
            logits = model(ids)
            loss = chunked(logits[..., :-1, :], targets[..., 1:], extra=extra) / divide
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
    return losses, [p.detach().clone() for p in model.parameters()], opt


@pytest.fixture(scope="module")
def rising(tmp_path_factory):
    path = tmp_path_factory.mktemp("chunked") / "run.h5"
    return path, _train(RISING_LR, path)


def test_a_chunk_of_a_copied_slice_is_rebuilt_from_the_output():
    out = torch.randn(BATCH, SEQ, VOCAB, requires_grad=True) * 1.0  # (a model's: a graph)
    chunk = out[..., :-1, :].reshape(-1, VOCAB).split(8)[2]
    assert chunk._base is not None and chunk._base._base is None  # a view of a copy
    made = losscall.relation(chunk, [out])
    assert made is not None and made.path, made
    other = torch.randn(BATCH, SEQ, VOCAB)
    assert torch.equal(made.rebuild([other]),
                       other[..., :-1, :].reshape(-1, VOCAB).split(8)[2])
    assert losscall.relation(out[..., :-1, :].exp().reshape(-1), [out]) is None  # arithmetic


def test_the_trial_runs_on_the_chunks_and_the_run_stays_bit_identical(rising):
    path, (losses, weights, opt) = rising
    plain_losses, plain_weights, plain_opt = _train(RISING_LR)
    assert np.isfinite(plain_losses).all() and max(plain_losses) > lrrange.RISE * losses[0]
    assert plain_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(plain_weights, weights))
    for a, b in zip(plain_opt.state.values(), opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq"))
    with ampdoctor.load(str(path)) as run:
        test = run.lr_range
    assert test is not None and not test.note, test
    counted = BATCH * (SEQ - 3)  # the last two targets of each row are padding
    assert test.loss.startswith(f"the sum of the {BATCH * (SEQ - 1) // 8} cross_entropy "
                                f"calls' elements over the {counted} targets"), test.loss
    # the trial's loss is in the run's units: the first weights' loss on the failing batch
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB))
    ids, targets = _batches(test.event_step + 1)[-1]
    with torch.no_grad():
        start = chunked(model(ids)[..., :-1, :], targets[..., 1:]).item()
    assert test.rungs[0].losses[0] == pytest.approx(start, rel=1e-4)
    assert any(LrRange.trains(r) for r in test.rungs)


def test_the_dose_is_tried_and_trains_when_applied(rising):
    path, (losses, _, _) = rising
    fx = next(fx for fx in ampdoctor.diagnose(str(path)).fixes if fx.id == "lower_lr")
    assert "tried: LR " in fx.source and "over 12 steps" in fx.source, fx.source
    treated, _, _ = _train(RISING_LR * fx.values["lr_factor"])
    assert max(treated) < lrrange.RISE * treated[0]
    assert np.mean(treated[-5:]) < np.mean(losses[-5:]), (treated, losses)


def test_a_loss_no_combination_of_its_calls_gives_keeps_the_dose_a_bound(tmp_path):
    _train(RISING_LR, tmp_path / "run.h5", extra=0.5)
    with ampdoctor.load(str(tmp_path / "run.h5")) as run:
        test = run.lr_range
    assert test is not None and not test.rungs
    assert "no combination of the step's" in test.note, test.note


def test_a_loss_divided_after_the_calls_is_combined_by_the_gradient_it_sent(tmp_path):
    """``loss / 2`` (as a script divides by its micro-batches): no plain sum or mean of the
    calls gives it; their elements weighted by the gradient the step sent into each do."""
    _train(RISING_LR, tmp_path / "run.h5", divide=2)
    with ampdoctor.load(str(tmp_path / "run.h5")) as run:
        test = run.lr_range
    assert test is not None and not test.note, test
    assert "each times the gradient the step sent into it" in test.loss, test.loss
    assert any(LrRange.trains(r) for r in test.rungs)
