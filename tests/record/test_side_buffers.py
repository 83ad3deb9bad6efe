"""Buffers the sampled steps alone cannot judge (``record/buffers.py``): the start check, which
tells a statistic poisoned by the first step from a constant, and the buffers of a frozen model
the step runs beside the trained one (a feature extractor left in train(), whose fp16
BatchNorm statistics overflow), which are sampled with the model's. Recorded runs stay
bit-identical to plain ones.
"""

import torch

import ampdoctor
from ampdoctor.record.buffers import nonfinite_at_start
from ampdoctor.runfile.schema import Kind


def test_the_start_check_names_the_non_finite_floating_buffers_and_reads_no_placeholder():
    named = [("mask", torch.full((2, 2), float("-inf"))), ("ok", torch.ones(3)),
             ("count", torch.tensor(5)), ("nan", torch.tensor([0.0, float("nan")]))]
    assert nonfinite_at_start(named) == ["mask", "nan"]
    assert nonfinite_at_start([("ok", torch.ones(2))]) == []
    assert nonfinite_at_start([("m", torch.ones(2, device="meta"))]) is None


def _nets():
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                   torch.nn.ReLU()).requires_grad_(False)
    with torch.no_grad():
        backbone[0].weight.mul_(1500.0)  # activations whose variance passes fp16's max
    backbone = backbone.half()
    head = torch.nn.Linear(8, 3)
    mask = torch.nn.Module()
    mask.register_buffer("causal", torch.full((2, 2), float("-inf")))
    head.extra = mask  # a constant buffer of the trained model, -inf by design
    return backbone, head, torch.optim.SGD(head.parameters(), lr=0.1)


def _loop(backbone, head, opt, steps=4):
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)
        feats = backbone(x.half()).float()  # frozen, in train(): its statistics update
        loss = torch.nn.functional.cross_entropy(head(feats), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_a_frozen_backbone_beside_the_model_has_its_buffers_sampled_and_checked(tmp_path):
    plain = _loop(*_nets())
    backbone, head, opt = _nets()
    path = str(tmp_path / "side.h5")
    with ampdoctor.watch(path=path, every=1):
        losses = _loop(backbone, head, opt)
    assert losses == plain  # the side model is read, never changed
    run = ampdoctor.load(path)
    assert run.roots == ["Linear"]  # the trained model is still the only root
    names = [run.tensor_name(int(t)) for t, k in zip(run.tensors["id"], run.tensors["kind"])
             if k == Kind.BUFFER]
    assert "backbone.1.running_var" in names  # named as the script holds it
    assert run.buffers is not None
    assert run.buffers.nonfinite_at_start == ["extra.causal"]  # before any forward
    assert run.buffers.unchecked == []
    assert not torch.isfinite(backbone[1].running_var).all()  # the run did overflow it


def test_the_diagnosis_tells_the_outgrown_fp16_statistic_from_the_constant_mask(tmp_path):
    backbone, head, opt = _nets()
    path = str(tmp_path / "side.h5")
    with ampdoctor.watch(path=path, every=1):
        _loop(backbone, head, opt, steps=3)
    d = ampdoctor.diagnose(path)
    assert d.verdict == "state_poisoning"
    assert d.first_bad["module"] == "backbone.1"
    assert [f.id for f in d.fixes][0] == "fp32_buffers"
    assert "extra.causal" not in d.summary
