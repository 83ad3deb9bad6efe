"""Forensic replay (tier 3): find the op that first went non-finite, and whether fp32 fixes it.

Every step the recorder keeps references to what the root module was given (arguments, RNG
state, autocast state) and to the gradient that arrived at its output in backward. When the
sentinel sees a non-finite loss or gradient while the parameters are still the ones that
produced it (GradScaler skipped the step, or ``optimizer.step`` has not run yet), ``replay``:

1. re-runs the root's forward on the same batch, with the same RNG state and autocast state,
   with every module instrumented (exact statistics of each input and output);
2. runs backward from the captured output gradient with ``torch.autograd.grad``, so ``.grad``
   is never touched, with tensor hooks recording each module's grad_output and grad_input;
3. names the culprit: the first module in execution order whose output is non-finite while its
   inputs are finite (forward), else the first in backward order whose grad_input is
   non-finite while its grad_output is finite (backward), else the batch or the loss;
4. re-runs the culprit alone in fp32 (autocast off, inputs ``.float()``): finite means an fp32
   island around it fixes the step; non-finite means the values themselves are too large;
5. writes a snapshot: the culprit, its statistics in both precisions, the batch.

No observer effect: RNG is forked (and set to the captured state for the replay), module
buffers such as BatchNorm running statistics are restored bit for bit afterwards, ``.grad`` and
the optimizer state are never written.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from . import patches, schema, stats
from .sampler import tensors_in
from .schema import Event, Kind, Phase, Source

BATCH_BYTES = 16 << 20  # the most bytes of batch saved with one snapshot


@dataclass
class _Capture:
    """One call of a root module during the step (one micro-batch)."""

    root: torch.nn.Module
    args: tuple
    kwargs: dict
    rng: dict
    autocast: tuple  # (device_type, enabled, dtype, cache_enabled)
    grads: dict = field(default_factory=dict)  # output index -> gradient


@dataclass
class _CallRecord:
    """One module call seen during the replay."""

    module: torch.nn.Module
    name: str
    depth: int
    args: tuple
    kwargs: dict
    in_slots: list = field(default_factory=list)
    out_slots: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    grad_out_slots: list = field(default_factory=list)  # (slot, fire order)
    grad_in_slots: list = field(default_factory=list)
    grad_values: list = field(default_factory=list)  # grad_output tensors, for the fp32 check
    call: int = 0


class Forensics:
    """Captures each step's root calls; ``replay`` explains a failing one."""

    def __init__(self, recorder: Any):
        self.rec = recorder
        self.captures: list[_Capture] = []
        self.replaying = False

    # -- every step: cheap references -------------------------------------------------------

    def begin_step(self) -> None:
        self.captures = []

    def end_step(self, step: Any) -> None:
        self.captures = []

    def capture_inputs(self, root: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.replaying or not torch.is_grad_enabled():
            return
        device_type = self.rec._device.type if self.rec._device is not None else "cpu"
        self.captures.append(_Capture(root, args, dict(kwargs), _rng_state(device_type),
                                      _autocast(device_type)))

    def capture_output(self, root: torch.nn.Module, output: Any) -> None:
        if self.replaying or not self.captures or self.captures[-1].root is not root:
            return
        grads = self.captures[-1].grads
        for i, t in enumerate(tensors_in(output)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                # The hook may hold only the dict: a closure that reached the output tensor
                # (through the capture) would make a cycle through autograd's C++ hook table
                # that Python's collector cannot see, and leak every step's graph.
                t.register_hook(lambda g, i=i, grads=grads: grads.__setitem__(i, g.detach()))

    # -- on the event -----------------------------------------------------------------------

    def replay(self, step: Any, why: Event) -> Optional[int]:
        """Replay the failing step; return the snapshot id written, or None."""
        if not self.captures:
            return None
        self.replaying = True
        saved = _save_buffers([c.root for c in self.captures])
        try:
            with torch.random.fork_rng(devices=_rng_devices(self.rec._device)):
                result = self._find(step)
            return self._write(step, why, result)
        finally:
            _restore_buffers(saved)
            self.replaying = False

    def replay_capture(self, cap: _Capture) -> dict:
        """Replay one captured root call; the result of the culprit search (no file writes)."""
        self.replaying = True
        saved = _save_buffers([cap.root])
        try:
            with torch.random.fork_rng(devices=_rng_devices(self.rec._device)):
                return _Replay(self.rec, cap).run()
        finally:
            _restore_buffers(saved)
            self.replaying = False

    def _find(self, step: Any) -> dict:
        results = []
        for micro, cap in enumerate(self.captures):
            result = _Replay(self.rec, cap).run()
            result["micro"] = micro
            results.append(result)
            if result["phase"] not in (Phase.NONE, Phase.UNKNOWN):
                return result
        result = results[-1]
        if self._stale_grads(results):
            result["detail"]["stale_grads"] = True
        return result

    def _stale_grads(self, results: list) -> bool:
        """Every micro-batch replays finite, yet .grad holds inf/NaN: left from an earlier step."""
        grads = [p.grad for p in self.rec._trained_params() if p.grad is not None]
        if not grads or not all(r["phase"] == Phase.NONE for r in results):
            return False
        return not all(bool(torch.isfinite(g).all()) for g in grads)

    def _write(self, step: Any, why: Event, result: dict) -> int:
        rec = self.rec
        w = rec._writer
        sid = w.rows("snapshots")
        row = schema.empty("snapshots", 1)
        row["id"] = sid
        row["step"] = step.index
        row["micro"] = result.get("micro", 0)
        row["trigger"] = int(why)
        row["phase"] = int(result["phase"])
        row["culprit"] = result.get("culprit", -1)
        row["module_off"], row["module_len"] = w.text(result.get("module", ""))
        row["module_type_off"], row["module_type_len"] = w.text(result.get("module_type", ""))
        row["autocast"] = result.get("autocast", 0)
        for key in ("fp32_finite", "fp32_absmax", "in_absmax", "out_absmax"):
            if key in result:
                row[key] = result[key]
        row["scale"] = _scalar(getattr(step, "scale", None))
        lrs = [g.get("lr") for o in rec.optimizers for g in o.param_groups]
        row["lr"] = max((float(x) for x in lrs if isinstance(x, (int, float))), default=math.nan)
        row["detail_off"], row["detail_len"] = w.text(json.dumps(result.get("detail", {}),
                                                                 default=str))
        w.append("snapshots", row)
        for key in ("rows", "fp32_rows"):
            rows = result.get(key)
            if rows is not None and len(rows):
                rows["step"] = step.index
                rows["snapshot"] = sid
                w.append("stats", rows)
        if result.get("capture") is not None:
            _write_batch(w, sid, result["capture"])
        return sid


class _Replay:
    """One instrumented forward + backward of a captured root call."""

    def __init__(self, rec: Any, cap: _Capture):
        self.rec = rec
        self.cap = cap
        self.collector = stats.Collector(exact=True)
        self.slot_meta: list[tuple[int, int, int, int]] = []  # tensor id, call, seq, source
        self.calls: list[_CallRecord] = []
        self.stack: list[_CallRecord] = []
        self.fired = 0
        self.call_count: dict[int, int] = {}

    def run(self) -> dict:
        cap = self.cap
        result: dict[str, Any] = {"phase": Phase.NONE, "detail": {}, "capture": cap,
                                  "autocast": _autocast_code(cap.autocast)}
        _set_rng(cap.rng)
        input_bad = self._inputs_nonfinite()
        hooks = patches.PatchSet()
        patches.hook_modules(hooks, self, "pre", "post")
        try:
            device_type, enabled, dtype, cache = cap.autocast
            with torch.enable_grad(), torch.autocast(device_type, dtype=_torch_dtype(dtype),
                                                     enabled=enabled, cache_enabled=cache):
                output = cap.root(*cap.args, **cap.kwargs)
            outs = [t for t in tensors_in(output)]
            self._backward(outs)
        except Exception as exc:  # noqa: BLE001 - report what the replay could not do
            result["detail"]["replay_error"] = f"{type(exc).__name__}: {exc}"
            outs = []
        finally:
            hooks.remove()
        rows = self.collector.drain()
        if len(rows):
            meta = np.array(self.slot_meta, dtype=np.int64).reshape(-1, 4)
            rows["tensor"], rows["call"], rows["seq"] = meta[:, 0], meta[:, 1], meta[:, 2]
            rows["source"] = meta[:, 3]
        result["rows"] = rows
        self._decide(result, rows, input_bad, outs)
        return result

    def _inputs_nonfinite(self) -> bool:
        for t in tensors_in((self.cap.args, self.cap.kwargs)):
            if stats.measurable(t) and not bool(torch.isfinite(t).all()):
                return True
        return False

    # -- instrumentation --------------------------------------------------------------------

    def pre(self, module: torch.nn.Module, args: tuple) -> None:
        name = self.rec.names.get(module)
        if name is None:
            self.stack.append(None)
            return
        call = self.call_count.get(id(module), 0)
        self.call_count[id(module)] = call + 1
        depth = 0 if module is self.cap.root else name.count(".") + 1
        rec = _CallRecord(module, name, depth, args, {})
        for i, t in enumerate(tensors_in(args)):
            slot = self._add(t, Kind.INPUT, name, i, call, module)
            if slot is not None:
                rec.in_slots.append(slot)
                self._hook_grad(t, rec, Kind.GRAD_INPUT, i, call)
        rec.call = call
        self.calls.append(rec)
        self.stack.append(rec)

    def post(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        rec = self.stack.pop() if self.stack else None
        if rec is None:
            return
        for i, t in enumerate(tensors_in(output)):
            slot = self._add(t, Kind.OUTPUT, rec.name, i, rec.call, module)
            if slot is not None:
                rec.out_slots.append(slot)
                rec.outputs.append(t)
                self._hook_grad(t, rec, Kind.GRAD_OUTPUT, i, rec.call)

    def _add(self, t: Any, kind: Kind, name: str, index: int, call: int,
             module: torch.nn.Module) -> Optional[int]:
        if not stats.measurable(t):
            return None
        slot = self.collector.add(t)
        tid = self.rec._tensor_id(kind, name, index, t, type(module).__name__)
        self.slot_meta.append((tid, call, slot, int(Source.REPLAY)))
        return slot

    def _hook_grad(self, t: torch.Tensor, rec: _CallRecord, kind: Kind, index: int,
                   call: int) -> None:
        if not (isinstance(t, torch.Tensor) and t.requires_grad):
            return
        target = rec.grad_out_slots if kind == Kind.GRAD_OUTPUT else rec.grad_in_slots

        def hook(grad: torch.Tensor) -> None:
            slot = self._add(grad, kind, rec.name, index, call, rec.module)
            if slot is not None:
                target.append((slot, self.fired))
                self.fired += 1
                if kind == Kind.GRAD_OUTPUT:
                    rec.grad_values.append(grad.detach())

        t.register_hook(hook)

    def _backward(self, outs: list) -> None:
        grads = self.cap.grads
        pairs = [(t, grads[i]) for i, t in enumerate(outs)
                 if i in grads and isinstance(t, torch.Tensor) and t.requires_grad]
        if not pairs:
            return
        params = [p for p in self.cap.root.parameters() if p.requires_grad]
        torch.autograd.grad([t for t, _ in pairs], params, [g for _, g in pairs],
                            allow_unused=True)

    # -- the verdict ------------------------------------------------------------------------

    def _decide(self, result: dict, rows: np.ndarray, input_bad: bool, outs: list) -> None:
        bad = rows["nonfinite"] > 0 if len(rows) else np.zeros(0, bool)

        def any_bad(slots):
            return any(bad[s] for s in slots)

        root_name = self.rec.names.get(self.cap.root, "")
        if input_bad:
            result.update(phase=Phase.INPUT, module=root_name,
                          module_type=type(self.cap.root).__name__)
            self._fill(result, rows, None)
            return
        for call in self.calls:  # execution order of completion is post-order; use start order
            if any_bad(call.out_slots) and not any_bad(call.in_slots) and \
                    not self._child_explains(call, bad):
                self._blame(result, rows, call, Phase.FORWARD)
                return
        order = sorted(((fired, -c.depth, c) for c in self.calls
                        for slot, fired in c.grad_in_slots if bad[slot]),
                       key=lambda x: (x[0], x[1]))
        for _, _, call in order:
            if not any(bad[s] for s, _ in call.grad_out_slots):
                self._blame(result, rows, call, Phase.BACKWARD)
                return
        grads_bad = any(not bool(torch.isfinite(g).all()) for g in self.cap.grads.values())
        outs_bad = any(stats.measurable(t) and not bool(torch.isfinite(t).all()) for t in outs)
        if grads_bad or (not outs_bad and self.rec._step.loss_sum is not None and
                         not bool(torch.isfinite(self.rec._step.loss_sum).all())):
            result.update(phase=Phase.LOSS, module="", module_type="")
            result["detail"]["output_grad_nonfinite"] = grads_bad
        self._fill(result, rows, None)

    def _child_explains(self, call: _CallRecord, bad: np.ndarray) -> bool:
        """A descendant that itself went non-finite from finite inputs is the real culprit."""
        for other in self.calls:
            if other is call or not self._descends(other, call):
                continue
            if any(bad[s] for s in other.out_slots) and not any(bad[s] for s in other.in_slots):
                return True
        return False

    def _descends(self, other: _CallRecord, call: _CallRecord) -> bool:
        if call.module is self.cap.root:
            return other.module is not self.cap.root
        return other.name.startswith(call.name + ".")

    def _blame(self, result: dict, rows: np.ndarray, call: _CallRecord, phase: Phase) -> None:
        result.update(phase=phase, module=call.name, module_type=type(call.module).__name__)
        if call.out_slots:
            result["culprit"] = int(self.slot_meta[call.out_slots[0]][0])
        self._fill(result, rows, call)
        check = _Fp32Check(self, call, phase, result["detail"]).run()
        result.update(check)
        if phase == Phase.FORWARD:
            self._probe_ops(call, result["detail"])

    def _probe_ops(self, call: _CallRecord, detail: dict) -> None:
        """Which op inside the culprit went non-finite first (tells a mask from a product)."""
        from .opprobe import first_nonfinite_op

        try:
            op = first_nonfinite_op(call.module, call.args, self.cap.autocast)
        except Exception as exc:  # noqa: BLE001 - some modules need kwargs we did not capture
            detail["op_error"] = f"{type(exc).__name__}: {exc}"[:300]
            return
        if op is not None:
            detail["op"] = op

    def _fill(self, result: dict, rows: np.ndarray, call: Optional[_CallRecord]) -> None:
        result["detail"]["nonfinite_modules"] = sum(
            1 for c in self.calls if any(rows["nonfinite"][s] for s in c.out_slots))
        if call is None:
            batch = [t for t in tensors_in((self.cap.args, self.cap.kwargs))
                     if stats.measurable(t)]
            mags = [float(t.detach().float().abs().nan_to_num(nan=0.0).max()) for t in batch]
            result["in_absmax"] = max(mags, default=math.nan)
            return
        if call.in_slots:
            result["in_absmax"] = float(np.nanmax(rows["absmax"][call.in_slots]))
        if call.out_slots:
            result["out_absmax"] = float(np.max(rows["absmax"][call.out_slots]))


class _Fp32Check:
    """Re-run the culprit alone in fp32 on its captured inputs."""

    def __init__(self, replay: _Replay, call: _CallRecord, phase: Phase, detail: dict):
        self.replay = replay
        self.replay_detail = detail
        self.call = call
        self.phase = phase

    def run(self) -> dict:
        call = self.call
        module = call.module
        if any(p.dtype != torch.float32 for p in module.parameters(recurse=True)
               if p.is_floating_point()):
            module = copy.deepcopy(module).float()
        args = _to_fp32(call.args)
        device_type = self.replay.cap.autocast[0]
        out: dict[str, Any] = {}
        try:
            with torch.autocast(device_type, enabled=False):
                if self.phase == Phase.BACKWARD:
                    out_t, finite = self._backward(module, args)
                else:
                    with torch.no_grad():
                        out_t = module(*args)
                    finite = all(bool(torch.isfinite(t).all()) for t in tensors_in(out_t)
                                 if stats.measurable(t))
        except Exception as exc:  # noqa: BLE001 - some modules refuse fp32 inputs
            self.replay_detail["fp32_error"] = f"{type(exc).__name__}: {exc}"
            return out
        out["fp32_finite"] = int(finite)
        mags = [float(t.detach().abs().float().nan_to_num(nan=math.inf).max())
                for t in tensors_in(out_t) if stats.measurable(t)]
        out["fp32_absmax"] = max(mags, default=math.nan)
        rows = [stats.exact(t) for t in tensors_in(out_t) if stats.measurable(t)]
        if rows:
            rec = self.replay.rec
            table = np.array(rows, dtype=schema.STATS)
            table["tensor"] = [rec._tensor_id(Kind.OUTPUT, call.name, i, t,
                                              type(call.module).__name__)
                               for i, t in enumerate(t for t in tensors_in(out_t)
                                                     if stats.measurable(t))][:len(rows)]
            table["source"] = int(Source.REPLAY_FP32)
            out["fp32_rows"] = table
        return out

    def _backward(self, module: torch.nn.Module, args: tuple):
        leaves = [a.detach().requires_grad_(True) if isinstance(a, torch.Tensor)
                  and a.is_floating_point() else a for a in args]
        with torch.enable_grad():
            out_t = module(*leaves)
        outs = [t for t in tensors_in(out_t) if isinstance(t, torch.Tensor) and t.requires_grad]
        grads_out = self._grad_outputs(outs)
        inputs = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
        if not outs or not inputs or grads_out is None:
            return out_t, True
        grads = torch.autograd.grad(outs, inputs, grads_out, allow_unused=True)
        finite = all(g is None or bool(torch.isfinite(g).all()) for g in grads)
        return out_t, finite

    def _grad_outputs(self, outs: list) -> Optional[list]:
        """The grad_output the culprit received in the replay, in fp32."""
        captured = self.call.grad_values
        if captured:
            return [g.float() for g in captured][: len(outs)]
        # Without a stored value, a unit gradient tests the backward formula itself.
        return [torch.ones_like(o) for o in outs]


# ---------------------------------------------------------------------------------------------
# helpers


def _rng_devices(device: Optional[torch.device]) -> list:
    if device is not None and device.type == "cuda":
        return [device.index if device.index is not None else torch.cuda.current_device()]
    return []


def _rng_state(device_type: str) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device_type == "cuda" and torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _autocast(device_type: str) -> tuple:
    from .recorder import _autocast_state

    enabled, dtype = _autocast_state(device_type)
    return (device_type, enabled, dtype, torch.is_autocast_cache_enabled())


def _autocast_code(state: tuple) -> int:
    if not state[1]:
        return int(schema.DType.UNKNOWN)
    return int(schema.DTYPE_NAMES.get(state[2], schema.DType.OTHER))


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name, torch.float16)


def _save_buffers(roots: list) -> list:
    seen: set[int] = set()
    saved = []
    for root in roots:
        for b in root.buffers():
            if id(b) not in seen:
                seen.add(id(b))
                saved.append((b, b.detach().clone()))
    return saved


def _restore_buffers(saved: list) -> None:
    with torch.no_grad():
        for b, value in saved:
            b.copy_(value)


def _to_fp32(args: Any) -> Any:
    if isinstance(args, torch.Tensor):
        return args.detach().float() if args.is_floating_point() else args
    if isinstance(args, tuple):
        return tuple(_to_fp32(a) for a in args)
    if isinstance(args, list):
        return [_to_fp32(a) for a in args]
    if isinstance(args, dict):
        return {k: _to_fp32(v) for k, v in args.items()}
    return args


def _scalar(t: Any) -> float:
    if isinstance(t, torch.Tensor):
        return float(t.detach().float().cpu())
    return math.nan if t is None else float(t)


def _write_batch(writer: Any, sid: int, cap: _Capture) -> None:
    """The captured batch and output gradient as arrays (size-capped, never pickled)."""
    items = [(f"args.{i}.{j}", t) for i, a in enumerate(cap.args)
             for j, t in enumerate(tensors_in(a))]
    items += [(f"kwargs.{k}.{j}", t) for k, v in cap.kwargs.items()
              for j, t in enumerate(tensors_in(v))]
    items += [(f"grad_output.{i}", g) for i, g in sorted(cap.grads.items())]
    budget = BATCH_BYTES
    rows = []
    for name, t in items:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_complex():
            continue
        arr = t.detach()
        if arr.dtype == torch.bfloat16:
            arr = arr.float()  # numpy has no bfloat16; fp32 holds every bf16 value exactly
        arr = arr.cpu().numpy()
        keep = arr
        if arr.nbytes > budget and arr.ndim:
            per_row = max(1, arr.nbytes // max(1, arr.shape[0]))
            keep = arr[: max(0, budget // per_row)]
        if keep.nbytes > budget:
            continue
        budget -= keep.nbytes
        row = schema.empty("arrays", 1)
        row["snapshot"] = sid
        row["name_off"], row["name_len"] = writer.text(name)
        row["dtype"] = keep.dtype.str.encode()
        row["ndim"] = min(arr.ndim, 8)
        row["shape"][0, : min(arr.ndim, 8)] = arr.shape[:8]
        row["numel"] = arr.size
        row["saved"] = keep.size
        row["data_off"], row["data_len"] = writer.bytes(np.ascontiguousarray(keep).tobytes())
        rows.append(row)
    if rows:
        writer.append("arrays", np.concatenate(rows))
