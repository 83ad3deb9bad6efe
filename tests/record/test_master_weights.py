"""fp32 master weights kept by hand (apex's O2, Megatron's fp16 optimizer, pytorch#120376): a
model stored in bf16 whose optimizer steps fp32 copies of its parameters, the bf16 gradients
copied into them and the result cast back into the model. None of the optimizer's tensors is
the model's, yet its steps are the run's: recorded as any run's (steps, loss, LR, each copy
under its parameter's name), the training bit-identical to the same loop without ampdoctor
(``record/mirrors.py``), a model run and dropped before the real one left out of the first
step. An optimizer of copies beside one that steps the model itself is not the run's.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import TinyNet, batches

import ampdoctor
from ampdoctor.record import mirrors
from ampdoctor.runfile.schema import Event, Kind

STEPS = 4


def master_loop(decay_groups: bool = False, throwaway: bool = False):
    """A bf16 TinyNet trained through fp32 master copies; its losses, model and copies.
    ``throwaway``: a model run and dropped in the first step, before the real one."""
    torch.manual_seed(0)
    if throwaway:
        x, y = next(iter(batches(1, seed=3)))
        F.cross_entropy(TinyNet()(x), y).backward()
    model = TinyNet().to(torch.bfloat16)
    params = list(model.parameters())
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    if decay_groups:  # the usual split: weights decayed, biases not (the model's order kept)
        groups = [{"params": [m for m in master if m.dim() > 1], "weight_decay": 0.01},
                  {"params": [m for m in master if m.dim() <= 1], "weight_decay": 0.0}]
    else:
        groups = [{"params": master}]
    opt = torch.optim.AdamW(groups, lr=1e-3)
    losses = []
    for x, y in batches(STEPS):
        loss = F.cross_entropy(model(x.to(torch.bfloat16)).float(), y)
        for p in params:
            p.grad = None
        loss.backward()
        for p, m in zip(params, master):
            m.grad = p.grad.float()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m.to(p.dtype))
        losses.append(loss.item())
    return losses, model, master


@pytest.mark.parametrize("decay_groups,throwaway", [(False, False), (True, False),
                                                    (False, True)])
def test_an_optimizer_of_fp32_master_copies_is_the_runs(run_path, decay_groups, throwaway):
    plain, plain_model, plain_master = master_loop(decay_groups, throwaway)
    with ampdoctor.watch(path=run_path, every=1):  # nothing given: found, as `record` does
        losses, model, master = master_loop(decay_groups, throwaway)
    assert losses == plain
    for a, b in zip([*model.parameters(), *master], [*plain_model.parameters(), *plain_master]):
        assert torch.equal(a, b)

    run = ampdoctor.load(run_path)
    assert run.roots == ["TinyNet"]
    assert len(run.steps) == STEPS
    np.testing.assert_array_equal(run.steps["loss"], np.array(losses, dtype=np.float32))
    np.testing.assert_allclose(run.steps["lr"], 1e-3)
    assert np.isfinite(run.steps["grad_norm"]).all()
    assert Event.RECORDER_ERROR not in list(run.events["kind"])
    tensors = run.tensors
    named = {str(n) for n, k in zip(tensors["name"], tensors["kind"]) if k == Kind.PARAM}
    assert named == {n for n, _ in model.named_parameters()}  # the copies under their names
    assert ampdoctor.diagnose(run_path).verdict == "healthy"


def test_copies_beside_an_optimizer_of_the_model_itself_are_not_the_runs(run_path):
    """Slow weights kept by a second optimizer (a Lookahead written by hand): the run's
    optimizer is the one that steps the model; the copies' is not adopted beside it."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    slow = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    slow_opt = torch.optim.SGD(slow, lr=0.5)
    with ampdoctor.watch(path=run_path):
        for x, y in batches(STEPS):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            for s, p in zip(slow, model.parameters()):
                s.grad = s.detach() - p.detach()
            slow_opt.step()
    run = ampdoctor.load(run_path)
    assert len(run.steps) == STEPS
    assert [(o["class"], o["hyper"]["lr"]) for o in run.meta["optimizer"]] == [("SGD", 0.1)]


def test_match_pairs_copies_shape_by_shape_and_refuses_anything_else():
    model = [torch.zeros(3, 2), torch.zeros(3), torch.zeros(2, 3), torch.zeros(3)]
    copies = [t.clone() for t in model]
    reordered = [copies[0], copies[2], copies[1], copies[3]]  # weights, then biases
    assert mirrors.match(reordered, model) == {
        id(copies[0]): id(model[0]), id(copies[2]): id(model[2]),
        id(copies[1]): id(model[1]), id(copies[3]): id(model[3])}
    # apex's O2: the half weights' copies beside an fp32 parameter stepped as it is
    assert mirrors.match([*copies[:3], model[3]], model) == {
        id(copies[i]): id(model[i]) for i in range(3)}
    assert mirrors.match(copies[:3], model) == {}  # a part of the model
    assert mirrors.match([*copies[:3], torch.zeros(4)], model) == {}  # another shape
    assert mirrors.match(model, model) == {}  # the model's own: no copies
    assert mirrors.match([], []) == {}
