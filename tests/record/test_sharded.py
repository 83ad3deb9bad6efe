"""Sharded training (FSDP2's fully_shard, FSDP1) under torchrun, 2 gloo ranks on CPU, as a user
runs it: ``ampdoctor record -o run.h5 -- torchrun ... train_fsdp.py`` or ``watch()`` in the
script, then ``ampdoctor diagnose run.h5``. Plus unit tests of ``sharding`` and of the
rank-file merge on synthetic steps.

Cost: five 2-rank launches of a 30-step script and two of a 12-step one, about 70 s of CPU
time in all, children included (`time python -m pytest tests/record/test_sharded.py`); the two
ranks run in parallel. A hang (a collective one rank never joins) fails a launch at its timeout."""

import json
import os
import subprocess

import numpy as np
import pytest
import torch
from conftest import PYTHON, ROOT, python_env

import ampdoctor
from ampdoctor.diagnosis import ranks
from ampdoctor.record import sharding
from ampdoctor.runfile import schema
from ampdoctor.runfile.schema import Event, Kind, Phase, flag

SCRIPT = os.path.join(ROOT, "fixtures", "examples", "train_fsdp.py")
LOCAL = flag(Event.GRAD_NORM_LOCAL)
OWN = flag(Event.OWN_NONFINITE_GRAD)


def torchrun(*args):
    return [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            SCRIPT, *args]


def run(cmd, cwd):
    proc = subprocess.run(cmd, cwd=cwd, env=python_env(), capture_output=True, text=True,
                          timeout=180)  # a hang fails the test
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def record(cwd, *args):
    return run([PYTHON, "-m", "ampdoctor", "record", "-o", "run.h5", "--", *torchrun(*args)],
               cwd)


def diagnose(cwd, name="run.h5"):
    proc = run([PYTHON, "-m", "ampdoctor", "diagnose", name, "--format", "json"], cwd)
    return json.loads(proc.stdout)


def ours(stderr):
    return [line for line in stderr.splitlines() if line.startswith("ampdoctor")]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    """FSDP2 with clip_grad_norm_, 30 steps, recorded; its per-rank losses and weights."""
    folder = tmp_path_factory.mktemp("fsdp2")
    proc = record(folder, "--dump", str(folder))
    dumps = [torch.load(folder / f"rank{r}.pt") for r in (0, 1)]
    return folder, proc, dumps


@pytest.mark.slow
def test_fsdp2_records_every_step_without_changing_training(healthy, tmp_path):
    folder, proc, recorded = healthy
    run([*torchrun("--dump", str(tmp_path))], tmp_path)  # the same run, no ampdoctor
    for rank in (0, 1):
        plain = torch.load(tmp_path / f"rank{rank}.pt")
        assert recorded[rank]["losses"] == plain["losses"]  # bit for bit
        for name, w in plain["weights"].items():
            assert torch.equal(recorded[rank]["weights"][name], w), name
    assert not [line for line in proc.stderr.splitlines() if "Warning: ampdoctor" in line]
    summary = ours(proc.stderr)[-1]
    assert "recorded 30 steps each on 2 ranks" in summary
    assert "0 skipped; diagnosis: healthy;" in summary
    norms = []
    for rank in (0, 1):
        with ampdoctor.load(folder / f"run.rank{rank}.h5") as r:
            s = r.steps
            assert len(s) == 30 and r.status == "finished"
            assert not (s["flags"] & flag(Event.RECORDER_ERROR)).any()
            np.testing.assert_allclose(s["loss"], recorded[rank]["losses"], rtol=1e-6)
            # clip_grad_norm_'s norm is the global one: the same on both ranks, never a share
            assert np.array_equal(s["grad_norm"], s["clip_norm"])
            assert not (s["flags"] & LOCAL).any()
            norms.append(s["grad_norm"])
            meta = r.meta["sharding"]
            assert (meta["kind"], meta["local_shards"], meta["world_size"]) == ("fsdp2", True, 2)
            assert meta["replay"] == "off" and "all-gathers" in meta["replay_reason"]
            _assert_per_shard(r)
    assert np.array_equal(norms[0], norms[1]) and np.isfinite(norms[0]).all()
    d = diagnose(folder)
    assert d["verdict"] == "healthy"
    notes = " ".join(d["notes"])
    assert "each rank's own shard" in notes and "Forensic replay is off under FSDP2" in notes
    assert sum("Forensic replay is off" in n for n in d["notes"]) == 1  # said once, not per rank
    upd = next(e for e in d["evidence"] if e["key"] == "update_ratio")
    assert upd["text"].endswith("(per shard)")


