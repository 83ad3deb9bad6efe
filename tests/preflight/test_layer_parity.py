"""ampdoctor.parity: each module judged alone in bf16/fp16 against fp32. Known fragile modules
rank first, a plain MLP is ok everywhere, the caller's model is unchanged, the result renders
(text, Markdown, HTML, JSON, the release report) and the CLI runs a user's script."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import python_env

import ampdoctor
from ampdoctor import cli
from ampdoctor.errors import AmpDoctorError
from ampdoctor.preflight import parity_result

BF16, FP16 = torch.bfloat16, torch.float16


class Cancel(nn.Module):
    """Catastrophic cancellation: x + 1000 in bf16 keeps about two significant bits of x."""

    def forward(self, x):
        return (x + 1000) - 1000


class Attention(nn.Module):
    """Attention without the 1/sqrt(d) scale, called with kwargs and non-tensor arguments
    (mask=..., causal=True). Two ways to large logits: ``gain`` scales q and k (fp16: q @ k^T
    passes 65504), ``sink`` adds one large component to every key (logits in the hundreds
    that differ by a few units: bf16 rounds the differences away)."""

    def __init__(self, d, gain=1.0, sink=0.0):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.gain = gain
        self.register_buffer("sink", torch.zeros(d))
        self.sink[0] = sink

    def forward(self, x, mask=None, causal=False):
        q, k = self.q(x) * self.gain, self.k(x) * self.gain + self.sink
        scores = q @ k.transpose(-1, -2)
        if causal:
            t = x.shape[-2]
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1),
                                        float("-inf"))
        if mask is not None:
            scores = scores + mask
        return self.o(torch.softmax(scores, -1) @ self.v(x))


class Block(nn.Module):
    def __init__(self, d, **attn):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = Attention(d, **attn)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, mask):
        x = x + self.attn(self.norm(x), mask=mask, causal=True)
        return x + self.mlp(x)


class TinyModel(nn.Module):
    """Embedding, two blocks (the second one's attention as asked), a head; returns a dict
    (as HF models return ModelOutput)."""

    def __init__(self, d=16, vocab=32, **attn):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d), Block(d, **attn)])
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        mask = torch.zeros(ids.shape[-1], ids.shape[-1])
        for block in self.blocks:
            x = block(x, mask)
        return {"logits": self.head(x), "hidden": (x, None)}


class RMSNorm(nn.Module):
    """A norm whose eps (1e-12) is 0 in fp16: small activations make rsqrt(0) = inf."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-12)


def mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32),
                         nn.ReLU(inplace=True), nn.Linear(32, 4))  # in place: judged too


def seeded(make):
    torch.manual_seed(0)
    return make()


def ce(y):
    return lambda out: F.cross_entropy(out, y)


def lm_loss(ids):
    return lambda out: F.cross_entropy(out["logits"].flatten(0, 1).float(), ids.flatten())


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_a_plain_mlp_is_ok_everywhere(dtype):
    model = seeded(mlp)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    r = ampdoctor.parity(model, x, dtype, loss_fn=ce(y))
    assert r.verdict == "ok" and r.worst is None and r.fixes == []
    assert {m.verdict for m in r.modules} == {"ok"}
    assert {m.name for m in r.modules} == {"0", "1", "2", "3", "4"}  # Sequential left out
    roundoff = parity_result.UNIT_ROUNDOFF[r.dtype]
    for m in r.modules:
        assert 0 < m.rel_err < 4 * roundoff and 0 < m.grad_rel_err < 4 * roundoff, m
    assert r.output_rel_err < 4 * roundoff and r.output_nonfinite == 0
    assert math.isclose(r.loss_fp32, r.loss_low, rel_tol=0.01)


def test_catastrophic_cancellation_ranks_first_in_bf16():
    model = seeded(lambda: nn.Sequential(nn.Linear(16, 16), Cancel(), nn.Linear(16, 4)))
    r = ampdoctor.parity(model, torch.randn(8, 16), BF16)
    first = r.modules[0]
    assert (first.name, first.type, first.verdict) == ("1", "Cancel", "lossy")
    assert first.rel_err > 0.5 and all(m.verdict == "ok" for m in r.modules[1:])
    fix = r.fixes[0]
    assert fix.id == "fp32_island" and "model[1] = FP32Island(model[1])" in fix.snippet


@pytest.mark.parametrize("dtype,attn,verdict", [(FP16, {"gain": 300.0}, "overflows"),
                                                (BF16, {"sink": 300.0}, "lossy")])
