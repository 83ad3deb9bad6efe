"""Copies of a model that are not the model trained: a FLOP count on ``meta``, a run under
``FakeTensorMode``, a model run and dropped before the real one, EMA and evaluation deepcopies,
``torch.func.functional_call``. None is adopted as the model, none stops the recording, and a
module whose recording fails while the model is discovered is left out, the rest recorded.

(fixtures/copies/ and tests/integration/test_copies_recorded.py run the same through
``ampdoctor record``.)
"""

import copy
import io

import numpy as np
import pytest
import torch
from helpers import TinyNet, batches, fresh, train

import ampdoctor
from ampdoctor.record.torchcompat import placeholder
from ampdoctor.runfile.schema import Event


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def run_loop(model, opt, steps=4, before=None):
    """A loop that leaves the model to be discovered; ``before(step)`` runs first each step."""
    losses = []
    for step, (x, y) in enumerate(batches(steps)):
        if before is not None:
            before(step, model)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def recorded(run_path, before=None, steps=4):
    """The loop plain and under watch() with nothing given: (plain, recorded) losses and
    weights, and the run file."""
    plain_model, plain_opt = fresh()
    plain = run_loop(plain_model, plain_opt, steps, before)
    model, opt = fresh()
    with ampdoctor.watch(path=run_path, every=1):
        losses = run_loop(model, opt, steps, before)
    assert losses == plain
    for a, b in zip(weights(model), weights(plain_model)):
        assert torch.equal(a, b)
    return losses, ampdoctor.load(run_path)


def assert_model_recorded(run, losses):
    assert run.roots == ["TinyNet"]
    assert run.steps["micro"].tolist() == [1] * len(losses)
    np.testing.assert_array_equal(run.steps["loss"], np.array(losses, dtype=np.float32))
    assert Event.RECORDER_ERROR not in list(run.events["kind"])
    assert run.skipped_modules == []


def test_placeholder_tells_meta_and_fake_tensors_from_real_ones():
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert placeholder(torch.empty(2, device="meta"))
    with FakeTensorMode():
        fake = torch.empty(2)
    assert placeholder(fake) and not placeholder(torch.empty(2)) and not placeholder(None)


def test_a_flop_count_on_meta_before_training_is_not_the_model(run_path):
    """Lightning's measure_flops (litgpt pretrain): a copy on meta, forward and backward
    under FlopCounterMode. Autocast knows no meta device: adopted, it stopped the recording."""
    from torch.utils.flop_counter import FlopCounterMode

    def count(step, model):
        if step == 0:
            with torch.device("meta"):
                meta = TinyNet()
            with FlopCounterMode(display=False):
                meta(torch.empty(8, 16, device="meta")).sum().backward()

    losses, run = recorded(run_path, count)
    assert_model_recorded(run, losses)


def test_a_copy_run_under_fake_tensor_mode_is_not_the_model(run_path):
    from torch._subclasses.fake_tensor import FakeTensorMode

    def fake_run(step, model):
        with FakeTensorMode():
            copy_ = TinyNet()
            copy_(torch.randn(8, 16)).sum().backward()

    losses, run = recorded(run_path, fake_run)
    assert_model_recorded(run, losses)


def test_a_model_run_and_dropped_before_the_real_one_leaves_step_0(run_path):
    """Adopted in the first step with the real model, then dropped (no optimizer trains it):
    its micro-batch leaves step 0, whose loss is the real model's alone."""
    def throwaway(step, model):
        if step == 0:
            small = TinyNet()
            x, y = next(iter(batches(1, seed=3)))
            torch.nn.functional.cross_entropy(small(x), y).backward()

    losses, run = recorded(run_path, throwaway)
    assert_model_recorded(run, losses)
    assert run.meta.get("losses") is None  # one loss: the throwaway's is forgotten


def test_ema_and_evaluation_deepcopies_carry_no_hooks_and_are_not_recorded(run_path):
    ema = {}

    def copies(step, model):
        with torch.no_grad():
            if step == 1:
                ema["model"] = copy.deepcopy(model)
                assert not ema["model"]._forward_pre_hooks  # ours stayed on the original
            if "model" in ema:
                for e, p in zip(ema["model"].parameters(), model.parameters()):
                    e.lerp_(p, 0.1)
                ema["model"](next(iter(batches(1)))[0])
            copy.deepcopy(model).eval()(next(iter(batches(1)))[0])

    losses, run = recorded(run_path, copies)
    assert_model_recorded(run, losses)


def test_functional_call_of_the_model_is_named_by_its_own_parameters(run_path):
    """functional_call swaps in other tensors for the call: adopted inside it, the model is
    named again by its own parameters once the step's optimizer is known."""
    def functional(step, model):
        params = {k: v.detach() for k, v in model.named_parameters()}
        torch.func.functional_call(model, params, (next(iter(batches(1)))[0],))

    losses, run = recorded(run_path, functional)
    assert_model_recorded(run, losses)
    names = {n for n in run.tensors["name"].astype(str)}
    assert "fc1.weight" in names and not any(n.startswith("param") for n in names)


def test_the_whole_model_pickles_while_recorded(run_path):
    """torch.save(model) pickles the model's hooks: ours are left out of its state."""
    model, opt = fresh()
    with ampdoctor.watch(path=run_path):
        run_loop(model, opt, 2)
        buf = io.BytesIO()
        torch.save(model, buf)
        assert model._forward_pre_hooks  # still recording
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert not loaded._forward_pre_hooks and not loaded._forward_hooks


class Unrecordable(torch.nn.Module):
    """A side model whose recording fails: asking for its parameters raises (a stand-in for
    any internal error on a module that is not the one trained)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 4)

    def parameters(self, recurse=True):
        raise RuntimeError("no parameters here")

    def forward(self, x):
        return self.lin(x)


def test_a_module_whose_recording_fails_is_left_out_and_the_rest_recorded(run_path):
    side = Unrecordable()

    def side_call(step, model):
        side(next(iter(batches(1)))[0])  # with grad: discovery looks at it, every step

    model, opt = fresh()
    with pytest.warns(RuntimeWarning, match="could not record Unrecordable"):
        with ampdoctor.watch(path=run_path, every=1):
            losses = run_loop(model, opt, 3, side_call)
    run = ampdoctor.load(run_path)
    assert run.roots == ["TinyNet"] and len(run.steps) == 3
    assert Event.RECORDER_ERROR not in list(run.events["kind"])
    assert [s["module"] for s in run.skipped_modules] == ["Unrecordable"]
    assert "no parameters here" in run.skipped_modules[0]["why"]
    np.testing.assert_array_equal(run.steps["loss"], np.array(losses, dtype=np.float32))
    d = ampdoctor.diagnose(run_path)
    assert d.verdict != "recording_stopped"
    assert any("left out a module it could not record, Unrecordable" in n for n in d.notes)


def test_strict_mode_raises_where_a_module_is_skipped(run_path):
    from ampdoctor.errors import RecorderFault

    side = Unrecordable()
    model, opt = fresh()
    with pytest.raises(RecorderFault, match="no parameters here"):
        with ampdoctor.watch(path=run_path, strict=True):
            side(next(iter(batches(1)))[0])
            train(model, opt, None, steps=1, dtype=None)
