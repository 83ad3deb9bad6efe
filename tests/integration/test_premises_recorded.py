"""Premises on recorded runs, where what the recorder writes matters (issue 28): a model that
keeps its causal attention mask as a buffer filled with -inf (open_clip does) trains healthily,
and the buffer's sampled statistics tell a constant from a poisoned statistic; a gradient norm
that overflows over finite gradients is not the machine; and fp16 weights stepped by SGD
(timm's ``--model-dtype float16``) lose their updates although a zero-initialised residual
branch gets no gradient on the one step the default interval samples; and bf16 weights whose
one sampled step ran at a warm-up's LR of 0 lose no update there; and adapters at a huge LR
whose run fails before its second sample overflow from the LR (the replay's activations)."""

import json
import textwrap

import numpy as np
import pytest
from recording import record

import ampdoctor
from ampdoctor.record.recorder import DEFAULT_EVERY
from ampdoctor.runfile.schema import Kind

pytestmark = pytest.mark.slow

MASKED = textwrap.dedent('''
    import torch, torch.nn as nn, torch.nn.functional as F

    class Causal(nn.Module):
        def __init__(self, d=16, n=8):
            super().__init__()
            self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, 4)
            # open_clip's build_causal_mask: -inf above the diagonal, kept as a buffer
            self.register_buffer("attn_mask", torch.full((n, n), float("-inf")).triu(1),
                                 persistent=False)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, -1)
            a = F.softmax(q @ k.transpose(-1, -2) / 4 + self.attn_mask, -1)
            return self.out((a @ v).mean(1))

    torch.manual_seed(0)
    model = Causal()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    for step in range(12):
        x = torch.randn(16, 8, 16, generator=g)
        y = (x[:, 0, :4].argmax(-1))
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
''')


def test_a_causal_mask_buffer_of_minus_inf_is_not_state_poisoning(tmp_path):
    script = tmp_path / "causal.py"
    script.write_text(MASKED)
    out = str(tmp_path / "run.h5")
    proc = record(str(script), out, every=5)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = ampdoctor.diagnose(out)
    assert d.verdict == "healthy", str(d)
    rejected = json.loads(json.dumps(d.to_dict()))["rejected"]
    assert [r["verdict"] for r in rejected] == ["state_poisoning"]
    premise = rejected[0]["premises"][0]
    assert premise["name"] == "buffer_was_finite" and premise["status"] == "failed"
    # told from the start check (/meta buffers): non-finite before the first forward
    assert "attn_mask was already non-finite before the first forward" in premise["fact"]
    assert ampdoctor.load(out).buffers.nonfinite_at_start == ["Causal.attn_mask"]


NORM = textwrap.dedent('''
    import torch, torch.nn as nn, torch.nn.functional as F

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-30)
    g = torch.Generator().manual_seed(1)
    for step in range(8):
        x = torch.randn(32, 64, generator=g)
        # step 5's loss is weighted 3e20: each gradient stays finite (~1e19), their fp32 norm
        # does not
        weight = 3e20 if step == 5 else 1.0
        loss = weight * F.mse_loss(model(x), torch.zeros(32, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
''')


def test_a_gradient_norm_that_overflows_over_finite_gradients_is_not_the_machine(tmp_path):
    """fp32, no scaler: the step's loss is finite, its recorded gradient norm +inf, and the
    replay finds every gradient finite (before issue 28: not_reproducible, 'the machine')."""
    script = tmp_path / "norm.py"
    script.write_text(NORM)
    out = str(tmp_path / "run.h5")
    proc = record(str(script), out, every=1)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = ampdoctor.diagnose(out)
    assert d.verdict != "not_reproducible", str(d)
    assert "machine" not in d.summary.replace("not the machine", "")
    rejected = {r["verdict"]: r for r in json.loads(json.dumps(d.to_dict()))["rejected"]}
    same = rejected["not_reproducible"]["premises"][0]
    assert same["name"] == "same_quantity" and same["status"] == "failed"
    assert "step 5's loss was finite" in same["fact"] and "+inf" in same["fact"]
    assert d.first_bad["step"] == 5
    assert any(e.key == "norm_overflow" for e in d.evidence)


HALF_RESNET = textwrap.dedent('''
    import torch, torch.nn as nn, torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
            self.norm = nn.LayerNorm(d)
            nn.init.zeros_(self.norm.weight)  # timm's zero_init_last

        def forward(self, x):
            return x + self.norm(self.fc2(F.relu(self.fc1(x))))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), Block(32), nn.Linear(32, 4)).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for step in range(24):
        for group in opt.param_groups:  # timm's warm-up epoch at 1e-5
            group["lr"] = 1e-5 if step < 8 else 0.05
        x = torch.randn(16, 8, generator=g)
        loss = F.cross_entropy(model(x.half()).float(), x[:, :4].argmax(1))
        loss.backward()
        opt.step()
        opt.zero_grad()
''')


def _recorded_params(tmp_path, name, source):
    """``source`` written to ``name`` and recorded at the default interval: the run file's
    path, the run, and its parameters' /stats rows."""
    script = tmp_path / name
    script.write_text(source)
    out = str(tmp_path / "run.h5")
    proc = record(str(script), out, every=DEFAULT_EVERY)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = ampdoctor.load(out)
    kinds = dict(zip(run.tensors["id"], run.tensors["kind"]))
    return out, run, run.stats[[kinds[t] == Kind.PARAM for t in run.stats["tensor"]]]