def test_a_large_logit_attention_ranks_first(dtype, attn, verdict):
    model = seeded(lambda: TinyModel(**attn))
    ids = torch.randint(0, 32, (2, 8))
    r = ampdoctor.parity(model, ids, dtype, loss_fn=lm_loss(ids))
    first = r.modules[0]
    assert (first.name, first.type, first.verdict) == ("blocks.1.attn", "Attention", verdict)
    ok = {m.name for m in r.modules if m.verdict == "ok"}
    assert {"blocks.0.attn", "blocks.0.attn.q", "head", "emb"} <= ok  # the same code, small
    assert [f.id for f in r.fixes] == ["fp32_island", "scale_attention"]
    assert "for block in model.blocks:" in r.fixes[0].snippet
    if dtype == FP16:
        assert first.nonfinite > 0


def test_a_norm_with_a_tiny_eps_ranks_first_in_fp16():
    model = seeded(lambda: nn.Sequential(nn.Linear(16, 16, bias=False), RMSNorm(),
                                         nn.Linear(16, 4)))
    r = ampdoctor.parity(model, torch.randn(8, 16) * 1e-4, FP16)
    first = r.modules[0]
    assert (first.type, first.verdict) == ("RMSNorm", "overflows") and first.nonfinite > 0
    assert all(m.verdict == "ok" for m in r.modules[1:])


class Upcast(nn.Module):
    def forward(self, x):
        return x.float()


def test_each_module_gets_its_inputs_in_the_dtype_autocast_gives_it():
    """Cancel after an fp32 upcast computes in fp32 under autocast: harmless, and judged so;
    the same module right after a Linear gets bf16 and is lossy."""
    model = seeded(lambda: nn.Sequential(nn.Linear(16, 16), Upcast(), Cancel()))
    r = ampdoctor.parity(model, torch.randn(8, 16), BF16)
    assert r.verdict == "ok", str(r)
    assert {m.type for m in r.modules} == {"Linear", "Upcast", "Cancel"}


def _state(model):
    return ([p.detach().clone() for p in model.parameters()],
            [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            [b.clone() for b in model.buffers()], [m.training for m in model.modules()],
            torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b) and a.dtype == b.dtype
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_the_callers_model_grad_and_rng_are_unchanged():
    model = seeded(lambda: nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.3),
                                         Cancel(), nn.Linear(16, 4)))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    F.cross_entropy(model(x), y).backward()  # .grad holds something to keep
    model[4].eval()
    grads = [p.grad for p in model.parameters()]
    before = _state(model)
    r = ampdoctor.parity(model, x, BF16, loss_fn=ce(y))
    after = _state(model)
    for a, b in zip(before, after):
        assert _equal(a, b)
    assert all(g is p.grad for g, p in zip(grads, model.parameters()))
    assert r.modules[0].name == "3"
    assert any("dropout is active" in n for n in r.notes)
    # the dropout masks of the fp32 pass are replayed: Dropout itself loses nothing
    drop = next(m for m in r.modules if m.type == "Dropout")
    assert drop.verdict == "ok" and drop.rel_err < 0.01


def test_the_result_renders_and_round_trips_through_json(tmp_path):
    model = seeded(lambda: nn.Sequential(nn.Linear(16, 16), Cancel(), nn.Linear(16, 4)))
    r = ampdoctor.parity(model, torch.randn(8, 16), "bf16")
    text = str(r)
    assert text.startswith("parity: lossy\n") and "1 (Cancel): output relative error" in text
    assert "model[1] = FP32Island(model[1])" in text
    assert "| 1 | Cancel | lossy |" in r._repr_markdown_()
    page = r._repr_html_()
    assert "<td>Cancel</td><td>lossy</td>" in page and "FP32Island" in page
    path = tmp_path / "parity.json"
    path.write_text(r.json())
    back = parity_result.load(str(path))
    assert [(m.name, m.verdict) for m in back.modules] == [(m.name, m.verdict) for m in r.modules]
    assert back.to_dict()["fixes"] == r.to_dict()["fixes"]
    json.loads(path.read_text())  # strict JSON: no NaN or Infinity
    (tmp_path / "other.json").write_text('{"verdict": "healthy"}')
    with pytest.raises(AmpDoctorError, match="is not a parity result"):
        parity_result.load(str(tmp_path / "other.json"))


def test_bad_input_is_one_sentence():
    model = nn.Linear(4, 2)
    with pytest.raises(AmpDoctorError, match="bfloat16 or float16, not torch.float64"):
        ampdoctor.parity(model, torch.randn(2, 4), torch.float64)
    with pytest.raises(AmpDoctorError, match="must return a scalar tensor"):
        ampdoctor.parity(model, torch.randn(2, 4), loss_fn=lambda out: out)
    with pytest.raises(AmpDoctorError, match="weight is torch.float16"):
        ampdoctor.parity(nn.Linear(4, 2).half(), torch.randn(2, 4))