def _assert_per_shard(r):
    """Sampled parameter rows describe this rank's half of each parameter."""
    t = r.tensors
    st = r.stats[:]
    for kind in (Kind.PARAM, Kind.PARAM_GRAD):
        ids = t["id"][t["kind"] == kind]
        assert len(ids) == 6  # fc1, fc2, head: weight and bias
        for tid in ids:
            whole = int(t["numel"][t["id"] == tid][0])
            rows = st[st["tensor"] == tid]
            assert len(rows) and (rows["numel"] * 2 == whole).all()
    assert set(str(n) for n in t["name"][t["kind"] == Kind.OUTPUT]) == {"fc1", "fc2", "head"}


@pytest.mark.slow
def test_fsdp2_nan_batch_without_clip_is_bad_input_on_its_rank(healthy, tmp_path):
    record(tmp_path, "--no-clip", "--bad-rank", "1", "--bad-step", "5")
    shares = []
    for rank in (0, 1):
        with ampdoctor.load(tmp_path / f"run.rank{rank}.h5") as r:
            s = r.steps
            assert len(s) == 30 and (s["flags"] & LOCAL).all()
            shares.append(s["grad_norm"][:5].astype(float))
            snaps = r.snapshots
            # Only rank 1's own batch held the NaN: its batch check says so, rank 0's is clean
            assert [(int(x["step"]), int(x["phase"])) for x in snaps] == \
                ([(5, Phase.INPUT)] if rank == 1 else [])
    # No clip: each rank holds a share; combined they are the clipping run's global norm
    # (its norms stay below max_norm=1, so clipping changed nothing before the NaN).
    with ampdoctor.load(healthy[0] / "run.rank0.h5") as r:
        clipped = r.steps["grad_norm"][:5].astype(float)
    np.testing.assert_allclose(np.hypot(*shares), clipped, rtol=1e-5)
    assert all(abs(a - b) > 1e-3 for a, b in zip(shares[0], clipped))  # a share is not global
    d = diagnose(tmp_path)
    assert d["verdict"] == "bad_input"
    assert (d["first_bad"]["step"], d["first_bad"]["rank"]) == (5, 1)
    assert d["first_bad"]["phase"] == "input"
    np.testing.assert_allclose(d["history"]["grad_norm"][:5], clipped, rtol=1e-5)
    texts = [e["text"] for e in d["evidence"]]
    assert any(t.startswith("rank 1 went non-finite first, at step 5") for t in texts)
    assert any("no replay under FSDP" in t for t in texts)
    assert any("combined from the 2 ranks' shards" in n for n in d["notes"])
    with ampdoctor.release_report(str(tmp_path / "run.h5")) as rep:  # rank 0, combined
        assert rep.summary.peak_grad_norm == pytest.approx(max(clipped), rel=1e-5)
    # One rank's file alone: its grad norm is a share, and the note says how to combine
    alone = diagnose(tmp_path, "run.rank0.h5")
    assert any("this rank's share" in n for n in alone["notes"])


