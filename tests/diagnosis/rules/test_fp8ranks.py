"""fp8 operands that several ranks hold whole, compared across a job's rank files
(``diagnosis/fp8ranks.py``, ``rules/fp8ranks.py``: ``fp8_amax_mismatch``), on rank files built
in memory and written as a recorder writes them (no torch): the replicas that agree, those
that drift, and the neighbours that must never raise it: activations under plain data
parallel (each rank its own batch, never declared), two tensor-parallel groups each
replicated within itself, a job without fp8 layers. Both paths of a job's diagnosis (the
summaries' fast path and the full read) give the same answer."""

from __future__ import annotations

import numpy as np
import pytest
from synthetic import Synth, write

from ampdoctor.diagnosis import engine, fp8ranks
from ampdoctor.runfile import paths, schema
from ampdoctor.runfile.schema import Fp8Format, Kind, Recipe, Role

CAST = {"scaling": "dynamic", "granularity": "tensorwise", "dtype": "float8_e4m3fn"}
LAYERS = ("fc1", "fc2")


def layer(replicas: dict) -> dict:
    out = {"library": "torchao", "recipe": "tensorwise", "emulate": True, "input": CAST,
           "weight": CAST, "grad_output": dict(CAST, dtype="float8_e5m2"),
           "grad_weight_in_high_precision": False}
    if replicas:
        out["replicas"] = replicas
    return out


def rows(amax: dict, steps=(0, 5, 10)) -> np.ndarray:
    """/fp8 rows of fc1 (tensor 0) and fc2 (tensor 1): every role under every recipe, the
    amax of (tensor, role, step) from ``amax`` (default 1.0)."""
    out = []
    for step in steps:
        for tensor in (0, 1):
            for role in Role:
                for recipe in Recipe:
                    r = schema.empty("fp8", 1)
                    a = amax.get((tensor, role, step), 1.0)
                    wide = role == Role.GRAD_OUTPUT and recipe in (Recipe.TENSOR,
                                                                   Recipe.DELAYED)
                    r["step"], r["tensor"], r["role"], r["recipe"] = step, tensor, role, recipe
                    r["format"] = Fp8Format.E5M2 if wide else Fp8Format.E4M3
                    r["sample_n"] = r["numel"] = 1000
                    r["amax"], r["sqnr_db"] = a, 30.0
                    r["scale"] = np.float32((57344.0 if wide else 448.0) / a)
                    for name in ("zeros", "flushed", "subnormal", "saturated"):
                        r[name] = 0
                    out.append(r)
    return np.concatenate(out)


def job(tmp_path, per_rank: dict, replicas) -> list[str]:
    """Rank files of one job: ``per_rank`` {rank: {(tensor, role, step): amax}};
    ``replicas(rank)`` the declaration each rank's /meta carries per layer."""
    tmp_path.mkdir(exist_ok=True)
    base = str(tmp_path / "run.h5")
    out = []
    for rank, amax in sorted(per_rank.items()):
        s = Synth(12, dtype="bfloat16", scaler=False, every=5)
        for name in LAYERS:
            s.tensor(Kind.OUTPUT, name)
        s.meta["fp8_layers"] = {name: layer(replicas(rank)) for name in LAYERS}
        path = paths.rank_path(base, rank)
        w = write(s, path, rank=rank, world_size=len(per_rank), stop_after=12)
        w.append("fp8", rows(amax))
        w.close(schema.STATUS_FINISHED)
        out.append(path)
    return out


def ddp(ranks):
    return lambda rank: {"weight": {"ranks": list(ranks), "by": "ddp"}}


def both(files):
    fast, full = engine.diagnose_files(files), engine.diagnose_files(files, full=True)
    assert (fast.verdict, fast.first_bad) == (full.verdict, full.first_bad)
    assert [e.text for e in fast.evidence] == [e.text for e in full.evidence]
    return fast


def mismatch(d):
    return next(e for e in d.evidence if e.key == "fp8_amax_mismatch")


def test_ddp_weights_that_agree_are_compared_and_healthy(tmp_path):
    files = job(tmp_path, {0: {}, 1: {}}, ddp([0, 1]))
    found = fp8ranks.compare(files)
    assert found is not None and found.files == 2 and found.steps == 3
    assert sorted((op.layer, op.role) for op in found.operands) == [("fc1", "weight"),
                                                                      ("fc2", "weight")]
    assert not found.mismatched
    d = both(files)
    assert d.verdict == "healthy"
    assert any("2 fp8 operands that several ranks hold whole" in n and "bit-equal" in n
               for n in d.notes)


