"""A forensic replay's findings in the run file: its /snapshots row (culprit, phase, fp32
verdict, scale, LR, and in its detail JSON the culprit's statistics and the history up to the
event), /stats rows of every tensor of the replay (``Source.REPLAY``) and of the fp32 re-run
(``Source.REPLAY_FP32``), and /arrays: the batch, the culprit's inputs, the output gradient,
the targets of the loss and the RNG state, within ``BATCH_BYTES``.

Example (what ``Forensics`` does after a replay)::

    sid = snapshot.write(writer, journal.tensor_id, 12, Event.SKIPPED, result, trace,
                         finding, captures, scale=65536.0, lr=1e-3)
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from ...runfile import schema, store
from ...runfile.schema import Event, Source
from .. import sharding
from .culprit import Culprit
from .findings import ReplayResult
from .trace import Capture, Slot, Trace, labeled

BATCH_BYTES = 16 << 20  # arrays saved with one snapshot

TensorId = Callable[..., int]  # Journal.tensor_id(kind, name, index, tensor, owner_type)

_TORCH_DTYPES = {int(schema.DType.FLOAT32): torch.float32,
                 int(schema.DType.FLOAT16): torch.float16,
                 int(schema.DType.BFLOAT16): torch.bfloat16,
                 int(schema.DType.FLOAT64): torch.float64}


def write(w: store.Writer, tensor_id: TensorId, step: int, why: Event, r: ReplayResult,
          trace: Optional[Trace], f: Culprit, captures: list, *, scale: Optional[float],
          lr: float) -> int:
    """A replay's /snapshots row, its /stats rows and its /arrays; returns the snapshot id.
    ``tensor_id``: the journal's (``Journal.tensor_id``); ``scale``, ``lr``: at the event."""
    sid = w.rows("snapshots")
    row = schema.empty("snapshots", 1)
    row["id"], row["step"], row["micro"] = sid, step, r.micro
    row["trigger"], row["phase"] = int(why), int(f.phase)
    row["module_off"], row["module_len"] = w.text(f.module)
    row["module_type_off"], row["module_type_len"] = w.text(f.module_type)
    cap = next((c for c in captures if c.micro == r.micro), None)
    row["autocast"] = _autocast_code(cap.autocast) if cap else 0
    row["fp32_finite"] = -1 if f.fp32_finite is None else int(f.fp32_finite)
    row["fp32_absmax"], row["in_absmax"], row["out_absmax"] = (
        f.fp32_absmax, f.in_absmax, f.out_absmax)
    row["scale"] = scale
    row["lr"] = lr
    if trace is not None:
        ids = _stats_rows(w, tensor_id, sid, step, trace, f)
        if f.culprit_slot is not None:
            row["culprit"] = ids[f.culprit_slot]
    items = array_items(cap, f) if cap is not None else []
    f.detail.arrays = _write_arrays(w, sid, items)
    row["detail_off"], row["detail_len"] = w.text(f.detail.to_text())
    w.append("snapshots", row)
    return sid


def _stats_rows(w: store.Writer, tensor_id: TensorId, sid: int, step: int, trace: Trace,
                f: Culprit) -> list[int]:
    rows = trace.rows.copy()
    ids = [_tensor_id(tensor_id, s, row) for s, row in zip(trace.slots, rows)]
    if len(rows):
        rows["tensor"] = ids
        rows["call"] = [s.nth for s in trace.slots]
        rows["seq"] = np.arange(len(rows))
        rows["source"] = int(Source.REPLAY)
        rows["step"], rows["snapshot"] = step, sid
        w.append("stats", rows)
    if f.fp32_rows:
        fp32 = np.array([row for _, row in f.fp32_rows], dtype=schema.STATS)
        fp32["tensor"] = [_tensor_id(tensor_id, s, row) for s, row in f.fp32_rows]
        fp32["call"] = [s.nth for s, _ in f.fp32_rows]
        fp32["seq"] = np.arange(len(fp32))
        fp32["source"] = int(Source.REPLAY_FP32)
        fp32["step"], fp32["snapshot"] = step, sid
        w.append("stats", fp32)
    return ids


def _tensor_id(tensor_id: TensorId, slot: Slot, row: np.ndarray) -> int:
    # A meta tensor carries the dtype and size to /tensors without any memory.
    dtype = _TORCH_DTYPES.get(int(row["dtype"]), torch.float32)
    meta = torch.empty(int(row["numel"]), dtype=dtype, device="meta")
    return tensor_id(slot.kind, slot.name, slot.index, meta, slot.owner)


def _autocast_code(state: tuple) -> int:
    if not state[1]:
        return int(schema.DType.UNKNOWN)
    return int(schema.DTYPE_NAMES.get(state[2], schema.DType.OTHER))


def array_items(cap: Capture, f: Culprit) -> list[tuple[str, torch.Tensor]]:
    """What a user needs to reproduce the event, most important first."""
    items = [(f"rng.{k}", v) for k, v in cap.rng.items()]
    items += list(labeled(cap.args, cap.kwargs))
    items += [(f"culprit.{label}", t) for label, t in f.culprit_inputs]
    items += [(f"grad_output.{i}", g) for i, g in sorted(cap.grads.items())]
    items += [(f"loss.{k}.{call.name}.{label}", t) for k, call in enumerate(cap.loss_calls)
              for label, t in call.held()]  # the targets the loss was given
    return items


def _write_arrays(writer: store.Writer, sid: int, items: list) -> dict:
    """Arrays (never pickles) within BATCH_BYTES; a tensor over the budget keeps its leading
    rows. Returns {name: "saved" | "truncated" | "skipped"} for the snapshot's detail."""
    budget = BATCH_BYTES
    rows, report = [], {}
    for name, t in items:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_complex() \
                or t.device.type == "meta":
            continue
        t = sharding.local(t).detach()  # a DTensor batch (tensor parallel): this rank's part
        per_row = t[0].numel() * t.element_size() if t.ndim and len(t) else t.element_size()
        keep = t.numel() if not t.ndim else min(len(t), budget // max(per_row, 1))
        if keep <= 0 or (not t.ndim and t.element_size() > budget):
            report[name] = "skipped"
            continue
        part = t[:keep] if t.ndim else t
        if part.dtype == torch.bfloat16:
            part = part.float()  # numpy has no bfloat16; fp32 holds every bf16 value exactly
        arr = np.ascontiguousarray(part.cpu().numpy())
        budget -= arr.nbytes
        row = schema.empty("arrays", 1)
        row["snapshot"] = sid
        row["name_off"], row["name_len"] = writer.text(name)
        row["dtype"] = arr.dtype.str.encode()
        row["ndim"] = min(t.ndim, 8)
        row["shape"][0, :min(t.ndim, 8)] = tuple(t.shape)[:8]
        row["numel"] = t.numel()
        row["saved"] = arr.size
        row["data_off"], row["data_len"] = writer.bytes(arr.tobytes())
        rows.append(row)
        report[name] = "saved" if arr.size == t.numel() else "truncated"
    if rows:
        writer.append("arrays", np.concatenate(rows))
    return report
