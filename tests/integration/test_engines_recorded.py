"""Engines that take the optimizer step themselves, under ``ampdoctor record`` with no change
to the script: DeepSpeed's engine (fixtures/stacks/deepspeed_train.py, fp16 ZeRO-1 on
DeepSpeed's CPU accelerator, two ranks over gloo; bf16 ZeRO-2 in one process) and Megatron-core's
grad scalers under its mixed-precision optimizer's own step, found_inf all-reduce and skip
(fixtures/stacks/megatron_scaler.py, driven on CPU over gloo).

Each run's /steps columns are checked against what the engine itself said at every step (the
script's ``--history``: loss, loss scale, overflow, grad norm, LR), then the diagnosis: healthy
stays healthy, the LR blow-up is lr_overflow, one rank's bad loss is a skipped step on every
rank whose origin is named. Skipped where deepspeed or megatron-core is not installed
(``pip install -e '.[engines]'``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

import numpy as np
import pytest
from conftest import ROOT, python_env
from recording import command

import ampdoctor
from ampdoctor.runfile.schema import Event, flag

pytestmark = pytest.mark.slow
STACKS = os.path.join(ROOT, "fixtures", "stacks")
OWN = flag(Event.OWN_NONFINITE_GRAD)


def needs(module: str) -> None:
    if importlib.util.find_spec(module.split(".")[0]) is None or \
            importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[engines]')")


class Job:
    """A fixture script recorded, with what it logged itself per rank."""

    def __init__(self, folder, script: str, args: list[str], nproc: int = 2, every: int = 5,
                 record: bool = True):
        self.folder = folder
        argv = command(os.path.join(STACKS, script), "run.h5",
                       [*args, "--history", "history.json"], every, nproc)
        if not record:  # the command ampdoctor would have recorded, run as it is
            argv = argv[argv.index("--") + 1:]
        self.proc = subprocess.run(argv, cwd=folder, env=python_env(), capture_output=True,
                                   text=True, timeout=600)
        assert self.proc.returncode == 0, self.proc.stderr[-3000:]
        self.nproc = nproc

    def history(self, rank: int) -> list[dict]:
        with open(self.folder / f"history.rank{rank}.json") as f:
            return json.load(f)

    def path(self, rank: int) -> str:
        return str(self.folder / (f"run.rank{rank}.h5" if self.nproc > 1 else "run.h5"))

    def steps(self, rank: int):
        with ampdoctor.load(self.path(rank)) as run:
            return run.steps

    def diagnose(self):
        return ampdoctor.diagnose(str(self.folder / "run.h5"))


def run(tmp_path_factory, name: str, script: str, args: list[str], **kw) -> Job:
    needs("deepspeed" if script.startswith("deepspeed") else "megatron.core")
    return Job(tmp_path_factory.mktemp(name), script, args, **kw)


@pytest.fixture(scope="module")
def ds_healthy(tmp_path_factory):
    return run(tmp_path_factory, "ds_healthy", "deepspeed_train.py", ["--steps", "12"])


@pytest.fixture(scope="module")
def ds_lr(tmp_path_factory):
    return run(tmp_path_factory, "ds_lr", "deepspeed_train.py",
               ["--lr", "20", "--warmup", "20", "--steps", "16"], every=2)


@pytest.fixture(scope="module")
def ds_bad_rank(tmp_path_factory):
    return run(tmp_path_factory, "ds_bad", "deepspeed_train.py",
               ["--steps", "10", "--bad-rank", "1", "--bad-step", "5"])


def assert_engine_columns(job: Job, rank: int) -> None:
    """The recorded steps are the engine's: loss, loss scale, skips, grad norm and LR."""
    logged, s = job.history(rank), job.steps(rank)
    assert len(s) == len(logged)
    np.testing.assert_array_equal(s["loss"], np.float32([h["loss"] for h in logged]))
    np.testing.assert_array_equal(s["scale"], [h["scale"] for h in logged])
    assert s["skipped"].tolist() == [int(h["overflow"]) for h in logged]
    assert s["found_inf"].tolist() == [int(h["overflow"]) for h in logged]
    np.testing.assert_allclose(s["lr"], [h["lr"] for h in logged], rtol=1e-6)
    applied = s["skipped"] == 0
    np.testing.assert_allclose(s["grad_norm"][applied],
                               np.array([h["grad_norm"] for h in logged])[applied], rtol=1e-5)
    assert np.all(np.isinf(s["grad_norm"][~applied]))  # DeepSpeed's norm of a skipped step


def test_deepspeed_fp16_engine_is_recorded_as_it_ran_and_healthy(ds_healthy):
    for rank in (0, 1):
        assert_engine_columns(ds_healthy, rank)
        s = ds_healthy.steps(rank)
        assert not s["skipped"].any() and np.all(s["scale_after"] >= s["scale"])
    d = ds_healthy.diagnose()
    assert d.verdict == "healthy", str(d)
    assert d.run["world_size"] == 2


def test_deepspeed_trains_exactly_as_without_ampdoctor(ds_healthy, tmp_path_factory):
    plain = run(tmp_path_factory, "ds_plain", "deepspeed_train.py", ["--steps", "12"],
                record=False)
    for rank in (0, 1):  # losses, loss scales, grad norms and LRs bit for bit (JSON text)
        assert json.dumps(plain.history(rank)) == json.dumps(ds_healthy.history(rank))


