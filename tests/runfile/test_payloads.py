"""The declared JSON payloads (runfile/payloads.py): every one a record mypy checks on both
sides (the writer's keywords, the reader's attributes). Each record reads back what it
writes; a snapshot's detail writes the keys its writer set in the order it set them (the bytes
the dict it replaced wrote), and every older format's detail reads and writes back unchanged."""

import glob
import importlib
import json
import math
import os
import pkgutil

import h5py
import pytest
from conftest import ROOT

import ampdoctor.runfile
from ampdoctor.runfile import payloads, records
from ampdoctor.runfile.detail import OpRecord, TriedFix
from ampdoctor.runfile.payloads import SnapshotDetail


def _every_record() -> list[type]:
    for info in pkgutil.iter_modules(ampdoctor.runfile.__path__):
        importlib.import_module(f"ampdoctor.runfile.{info.name}")
    out, todo = [], list(records.Record.__subclasses__())
    while todo:
        kind = todo.pop()
        out.append(kind)
        todo.extend(kind.__subclasses__())
    return sorted(out, key=lambda k: k.__name__)


RECORDS = _every_record()


def test_the_records_are_found():
    names = {k.__name__ for k in RECORDS}
    assert {"SnapshotDetail", "Fp8Trial", "Fp8Effect", "Fp8Own", "AppliedFix"} <= names


@pytest.mark.parametrize("kind", RECORDS, ids=lambda k: k.__name__)
def test_every_record_reads_back_what_it_writes(kind):
    text = kind().to_text()
    assert kind.from_text(text).to_text() == text
    assert kind.from_text("not json").to_text() == kind().to_text()  # damaged: its defaults


def test_a_detail_writes_the_keys_set_in_the_order_they_were_first_set():
    d = SnapshotDetail(micro_batches=2)
    d.reproduced = True
    d.how = "first"
    d.loss_nonfinite = None  # set, though None: written, as the dict wrote it
    d.op = OpRecord(op="mul")
    d.how = "again"  # a key set twice keeps its first place
    written = json.loads(d.to_text())
    assert list(written) == ["micro_batches", "reproduced", "how", "loss_nonfinite", "op"]
    assert written["how"] == "again" and written["op"]["op"] == "mul"
    assert SnapshotDetail().to_text() == "{}"


def test_a_detail_read_keeps_the_file_s_order_and_reads_missing_keys_as_defaults():
    text = json.dumps({"trials": {"fp32": {"fix": "fp32", "tried": True}}, "micro_batches": 1,
                       "from_a_newer_writer": [1], "reproduced": False})
    d = SnapshotDetail.from_text(text)
    assert d.reproduced is False and d.input_modified is False and d.micro_batches == 1
    assert d.how is None and d.stale_grads == [] and d.op is None
    assert isinstance(d.trials["fp32"], TriedFix) and d.trials["fp32"].tried is True
    assert list(json.loads(d.to_text())) == ["trials", "micro_batches", "reproduced"]
    assert SnapshotDetail.from_json(d) is d
    for damaged in ("[1, 2]", "not json", None, "3"):
        assert SnapshotDetail.from_text(damaged).to_text() == "{}"


def test_the_json_written_is_what_a_plain_dict_writes():
    d = SnapshotDetail(summary="x", weights_nonfinite=["w"])
    d.trials_seconds = math.inf
    d.arrays = {"args.0": "saved"}
    assert d.to_text() == json.dumps({"summary": "x", "weights_nonfinite": ["w"],
                                      "trials_seconds": math.inf,
                                      "arrays": {"args.0": "saved"}})


FORMATS = sorted(glob.glob(os.path.join(ROOT, "fixtures", "formats", "*.h5")))


@pytest.mark.parametrize("path", FORMATS, ids=os.path.basename)
def test_every_older_format_s_detail_reads_and_writes_back_its_bytes(path):
    with h5py.File(path, "r") as f:
        rows, blob = f["snapshots"][:], f["blob"][:]
    assert len(rows)
    for row in rows:
        off, n = int(row["detail_off"]), int(row["detail_len"])
        text = bytes(blob[off:off + n]).decode()
        d = SnapshotDetail.from_text(text)
        assert d.bad_inputs and d.history is not None and d.summary
        assert d.to_text() == text


def test_a_record_writes_the_keys_its_writer_set_in_the_order_the_dict_it_replaced_did():
    ran = payloads.LrRange(state="start", state_step=0, event_step=8, lr=0.1, batch="b",
                           steps=12, rungs=[payloads.LrRung(factor=1.0, lr=0.1,
                                                            losses=[2.0, math.inf])],
                           optimizer="SGD", seconds=1.5)
    assert list(json.loads(ran.to_text())) == ["state", "state_step", "event_step", "lr",
                                               "batch", "steps", "rungs", "optimizer",
                                               "max_norm", "seconds"]  # no clip: null
    assert ran.to_json()["rungs"][0]["losses"] == [2.0, "inf"]  # as text where not finite
    back = payloads.LrRange.from_text(ran.to_text())
    assert back.rungs is not None and math.isinf(back.rungs[0].losses[1])
    assert not payloads.LrRange.trains(back.rungs[0])
    note = payloads.LrRange(note="why", seconds=0.1)
    assert note.to_text() == json.dumps({"note": "why", "seconds": 0.1})
    op = payloads.CompiledOp(graph="forward", node="cosh", op="aten.cosh", module="1")
    assert list(op.to_json()) == ["graph", "node", "op", "module"]
    probe = payloads.FlatLossProbe.from_text("")
    assert math.isnan(probe.start) and probe.probe == 0
    assert payloads.HiddenNonfinite.from_text("not json").op == "?"