def test_fp16_weights_under_sgd_behind_a_zero_initialised_branch_lose_their_updates(tmp_path):
    """The whole model .half(), SGD, no scaler, recorded at the default interval: step 0 alone
    is sampled, where the branch's two Linear layers (4192 of the model's 4676 weights) get
    an all-zero gradient. The recorder says their unchanged share is not measured (NaN), and the
    rest of the weights' updates round away (before: 0.0 for them, and healthy)."""
    out, run, params = _recorded_params(tmp_path, "half_resnet.py", HALF_RESNET)
    assert set(params["step"]) == {0}
    behind = {run.tensor_name(int(t)) for t, u in zip(params["tensor"], params["unchanged"])
              if np.isnan(u)}
    assert behind == {"1.fc1.weight", "1.fc1.bias", "1.fc2.weight", "1.fc2.bias"}
    d = ampdoctor.diagnose(out)
    assert d.verdict == "lost_updates", str(d)
    premise = d.to_dict()["premises"][0]
    assert premise["name"] == "at_peak_lr" and premise["status"] == "not measured"
    assert "at LR 1e-05 or below (sampled step 0), 5000x below the run's peak LR 0.05" in \
        premise["fact"]


BF16_WARMUP = textwrap.dedent('''
    import torch, torch.nn as nn, torch.nn.functional as F

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)).bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # litgpt finetune_lora's warm-up: LambdaLR(step / warmup_steps), so step 0 runs at LR 0
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, step / 2))
    g = torch.Generator().manual_seed(1)
    for step in range(12):
        x = torch.randn(32, 8, generator=g)
        loss = F.cross_entropy(model(x.bfloat16()).float(), x[:, :4].argmax(1))
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
''')


def test_bf16_weights_sampled_only_at_a_warm_up_step_of_lr_0_lose_no_update(tmp_path):
    """bf16 weights stepped by AdamW at 1e-2 (above half an ulp of each weight), recorded at
    the default interval: step 0 alone is sampled, and its LR is 0, so the step leaves every
    weight unchanged in any precision. That says nothing of rounding: healthy (before: a
    ZeroDivisionError in lost_updates' at_peak_lr premise, then lost_updates at 0.6 once it
    gave way; litgpt finetune_lora --precision bf16-true)."""
    out, run, params = _recorded_params(tmp_path, "bf16_warmup.py", BF16_WARMUP)
    assert set(params["step"]) == {0} and run.steps["lr"][0] == 0
    assert np.all(params["unchanged"][np.isfinite(params["unchanged"])] == 1.0)
    d = ampdoctor.diagnose(out)
    assert d.verdict == "healthy", str(d)


LORA_WARMUP = textwrap.dedent('''
    import torch, torch.nn as nn, torch.nn.functional as F

    torch.manual_seed(0)


    class LoRALinear(nn.Module):
        """A frozen Linear plus a rank-4 adapter whose B starts at 0 (litgpt's LoRALinear)."""

        def __init__(self, d, out, r=4):
            super().__init__()
            self.linear = nn.Linear(d, out).requires_grad_(False)
            self.A = nn.Parameter(torch.randn(r, d) / d ** 0.5)
            self.B = nn.Parameter(torch.zeros(out, r))

        def forward(self, x):
            return self.linear(x) + 2 * (x @ self.A.t()) @ self.B.t()


    class Block(nn.Module):
        def __init__(self, d=16):
            super().__init__()
            self.qkv = LoRALinear(d, 3 * d)
            self.norm = nn.LayerNorm(d).requires_grad_(False)
            self.head = nn.Linear(d, 4).requires_grad_(False)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, -1)
            a = F.softmax(q @ k.transpose(-1, -2) / 4, -1)
            return self.head(self.norm(x + a @ v).mean(1))


    model = Block()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e4)
    # litgpt finetune_lora's warm-up: LambdaLR(step / warmup_steps), so step 0 runs at LR 0
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, step / 2))
    g = torch.Generator().manual_seed(1)
    for step in range(12):
        x = torch.randn(16, 8, 16, generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float(), x[:, 0, :4].argmax(-1))
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
''')


def test_a_lora_run_at_a_huge_lr_that_fails_before_its_second_sample_is_lr_overflow(tmp_path):
    """A rank-4 adapter on a frozen attention block's qkv, AdamW at LR 1e4 after a warm-up from
    LR 0, recorded at the default interval: step 0 (LR 0) is the one sampled step, the loss
    stays within 10% of its start (a LayerNorm bounds it) until the gradient norm is inf and
    then the loss NaN, and the replay of the failing step sees the adapted qkv's output grown
    by orders of magnitude. That growth, beside the LR's rise from 0, is lr_overflow, the
    premise that the weights grew held (before: nonfinite 0.3, no growth signal measured;
    litgpt finetune_lora at LR 100)."""
    script = tmp_path / "lora_warmup.py"
    script.write_text(LORA_WARMUP)
    out = str(tmp_path / "run.h5")
    proc = record(str(script), out, every=DEFAULT_EVERY)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = ampdoctor.load(out)
    assert set(run.stats["step"][run.stats["source"] == 0]) == {0}
    d = ampdoctor.diagnose(out)
    assert d.verdict == "lr_overflow", str(d)
    keys = [e.key for e in d.evidence]
    assert "activation_growth" in keys and "lr_rise" in keys, keys
    assert "(the replay of the failing step)" in next(
        e.text for e in d.evidence if e.key == "activation_growth")
    assert d.premises[0].name == "weights_grew" and d.premises[0].status == "held"
