"""The records nested in the run file's JSON (runfile/records.py, runfile/detail.py): the
recorder's record writes the JSON the plain dict it replaced wrote, reads back equal, and a
reader of an older or damaged file gets each field's default."""

import json
import math

from ampdoctor.runfile.detail import (
    Computed,
    Derivative,
    Fp32Rerun,
    History,
    Isolation,
    OpRecord,
    RowSummary,
    SingularOp,
    TrialOutcome,
)
from ampdoctor.runfile.meta import OptimizerInfo, ShardingInfo
from ampdoctor.runfile.payloads import LossSingular, SnapshotDetail

# What record/opprobe.py wrote before the record (the same keys, in the same order).
OP = {"op": "mul", "created": ["posinf"], "dtype": "float16",
      "counts": {"nan": 0, "posinf": 3, "neginf": 0}, "numel": 64, "in_absmax": 300.0,
      "big_scalar": None, "in_nan": False, "in_posinf": False, "in_neginf": False,
      "index": 7, "mask_operand": False}
ROW = {"label": "x", "dtype": "float16", "numel": 4, "absmax": 2.0, "nan": 0, "posinf": 1,
       "neginf": 0, "over16": 1, "zeros": 0}


def test_a_record_writes_the_bytes_its_dict_wrote_and_reads_back_equal():
    op = OpRecord(**OP)
    assert json.dumps(op.to_json()) == json.dumps(OP)
    assert OpRecord.from_json(json.loads(json.dumps(OP))) == op
    fp32 = Fp32Rerun(inputs=[RowSummary(**ROW)], outputs=[], copied_module=True)
    written = {"inputs": [ROW], "outputs": [], "copied_module": True}
    assert SnapshotDetail(fp32=fp32).to_text() == json.dumps({"fp32": written})
    read = SnapshotDetail.from_text(SnapshotDetail(fp32=fp32, op=op).to_text())
    assert read.fp32 == fp32 and read.op == op and read.rerun is None


def test_an_older_or_damaged_value_reads_as_each_field_s_default():
    old = {k: v for k, v in OP.items() if k != "mask_operand"}  # before the probe kept it
    assert OpRecord.from_json(old).mask_operand is True
    bad = OpRecord.from_json({"op": 3, "created": ["nan", 4], "numel": True,
                              "in_absmax": "big", "counts": {"nan": "x", "posinf": 2}})
    assert (bad.op, bad.created, bad.numel, bad.in_absmax) == ("", ["nan"], 0, None)
    assert bad.counts == {"posinf": 2}
    assert OpRecord.from_json([1, 2]) == OpRecord() == OpRecord.from_json(None)
    d = SnapshotDetail.from_text('{"op": "not an object", "bad_inputs": [1, {"label": "y"}]}')
    assert d.op is None and [b.label for b in d.bad_inputs] == ["y"]


def test_a_trial_s_non_finite_loss_is_written_as_text_and_read_as_the_number():
    out = TrialOutcome("as recorded", loss=-math.inf, loss_finite=False)
    assert out.to_json()["loss"] == "-inf"
    assert TrialOutcome.from_json(json.loads(json.dumps(out.to_json()))) == out
    assert TrialOutcome.from_json({"loss": "garbled"}).loss is None


def test_a_singular_op_writes_the_keys_of_its_shape():
    """Not held: its note and no measure; measured: nearest, eps_nearest and eps even where
    None; failed: the error alone (record/forensic/singular.py wrote those three dicts)."""
    head = {"op": "pow", "node": "PowBackward0", "exponent": 0.5, "points": [0.0]}
    held = SingularOp(op="pow", node="PowBackward0", exponent=0.5, note="too large")
    assert held.to_json() == {**head, "note": "too large"}
    measured = SingularOp(op="pow", node="PowBackward0", exponent=0.5, dtype="float16",
                          numel=4, at_point=2, run=Derivative(2, None),
                          fp32=Derivative(2, 1.0))
    assert json.dumps(measured.to_json()) == json.dumps({
        **head, "dtype": "float16", "numel": 4, "at_point": 2,
        "run": {"nonfinite": 2, "largest": None}, "fp32": {"nonfinite": 2, "largest": 1.0},
        "nearest": None, "eps_nearest": None, "eps": None})
    assert SingularOp(error="boom").to_json() == {"error": "boom"}
    text = LossSingular(ops=[measured, held]).to_text()
    assert LossSingular.from_text(text).ops == [measured, held]


def test_the_replay_s_own_records_read_back_as_written():
    iso = Isolation(hooks_set_aside=2, output_held_back=10)
    made = Computed(op="exp", into="Net", label="args.0", dtype="float16", device="cpu")
    hist = History(step=[0, 1], loss=[2.0, math.nan], lr=[1e-3, 1e-3])
    text = SnapshotDetail(isolation=iso, computed=made, history=hist,
                          stale_grads=["fc.weight"]).to_text()
    assert json.loads(text)["isolation"] == {"hooks_set_aside": 2, "hooks_not_installed": 0,
                                             "output_held_back": 10}
    d = SnapshotDetail.from_text(text)
    assert (d.isolation, d.computed, d.stale_grads) == (iso, made, ["fc.weight"])
    assert d.history.step == [0, 1] and math.isnan(d.history.loss[1])


def test_meta_records_write_the_dicts_the_recorder_wrote():
    opt = {"class": "AdamW", "hyper": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-08},
           "groups": 1, "param_dtypes": {"float32": 10}, "state_dtypes": {}}
    assert json.dumps(OptimizerInfo.from_json(opt).to_json()) == json.dumps(opt)
    assert OptimizerInfo.from_json(opt).eps == 1e-08 and OptimizerInfo().lr is None
    shard = {"kind": "fsdp1", "local_shards": True, "world_size": 2, "grad_norm": "g",
             "replay": "off", "replay_reason": "r", "strategy": ["FULL_SHARD"]}
    assert json.dumps(ShardingInfo.from_json(shard).to_json()) == json.dumps(shard)
    off = ShardingInfo(kind="deepspeed", world_size=2, grad_norm="g", replay="disabled")
    assert "replay_reason" not in off.to_json() and "mesh" not in off.to_json()