def test_deepspeed_lr_blowup_is_lr_overflow_named_with_its_rank(ds_lr):
    for rank in (0, 1):
        assert_engine_columns(ds_lr, rank)
    s = ds_lr.steps(0)
    assert s["skipped"].sum() >= 3 and s["scale_after"][-1] < s["scale"][0]
    d = ds_lr.diagnose()
    assert d.verdict == "lr_overflow", str(d)
    assert "overflowed fp16" in str(d)  # the engine's fp16 loss: the run's precision
    origin = d.run["origin_rank"]
    assert origin in (0, 1) and d.first_bad["rank"] == origin
    assert d.evidence[0].text.startswith(f"rank {origin} went non-finite first, at step "
                                         f"{d.first_bad['step']}")
    assert s["skipped"][d.first_bad["step"]] == 1


def test_deepspeed_one_ranks_bad_loss_is_a_skip_on_every_rank_named_with_that_rank(ds_bad_rank):
    for rank in (0, 1):
        assert_engine_columns(ds_bad_rank, rank)
        assert np.flatnonzero(ds_bad_rank.steps(rank)["skipped"]).tolist() == [5]
    bad = ds_bad_rank.steps(1)
    assert not np.isfinite(bad["loss"][5]) and bad["flags"][5] & OWN  # before the all-reduce
    d = ds_bad_rank.diagnose()
    assert d.run["origin_rank"] == 1, str(d)
    assert d.evidence[0].text.startswith("rank 1 went non-finite first, at step 5: a non-finite "
                                         "loss")


def test_deepspeed_bf16_zero2_records_no_loss_scale(tmp_path_factory):
    """bf16 has no loss scale (DeepSpeed keeps a static 1.0): the scale columns stay empty,
    found_inf is the engine's overflow flag; one process, no torchrun."""
    job = run(tmp_path_factory, "ds_bf16", "deepspeed_train.py",
              ["--precision", "bf16", "--stage", "2", "--steps", "6"], nproc=0)
    logged, s = job.history(0), job.steps(0)
    assert len(s) == 6 and np.all(np.isnan(s["scale"])) and np.all(np.isnan(s["scale_after"]))
    np.testing.assert_array_equal(s["loss"], np.float32([h["loss"] for h in logged]))
    np.testing.assert_allclose(s["grad_norm"], [h["grad_norm"] for h in logged], rtol=1e-5)
    assert s["found_inf"].tolist() == [0] * 6 and not s["skipped"].any()
    assert job.diagnose().verdict == "healthy"


@pytest.mark.parametrize("kind,nproc", [("dynamic", 2), ("constant", 0)])
def test_megatron_scalers_found_inf_and_skips_are_recorded_per_rank(tmp_path_factory, kind,
                                                                    nproc):
    """Two ranks under torchrun for the dynamic scaler (whose rank went inf named, its own
    flag only on it); the constant one in one process (its own flag, its scale held)."""
    bad = 1 if nproc else 0
    job = run(tmp_path_factory, f"megatron_{kind}", "megatron_scaler.py",
              ["--scaler", kind, "--bad-rank", str(bad), "--bad-step", "5"], nproc=nproc)
    for rank in range(max(nproc, 1)):
        logged, s = job.history(rank), job.steps(rank)
        assert len(s) == len(logged)
        np.testing.assert_array_equal(s["loss"], np.float32([h["loss"] for h in logged]))
        np.testing.assert_array_equal(s["scale"], [h["scale"] for h in logged])
        np.testing.assert_array_equal(s["scale_after"], [h["scale_after"] for h in logged])
        assert s["skipped"].tolist() == [int(h["found_inf"]) for h in logged]
        assert np.flatnonzero(s["skipped"]).tolist() == [5]
        # an applied step ends at its optimizer's step, whose inner optimizer steps fp32 main
        # copies: the norm of their (unscaled) gradients
        assert np.all(np.isfinite(s["grad_norm"][s["skipped"] == 0]))
        # this rank's own found_inf, copied before the check's all-reduce
        assert bool(s["flags"][5] & OWN) == (rank == bad)
    if kind == "constant":
        assert np.all(job.steps(0)["scale"] == 1024.0)
    else:
        d = job.diagnose()
        assert d.run["origin_rank"] == 1, str(d)


@pytest.mark.gpu
def test_deepspeed_fp16_on_a_gpu_is_recorded_as_it_ran(tmp_path_factory):
    """DeepSpeed's fp16 engine on CUDA, natively (no accelerator told anything), one process:
    the path the CPU runs reach only through the fixture's fp16 override."""
    job = run(tmp_path_factory, "ds_gpu", "deepspeed_train.py",
              ["--steps", "12", "--lr", "20", "--warmup", "4"], nproc=0)
    assert_engine_columns(job, 0)
    s = job.steps(0)
    assert np.all(np.isfinite(s["scale"])) and s["skipped"].any()


@pytest.mark.gpu
def test_megatron_fp16_optimizer_on_a_gpu_is_recorded_as_it_ran(tmp_path_factory):
    """Megatron-core's own Float16OptimizerWithFloat16Params on CUDA (fp16 parameters, fp32
    main copies, its DynamicGradScaler's tensors on the GPU as written), one process over
    nccl: the path the CPU runs reach through the fixture's CPU subclass."""
    job = run(tmp_path_factory, "megatron_gpu", "megatron_scaler.py",
              ["--device", "cuda", "--bad-rank", "0", "--bad-step", "5"], nproc=0)
    logged, s = job.history(0), job.steps(0)
    assert len(s) == len(logged)
    np.testing.assert_array_equal(s["scale"], [h["scale"] for h in logged])
    np.testing.assert_array_equal(s["scale_after"], [h["scale_after"] for h in logged])
    assert np.flatnonzero(s["skipped"]).tolist() == [5] and s["flags"][5] & OWN
