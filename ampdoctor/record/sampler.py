"""The sampled tier: full per-module and per-parameter statistics on one step in N.

On a sampled step a global forward hook sees every module of the watched model; each floating
output goes into a ``stats.Collector`` (device work, no sync), and a tensor hook on it catches
the gradient arriving there in backward. Tensor hooks on outputs, rather than full backward
hooks, keep in-place modules such as ``ReLU(inplace=True)`` working (pytorch#61519).

Containers (``nn.Sequential``, a block returning its last child's tensor) hand on a tensor a
child already produced: the (object, version) pair recognises it and it is not measured twice.
At the step's end ``stage`` queues the collector's and the parameter probe's device results in
the step's ``readback.HostRead`` (with the op probe's: one copy per device for the whole
sampled step) and gives the ``schema.STATS`` rows once it has run; ``finish`` does both.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..runfile import schema
from ..runfile.schema import Kind, Source
from . import stats
from .fp8 import Fp8Probe
from .readback import HostRead
from .sharding import local

MAX_DEPTH = 4  # nesting of tuples/lists/dicts searched for tensors in a module output


def tensors_in(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors inside a module output: tuples, lists, dict values (HF ModelOutput) — never
    generators or other iterables, which iterating would consume."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < MAX_DEPTH and isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item, depth + 1)
    elif depth < MAX_DEPTH and isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item, depth + 1)


class Sampler:
    """Statistics of one step: module outputs, their gradients, parameters, buffers, inputs.

    ``tensor_id(kind, name, index, t)`` comes from the recorder, which owns the /tensors table.
    ``warn(what)`` reports a tensor that could not be measured (once per name).
    ``fp8``: also what each fp8 recipe would do to every Linear's operands (``fp8.Fp8Probe``,
    its rows staged apart, for /fp8); ``self.fp8 = None`` turns it off.
    """

    def __init__(self, names: dict[torch.nn.Module, str], tensor_id: Callable[..., int],
                 warn: Callable[[str, BaseException], None], sample: int = stats.SAMPLE,
                 fp8: bool = True):
        self.names = names
        self.tensor_id = tensor_id
        self.warn = warn
        self.sample = sample
        self.collector = stats.Collector(sample=sample)
        self._rows: list[tuple[int, int, int]] = []  # per collector slot: tensor id, call, seq
        # Outputs measured this step, by (id, version): weak, so that measuring never keeps an
        # activation alive that autograd would have freed (a dead entry's id may be reused).
        self._seen: dict[tuple[int, int], weakref.ref] = {}
        self._calls: dict[int, int] = {}
        self._seq: collections.Counter = collections.Counter()
        self.active = False
        self._probe = _ParamProbe(sample)
        self.fp8: Fp8Probe | None = Fp8Probe(tensor_id, lambda: self.active, warn,
                                             sample=sample) if fp8 else None

    # -- forward and backward ---------------------------------------------------------------

    def on_forward(self, module: torch.nn.Module, output: Any, args: tuple = ()) -> None:
        name = self.names.get(module)
        if name is None:
            return
        call = self._calls.get(id(module), 0)
        self._calls[id(module)] = call + 1
        if self.fp8 is not None:
            self.fp8.on_module(module, name, call, args, output)
        for index, t in enumerate(tensors_in(output)):
            try:
                if t.is_inference():  # an evaluation inside the step, not the step's values
                    continue
                key = (id(t), t._version)
                seen = self._seen.get(key)
                if seen is not None and seen() is t:  # a container handing on its child's
                    continue
                self._seen[key] = weakref.ref(t)
                self._measure(t, Kind.OUTPUT, name, index, call, type(module).__name__)
            except Exception as exc:  # noqa: BLE001 - one odd output must not stop the rest
                self.warn(f"output {index} of {name} ({type(t).__name__})", exc)

    def _measure(self, t: torch.Tensor, kind: Kind, name: str, index: int, call: int,
                 owner_type: str) -> None:
        slot = self.collector.add(t)
        if slot is None:
            return
        tid = self.tensor_id(kind, name, index, t, owner_type)
        self._rows.append((tid, call, self._seq[kind]))
        self._seq[kind] += 1
        if kind == Kind.OUTPUT and t.requires_grad and t.grad_fn is not None:
            gid = self.tensor_id(Kind.GRAD_OUTPUT, name, index, t, owner_type)
            t.register_hook(lambda grad, gid=gid, call=call: self._on_grad(gid, call, grad))

    def _on_grad(self, gid: int, call: int, grad: torch.Tensor) -> None:
        if not self.active or grad is None:  # a step already ended; an unreached output of
            return None                         # a compiled region (its gradient is None)
        try:
            if self.collector.add(grad) is not None:
                self._rows.append((gid, call, self._seq[Kind.GRAD_OUTPUT]))
                self._seq[Kind.GRAD_OUTPUT] += 1
        except Exception as exc:  # noqa: BLE001
            self.warn(f"gradient of tensor {gid}", exc)
        return None

    def on_inputs(self, root_name: str, args: tuple, kwargs: dict) -> None:
        """The batch given to the root module (input audit). A tensor autograd computed in
        this step (a ``grad_fn``: another root's output, passed through the code between them)
        is not the data, and is not audited as such."""
        items = [(f"args.{i}", a) for i, a in enumerate(args)]
        items += [(f"kwargs.{k}", v) for k, v in kwargs.items()]
        for label, value in items:
            for index, t in enumerate(tensors_in(value)):
                if stats.measurable(t) and t.grad_fn is None:
                    name = f"{root_name}:{label}" if root_name else label
                    self._measure(t.detach(), Kind.INPUT, name, index, 0, "input")

    # -- parameters -------------------------------------------------------------------------

    def on_grads_ready(self, params: list[tuple[str, torch.Tensor]]) -> None:
        """Gradients as they stand before unscale_/clip/step (scaled space under a scaler)."""
        for name, p in params:
            if p.grad is not None and stats.measurable(p.grad):
                self._measure(p.grad, Kind.PARAM_GRAD, name, 0, 0, "param")

    def before_step(self, params: list[tuple[str, torch.Tensor]]) -> None:
        """Norms and a fixed sample of each parameter and its grad, to compare after the step."""
        if self._probe.started or not params:
            return
        named = [(self.tensor_id(Kind.PARAM, name, 0, p, "param"), p) for name, p in params
                 if p.grad is not None and stats.measurable(p)]
        self._probe.before(named)

    def after_step(self) -> None:
        self._probe.after()

    # -- buffers and the end of the step ----------------------------------------------------

    def on_buffers(self, buffers: list[tuple[str, torch.Tensor]]) -> None:
        for name, b in buffers:
            if stats.measurable(b):
                self._measure(b, Kind.BUFFER, name, 0, 0, "buffer")

    def finish(self, step: int) -> np.ndarray:
        """Every row of this step (one host sync per device); resets for the next sample."""
        read = HostRead()
        rows = self.stage(step, read)
        read.run()
        return rows()

    def stage(self, step: int, read: HostRead) -> Callable[[], np.ndarray]:
        """``finish`` in two halves: the step's device results queued in ``read`` (shared with
        the op probe: the sampled step's one copy per device), the rows from the returned
        function once ``read`` has run. Resets for the next sample now."""
        stats_rows = self.collector.stage(read)
        meta = np.array(self._rows, dtype=np.int64).reshape(-1, 3)
        probe_rows = self._probe.stage(read)
        self.reset()

        def rows() -> np.ndarray:
            out = stats_rows()
            if len(out):
                out["tensor"], out["call"], out["seq"] = meta[:, 0], meta[:, 1], meta[:, 2]
            out = np.concatenate([out, probe_rows()])
            out["step"] = step
            out["source"] = int(Source.SAMPLED)
            return out
        return rows

    def reset(self) -> None:
        self.collector.reset()
        self._rows.clear()
        self._seen.clear()
        self._calls.clear()
        self._seq = collections.Counter()
        self._probe = _ParamProbe(self.sample)
        if self.fp8 is not None:
            self.fp8.reset()


class _ParamProbe:
    """Weight norms and update ratios of the trained parameters across one optimizer step.

    Before the step: exact norms (one ``_foreach_norm`` per device and dtype) and, per
    parameter, the values and gradients at ``sample`` fixed positions. After: the values at
    the same positions. ``rows`` compares them for all parameters at once: update ratio
    |dW|/|W| and the fraction of sampled weights left unchanged although their gradient was
    not zero (updates lost to bf16/fp16 rounding).
    """

    def __init__(self, sample: int):
        self.sample = sample
        self.started = False
        self.params: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # tid, param, index
        self.norms: list[torch.Tensor] = []
        self.w0: list[torch.Tensor] = []
        self.g0: list[torch.Tensor] = []
        self.w1: list[torch.Tensor] = []

    def before(self, named: list[tuple[int, torch.Tensor]]) -> None:
        self.started = True
        with torch.no_grad():
            groups: dict[tuple, list[int]] = {}
            for i, (tid, p) in enumerate(named):
                w = local(p)  # per shard under FSDP: the part of p this rank holds
                idx = stats._INDEX.get(w.numel(), self.sample, w.device)
                self.params.append((tid, p, idx))
                self.w0.append(torch.take(w.detach(), idx))
                grad = local(p.grad) if p.grad is not None else None
                if grad is not None and stats.measurable(grad):
                    self.g0.append(torch.take(grad.detach(), idx))
                else:  # a sparse gradient (nn.Embedding(sparse=True)) or none: no sample
                    self.g0.append(torch.full(idx.shape, float("nan"), device=w.device,
                                              dtype=w.dtype))
                groups.setdefault((w.device, w.dtype), []).append(i)
            self.norms = [None] * len(named)
            for members in groups.values():
                norms = torch._foreach_norm([local(named[i][1]).detach() for i in members],
                                            2.0, dtype=torch.float32)
                for i, norm in zip(members, norms):
                    self.norms[i] = norm

    def after(self) -> None:
        with torch.no_grad():
            self.w1 = [torch.take(local(p).detach(), idx) for _, p, idx in self.params]

    def stage(self, read: HostRead) -> Callable[[], np.ndarray]:
        """The comparison's device results queued in ``read``; the rows once it has run."""
        n = len(self.params)
        rows = schema.empty("stats", n)
        if not n:
            return lambda: rows
        dev = self.norms[0].device
        rows["tensor"] = [tid for tid, _, _ in self.params]
        rows["numel"] = [local(p).numel() for _, p, _ in self.params]
        rows["dtype"] = [stats.dtype_code(p.dtype) for _, p, _ in self.params]
        rows["sample_n"] = [idx.numel() for _, _, idx in self.params]
        rows["seq"] = np.arange(n)
        results = [torch.stack([x.to(dev) for x in self.norms])]
        updated = bool(self.w1)
        if updated:
            w0 = torch.cat([x.to(dev).float() for x in self.w0])
            w1 = torch.cat([x.to(dev).float() for x in self.w1])
            g0 = torch.cat([x.to(dev).float() for x in self.g0])
            lengths = torch.tensor([x.numel() for x in self.w0], device=dev)
            seg = torch.repeat_interleave(torch.arange(n, device=dev), lengths)
            zero = torch.zeros(n, dtype=torch.float32, device=dev)
            d = w1 - w0
            moved = g0 != 0
            results += [zero.index_add(0, seg, d * d), zero.index_add(0, seg, w0 * w0),
                        zero.index_add(0, seg, ((w1 == w0) & moved).float()),
                        zero.index_add(0, seg, moved.float())]
        pending = read.add(torch.stack(results).double())

        def filled() -> np.ndarray:
            host = pending.value
            rows["norm"] = host[0]
            if updated:
                with np.errstate(invalid="ignore", divide="ignore"):
                    rows["update"] = np.sqrt(host[1]) / np.sqrt(host[2])
                    # No sampled element with a non-zero gradient: 0 of 0, not measured
                    # (a parameter behind a zero-initialised norm scale on its first step).
                    rows["unchanged"] = np.where(host[4] > 0, host[3] / np.maximum(host[4], 1),
                                                 np.nan)
            return rows
        return filled