@pytest.mark.slow
def test_fsdp1_fp16_sharded_scaler_and_clip_method(tmp_path):
    proc = record(tmp_path, "--fsdp", "1", "--autocast", "float16", "--scaler",
                  "--bad-rank", "0", "--bad-step", "7")
    assert "1 skipped; diagnosis: bad_input, first bad at step 7 on rank 0" in \
        ours(proc.stderr)[-1]
    for rank in (0, 1):
        with ampdoctor.load(tmp_path / f"run.rank{rank}.h5") as r:
            s = r.steps
            assert r.meta["sharding"]["kind"] == "fsdp1"
            # ShardedGradScaler is imported after recording began: its overrides seen anyway
            assert r.meta["scaler"]["class"] == "ShardedGradScaler"
            assert r.meta["autocast"]["dtype"] == "float16"
            assert np.flatnonzero(s["skipped"]).tolist() == [7]  # both ranks skipped it
            assert s["scale"][8] == s["scale_after"][7] == s["scale"][7] / 2
            # found_inf is the ranks' combined flag (ShardedGradScaler all-reduced it) ...
            assert (s["found_inf"] >= 0).all() and np.flatnonzero(s["found_inf"]).tolist() == [7]
            # ... and each rank's own, read before that all-reduce, is set on both: the
            # reduce-scatter put rank 0's NaN into every rank's shard of the gradients
            assert r.meta["scaler"]["own_found_inf"] is True
            assert np.flatnonzero(s["flags"] & OWN).tolist() == [7]
            assert r.meta["sharding"]["strategy"] == ["FULL_SHARD"]
            assert r.meta["roots"] == ["Net"]  # the model inside the wrapper
            names = set(str(n) for n in r.tensors["name"])
            assert {"fc1", "fc2", "head"} <= names
            assert not any("_fsdp_wrapped_module" in n for n in names)
            # model.clip_grad_norm_ (FSDP1's own method) all-reduced it: global, not a share
            assert not (s["flags"] & LOCAL).any()
            assert np.isfinite(s["clip_norm"][:7]).all() and np.isnan(s["clip_norm"][7])
            assert np.array_equal(s["grad_norm"], s["clip_norm"], equal_nan=True)
    d = diagnose(tmp_path)
    assert (d["verdict"], d["first_bad"]["step"], d["first_bad"]["rank"]) == ("bad_input", 7, 0)
    assert not d["rank_view"]["first"]["own_grads"]  # told by rank 0's own loss


@pytest.mark.slow
def test_fsdp1_own_found_inf_names_the_rank_whose_shard_went_non_finite(tmp_path):
    """Only rank 1's shard of the gradients holds an inf (its loss and rank 0's shard finite):
    ShardedGradScaler's all-reduce makes both ranks skip, each rank's own flag says whose it
    was, and diagnose names rank 1 (the tie went to rank 0 before). Recording changes nothing."""
    args = ("--fsdp", "1", "--autocast", "float16", "--scaler", "--steps", "12",
            "--bad-rank", "1", "--bad-step", "7", "--bad-shard")
    plain = tmp_path / "plain"
    plain.mkdir()
    record(tmp_path, *args, "--dump", str(tmp_path))
    run(torchrun(*args, "--dump", str(plain)), plain)
    for rank in (0, 1):
        recorded = torch.load(tmp_path / f"rank{rank}.pt")
        alone = torch.load(plain / f"rank{rank}.pt")
        assert recorded["losses"] == alone["losses"]  # bit for bit
        for name, w in alone["weights"].items():
            assert torch.equal(recorded["weights"][name], w), name
        with ampdoctor.load(tmp_path / f"run.rank{rank}.h5") as r:
            s = r.steps
            assert len(s) == 12 and r.meta["scaler"]["own_found_inf"] is True
            assert np.flatnonzero(s["skipped"]).tolist() == [7]
            assert np.flatnonzero(s["found_inf"]).tolist() == [7]  # combined: every rank's
            assert s["scale_after"][7] == s["scale"][7] / 2 == s["scale"][8]
            assert np.isfinite(s["loss"]).all()
            assert np.flatnonzero(s["flags"] & OWN).tolist() == ([7] if rank == 1 else [])
    d = diagnose(tmp_path)
    assert d["run"]["origin_rank"] == 1
    assert d["rank_view"]["first"] == {"rank": 1, "step": 7, "local": False, "module": None,
                                       "phase": None, "own_grads": True}
    assert d["evidence"][0]["text"].startswith(
        "rank 1 went non-finite first, at step 7: non-finite gradients in its own shard")
    assert "rank 0: own gradients finite" in d["evidence"][0]["text"]