def test_ddp_weights_that_drift_apart_name_the_layer_the_step_and_each_rank(tmp_path):
    drift = {(0, Role.WEIGHT, 5): 1.25, (0, Role.WEIGHT, 10): 1.5}
    files = job(tmp_path, {0: {}, 1: drift}, ddp([0, 1]))
    d = both(files)
    assert d.verdict == "fp8_amax_mismatch" and d.causes[0]["kind"] == "ddp"
    assert d.first_bad["step"] == 5 and d.first_bad["module"] == "fc1"
    first = mismatch(d)
    assert first.key == "fp8_amax_mismatch" and first.step == 5 and first.value == 1.25
    assert "rank 0: amax 1, scale 448" in first.text
    assert "rank 1: amax 1.25, scale 358.4" in first.text
    steps = next(e for e in d.evidence if e.key == "fp8_amax_steps")
    assert "2 of 3 sampled steps" in steps.text and "bit-equal on step 0" in steps.text
    assert [fx.id for fx in d.fixes] == ["fp8_sync_replicas"]
    assert "no_sync" in d.fixes[0].snippet
    assert {p.name for p in d.premises} == {"layout_declares_replicas", "same_sampled_step"}


def test_activations_under_plain_data_parallel_never_raise_it(tmp_path):
    # each rank its own batch: inputs and output gradients differ on every step, undeclared
    own = {(t, role, s): 1.0 + rank_shift for t in (0, 1) for role in (Role.INPUT,
                                                                         Role.GRAD_OUTPUT)
           for s, rank_shift in ((0, 0.5), (5, 0.25), (10, 2.0))}
    files = job(tmp_path, {0: {}, 1: own}, ddp([0, 1]))
    assert not fp8ranks.compare(files).mismatched
    assert both(files).verdict == "healthy"


def test_two_tensor_parallel_groups_are_each_compared_within_themselves(tmp_path):
    # ranks {0, 1} and {2, 3}: the input replicated within a group, a different batch each
    def tp(rank):
        group = [0, 1] if rank < 2 else [2, 3]
        return {"input": {"ranks": group, "by": "dtensor",
                          "placements": ["Shard(dim=0)", "Replicate()"]}}
    per_group = {r: {(0, Role.INPUT, s): 2.0 if r >= 2 else 1.0 for s in (0, 5, 10)}
                 for r in range(4)}
    files = job(tmp_path, per_group, tp)
    found = fp8ranks.compare(files)
    assert len(found.operands) == 4 and not found.mismatched  # fc1, fc2 x two groups
    assert both(files).verdict == "healthy"
    per_group[3][(1, Role.INPUT, 10)] = 3.0  # one rank of the second group sees another batch
    d = both(job(tmp_path / "bad", per_group, tp))
    assert d.verdict == "fp8_amax_mismatch" and d.causes[0]["kind"] == "dtensor"
    assert (d.first_bad["step"], d.first_bad["module"]) == (10, "fc2")
    assert "ranks 2, 3 hold whole as a replicated DTensor" in d.summary
    assert [fx.id for fx in d.fixes] == ["fp8_sync_replicas", "fp8_reduce_amax"]
    assert "precompute_float8_dynamic_scale_for_fsdp" in d.fixes[1].snippet
    assert "get_amax_reduction_group" in d.fixes[1].snippet


def test_a_job_that_declares_nothing_is_not_compared(tmp_path):
    files = job(tmp_path, {0: {}, 1: {(0, Role.WEIGHT, 5): 9.0}}, lambda rank: {})
    assert fp8ranks.compare(files) is None
    d = both(files)
    assert d.verdict == "healthy"
    assert not any("several ranks hold whole" in n for n in d.notes)


def test_one_rank_file_alone_is_not_compared(tmp_path):
    files = job(tmp_path, {0: {}, 1: {(0, Role.WEIGHT, 5): 9.0}}, ddp([0, 1]))
    assert engine.diagnose(files[1]).verdict == "healthy"  # --rank 1: nothing to compare to


@pytest.mark.parametrize("missing", [0, 1])
def test_a_rank_file_left_out_leaves_the_others_compared(tmp_path, missing):
    files = job(tmp_path, {0: {}, 1: {}, 2: {(1, Role.WEIGHT, 10): 2.0}}, ddp([0, 1, 2]))
    kept = [f for i, f in enumerate(files) if i != missing]
    d = both(kept)
    assert d.verdict == "fp8_amax_mismatch" and d.first_bad["step"] == 10
    assert "rank 2: amax 2" in mismatch(d).text
