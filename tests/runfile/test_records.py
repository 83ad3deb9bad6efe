"""The records nested in the run file's JSON (runfile/records.py, runfile/detail.py): the
recorder's record writes the JSON the plain dict it replaced wrote, reads back equal, and a
reader of an older or damaged file gets each field's default."""

import json
import math

from ampdoctor.runfile.detail import Fp32Rerun, OpRecord, RowSummary, TrialOutcome
from ampdoctor.runfile.payloads import SnapshotDetail

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
    assert SnapshotDetail(fp32=fp32).to_json() == json.dumps({"fp32": written})
    read = SnapshotDetail.from_json(SnapshotDetail(fp32=fp32, op=op).to_json())
    assert read.fp32 == fp32 and read.op == op and read.rerun is None


def test_an_older_or_damaged_value_reads_as_each_field_s_default():
    old = {k: v for k, v in OP.items() if k != "mask_operand"}  # before the probe kept it
    assert OpRecord.from_json(old).mask_operand is True
    bad = OpRecord.from_json({"op": 3, "created": ["nan", 4], "numel": True,
                              "in_absmax": "big", "counts": {"nan": "x", "posinf": 2}})
    assert (bad.op, bad.created, bad.numel, bad.in_absmax) == ("", ["nan"], 0, None)
    assert bad.counts == {"posinf": 2}
    assert OpRecord.from_json([1, 2]) == OpRecord() == OpRecord.from_json(None)
    d = SnapshotDetail.from_json('{"op": "not an object", "bad_inputs": [1, {"label": "y"}]}')
    assert d.op is None and [b.label for b in d.bad_inputs] == ["y"]


def test_a_trial_s_non_finite_loss_is_written_as_text_and_read_as_the_number():
    out = TrialOutcome("as recorded", loss=-math.inf, loss_finite=False)
    assert out.to_json()["loss"] == "-inf"
    assert TrialOutcome.from_json(json.loads(json.dumps(out.to_json()))) == out
    assert TrialOutcome.from_json({"loss": "garbled"}).loss is None