SCRIPT = '''
import torch, torch.nn as nn, torch.nn.functional as F


class Cancel(nn.Module):
    def forward(self, x):
        return (x + 1000) - 1000


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Cancel(), nn.Linear(16, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    return model, x, lambda out: F.cross_entropy(out, y)


def broken():
    return {}


if __name__ == "__main__":
    raise SystemExit("the training block must not run")
'''


def test_cli_runs_a_script_and_the_report_shows_it(tmp_path, capsys):
    script = tmp_path / "check.py"
    script.write_text(SCRIPT)
    assert cli.main(["parity", f"{script}:make"]) == 0
    assert "1       Cancel  lossy" in capsys.readouterr().out
    out = tmp_path / "parity.json"
    assert cli.main(["parity", f"{script}:make", "--format", "json", "-o", str(out),
                     "--fail-on", "lossy"]) == 1
    assert json.loads(out.read_text())["verdict"] == "lossy"
    assert cli.main(["parity", f"{script}:make", "--fail-on", "overflows"]) == 0
    assert cli.main(["parity", f"{script}:broken"]) == 2
    assert "must return (model, batch) or (model, batch, loss_fn)" in capsys.readouterr().err
    assert cli.main(["parity", str(tmp_path / "none.py")]) == 2
    assert cli.main(["parity", f"{script}:make", "-o", str(script)]) == 2

    run = str(tmp_path / "run.h5")
    model = seeded(mlp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampdoctor.watch(model, opt, path=run):
        for _ in range(3):
            F.cross_entropy(model(torch.randn(4, 16)), torch.randint(0, 4, (4,))).backward()
            opt.step()
            opt.zero_grad()
    capsys.readouterr()
    assert cli.main(["report", run, "--parity", str(out), "--format", "markdown"]) == 0
    md = capsys.readouterr().out
    assert "## Layer parity in bfloat16: `lossy`" in md and "| 1 | Cancel | lossy |" in md
    with ampdoctor.release_report(run, parity=str(out)) as r:
        assert r.to_dict()["parity"]["verdict"] == "lossy"
    assert cli.main(["report", run, "--parity", str(script), "--format", "json"]) == 2


def test_rendering_a_saved_result_needs_no_torch(tmp_path):
    model = seeded(lambda: nn.Sequential(nn.Linear(16, 16), Cancel(), nn.Linear(16, 4)))
    path = tmp_path / "parity.json"
    path.write_text(ampdoctor.parity(model, torch.randn(8, 16)).json())
    code = ("import sys, ampdoctor; from ampdoctor.preflight import parity_result as p; "
            f"r = p.load({str(path)!r}); text = str(r) + r._repr_html_(); "
            "assert 'torch' not in sys.modules, 'torch imported'; print(r.modules[0].type)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=python_env())
    assert out.stdout.strip() == "Cancel", out.stderr


def test_the_readme_example_overflows_in_fp16_and_is_ok_in_bf16(capsys):
    from conftest import ROOT

    target = os.path.join(ROOT, "fixtures", "examples", "layer_parity.py") + ":make"
    assert cli.main(["parity", target, "--dtype", "float16", "--fail-on", "overflows"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("parity: overflows\n")
    assert "  blocks.1.attn (Attention): " in out and "are inf/NaN in float16" in out
    assert cli.main(["parity", target, "--dtype", "bfloat16", "--fail-on", "lossy"]) == 0
    assert capsys.readouterr().out.startswith("parity: ok\n")


def test_a_transformers_model_built_from_its_config():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=16, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (2, 16))
    before = [p.detach().clone() for p in model.parameters()]
    r = ampdoctor.parity(model, {"input_ids": ids, "labels": ids}, FP16,
                         loss_fn=lambda out: out.loss)  # a ModelOutput, kwargs everywhere
    assert r.verdict == "ok", str(r)
    names = {m.name for m in r.modules}
    assert {"transformer.h.0.attn", "transformer.h.1.mlp.c_fc", "lm_head"} <= names
    assert all(m.grad_rel_err is not None for m in r.modules if m.name == "lm_head")
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.gpu
def test_on_cuda_the_fragile_module_ranks_first():
    model = seeded(lambda: nn.Sequential(nn.Linear(16, 16), Cancel(), nn.Linear(16, 4))).cuda()
    x, y = torch.randn(8, 16, device="cuda"), torch.randint(0, 4, (8,), device="cuda")
    rng = torch.cuda.get_rng_state()
    r = ampdoctor.parity(model, x, BF16, loss_fn=ce(y))
    assert r.device == "cuda" and (r.modules[0].type, r.verdict) == ("Cancel", "lossy")
    assert torch.equal(rng, torch.cuda.get_rng_state())