def test_only_a_scaler_that_rewrites_unscale_combines_found_inf():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    assert not sharding.combines_found_inf(torch.amp.GradScaler("cpu"))
    assert sharding.combines_found_inf(ShardedGradScaler("cpu"))


@pytest.mark.slow
def test_watch_inside_an_fsdp1_script_without_clip(healthy, tmp_path):
    run(torchrun("--fsdp", "1", "--no-clip", "--watch", str(tmp_path / "w.h5")), tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["w.rank0.h5", "w.rank1.h5"]
    d = diagnose(tmp_path, "w.h5")
    assert d["verdict"] == "healthy"
    with ampdoctor.load(healthy[0] / "run.rank0.h5") as r:
        clipped = r.steps["grad_norm"][:5].astype(float)
    # The same model and data as the FSDP2 run: FSDP1's flat shards combine to its norm.
    with ampdoctor.load(tmp_path / "w.rank0.h5") as r0, \
            ampdoctor.load(tmp_path / "w.rank1.h5") as r1:
        assert (r0.steps["flags"] & LOCAL).all()
        combined = np.hypot(r0.steps["grad_norm"][:5], r1.steps["grad_norm"][:5])
    np.testing.assert_allclose(combined, clipped, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# pieces, without processes


def test_local_is_the_identity_for_plain_tensors():
    t = torch.ones(3)
    p = torch.nn.Parameter(torch.ones(2))
    assert sharding.local(t) is t and sharding.local(p) is p and sharding.local(None) is None
    assert not sharding.is_dtensor(t)
    assert sharding.clean_name("_fsdp_wrapped_module.0._fsdp_wrapped_module.weight") == \
        "0.weight"
    assert sharding.detect([torch.nn.Linear(2, 2)]) is None


def test_norm_share_counts_a_replicated_shard_once():
    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2))
    a.grad, b.grad = torch.full((4,), 1.0), torch.full((2,), 3.0)
    s = sharding.Sharding("fsdp2", world_size=4, replicas={id(a): 1, id(b): 4})
    # a: sharded, squared norm 4; b: held by all 4 ranks, 18 counted a quarter per rank
    assert float(s.norm_share([a, b])) == pytest.approx((4 + 18 / 4) ** 0.5)
    total, whole = sharding.clip_result(torch.tensor(2.5), s)
    assert (float(total), whole) == (2.5, True)
    _, whole = sharding.clip_result(torch.tensor(2.5), sharding.Sharding("fsdp1", 2))
    assert not whole  # torch's clip on FSDP1 flat parameters saw this rank's shards only
    _, whole = sharding.clip_result(torch.tensor(2.5), sharding.Sharding("fsdp1", 2), True)
    assert whole


def _steps(norms, flags):
    rows = schema.empty("steps", len(norms))
    rows["step"] = np.arange(len(norms))
    rows["grad_norm"] = norms
    rows["flags"] = flags
    return rows


class _Run:
    def __init__(self, norms, flags, world=2):
        self.steps = _steps(norms, flags)
        self.attrs = {"world_size": world}


def test_combine_grad_norms_only_where_every_rank_has_a_share():
    r0 = _Run([3.0, 3.0, np.nan, 1.0], [LOCAL, LOCAL, LOCAL, 0])
    r1 = _Run([4.0, 0.0, 1.0, 1.0], [LOCAL, LOCAL, LOCAL, 0])
    assert ranks.combine_grad_norms([r0, r1]) == 3
    for r in (r0, r1):
        assert r.steps["grad_norm"][:2].tolist() == [5.0, 3.0]
        assert np.isnan(r.steps["grad_norm"][2])  # one rank's NaN makes the norm NaN
        assert r.steps["grad_norm"][3] == 1.0  # a global (clip) norm is left alone
        assert not (r.steps["flags"] & LOCAL).any()
    lonely = _Run([3.0], [LOCAL])
    assert ranks.combine_grad_norms([lonely]) == 0  # rank 1's file is missing: no guess
    assert lonely.steps["grad_norm"][0] == 3.0
