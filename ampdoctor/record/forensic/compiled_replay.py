"""The compiler, not the numbers: a compiled model's failing step replayed compiled.

A replay runs compiled code eagerly (``compiled.eager``), so a NaN that only the compiled
model makes (a decomposition, a fusion, a lowering that computes differently) replays finite
and would read as "did not reproduce". Where the eager replay of a compiled model's step is
finite (``detail.reproduced`` False), ``examine`` runs the step again with its compiled
regions compiled afresh, up a ladder of backends (``RUNGS``), each adding one layer of
``torch.compile``:

1. ``aot_eager``: the graph dynamo and AOT autograd capture, each op run eagerly;
2. ``decomposed``: the same with inductor's decompositions (what ``aot_eager_decomp_partition``
   runs), each op run eagerly;
3. ``inductor``: the default backend, generated kernels.

The first two run their graphs node by node (``_Probe``): the first node whose output is
non-finite from finite inputs is the op named (its source line, the op it was decomposed
from). A step non-finite on a rung is reproduced by the compiler; with several regions, each
is compiled alone on the lowest rung that reproduced, to name the one. The fixes are tried on
the same step as the proofs' are (``detail.trials``): the region run eagerly
(``compiler_disable``), a backend that keeps it finite (``compile_backend``).

No observer effect: the user's compiled code and dynamo's caches of it are never used nor
changed. Each region is compiled from a fresh code object (``_fresh``: dynamo caches per code
object, so the user's entries and recompile counts are untouched), with ``fullgraph=True``
(a graph break would hand the user's own frames to dynamo: such a region is reported as not
compiled, not replayed) and ``dynamic=False``; only for the trial are the region's modules
given that entry point as their ``forward`` (their ``__dict__`` put back exactly after). The
replay's guarantees (``isolated.preserved``) hold around it; inductor writes its cache and runs
the C++ compiler only inside the backend call (``sideeffects.writes_allowed``), its backward
compiled there too. Event only, and at most ``MAX_REPLAYS`` per run (each compiles).

Example (what ``Forensics._run`` does after a finite replay)::

    compiled_replay.examine(captures, finding, names)
    finding.detail.compiled["reproduced"]   # True: the compiled step is non-finite
"""

from __future__ import annotations

import contextlib
import re
import time
import types
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Optional

import torch

from ...runfile.detail import TriedFix
from ...runfile.payloads import CompiledOp, CompiledReplay, CompiledRung
from .. import compiled, stats
from ..sampler import tensors_in
from .culprit import Culprit
from .sideeffects import writes_allowed
from .trace import unwrap
from .trial import AS_RECORDED, Outcome, Trial, recorded_scale, rerun_step

MAX_REPLAYS = 2  # compiled replays per run: each compiles every region up to three times
MAX_REGIONS = 4  # regions compiled one at a time to name the one
RUNGS = ("aot_eager", "decomposed", "inductor")
DEFAULT = "inductor"


@dataclass
class Region:
    """One compiled region: its name, the eager module whose forward it compiles, and that
    forward as the user wrote it (bound)."""

    name: str
    module: torch.nn.Module
    forward: Callable
    prefix: str = ""  # what the recorder's names of its modules start with ("" at a root)


def regions(captures: list, names: dict) -> list[Region]:
    """The outermost compiled regions of the step's models (a region inside another is
    compiled with it)."""
    found: dict[int, Region] = {}
    for cap in captures:
        root = cap.root
        if compiled.kind(root) == compiled.WRAPPER:
            inner = unwrap(root)
            found.setdefault(id(inner), Region(names.get(root) or type(inner).__name__,
                                               inner, inner.forward, ""))
        for name, m in unwrap(root).named_modules():
            region = _region(m, names.get(m) or name)
            if region is not None:
                found.setdefault(id(region.module), region)
    outer = list(found.values())
    inside = {id(m) for r in outer for m in r.module.modules() if m is not r.module}
    return [r for r in outer if id(r.module) not in inside]


def _region(m: torch.nn.Module, name: str) -> Optional[Region]:
    k = compiled.kind(m)
    prefix = f"{name}." if name else ""
    if k == compiled.WRAPPER:
        inner = unwrap(m)
        return Region(name, inner, inner.forward, prefix)
    if k == compiled.FORWARD:
        orig = getattr(m.__dict__["forward"], "_torchdynamo_orig_callable", None)
        return Region(name, m, orig, prefix) if callable(orig) else None
    if k == compiled.CALL:
        return Region(name, m, type(m).forward.__get__(m), prefix)
    return None


def examine(captures: list, finding: Culprit, names: dict, step: Optional[int] = None,
            strict: bool = False) -> bool:
    """A finite replay of a compiled model's failing step, replayed compiled (see the module
    docstring): ``finding.detail.compiled`` and, where it reproduced, its ``trials`` and
    summary. Returns whether it ran (it counts against ``MAX_REPLAYS``)."""
    if finding.detail.reproduced is not False:
        return False
    regs = regions(captures, names)
    if not regs:
        return False
    began = time.perf_counter()
    out = CompiledReplay(regions=[r.name for r in regs], reproduced=False)
    # The backward at the scale the eager replay was judged at (reproduced.py: 1 where the
    # recorded one overflowed a finite step's gradients, as at GradScaler's first steps).
    as_eager = replace(AS_RECORDED, scale=finding.detail.rerun_scale)
    try:
        _ladder(captures, names, regs, out, as_eager)
        if out.reproduced:
            _locate(captures, names, regs, out, as_eager)
            finding.detail.trials = _trials(captures, names, regs, out, finding, step,
                                               as_eager)
            finding.summary = summary(out)
    except Exception as exc:  # noqa: BLE001 - the eager replay's finding stands without it
        if strict:
            raise
        out.error = f"{type(exc).__name__}: {exc}"[:300]
    out.seconds = round(time.perf_counter() - began, 3)
    finding.detail.compiled = out
    return True


def _ladder(captures: list, names: dict, regs: list, out: CompiledReplay, t: Trial) -> None:
    """The step with every region compiled by each rung: outcome and first non-finite op."""
    rungs = []
    for rung in RUNGS:
        probe: list[CompiledOp] = []
        outcome, error = _run(captures, names, regs, rung, probe, t)
        rungs.append(CompiledRung(backend=rung, finite=outcome.finite if outcome else None,
                                  outcome=outcome, op=probe[0] if probe else None,
                                  error=error or None))
    out.rungs = rungs
    failed = [r for r in rungs if r.finite is False]
    out.reproduced = bool(failed)
    if failed:
        out.backend = failed[0].backend
        out.op = next((r.op for r in failed if r.op), None)


def _run(captures: list, names: dict, regs: list, rung: str, probe: list[CompiledOp],
         t: Trial) -> tuple[Optional[Outcome], str]:
    """The step with ``regs`` compiled by ``rung``; (outcome, "") or (None, why not)."""
    try:
        with _compiled(regs, rung, probe):
            return rerun_step(captures, t, names), ""
    except torch._dynamo.exc.Unsupported as exc:  # fullgraph: a graph break
        return None, f"not one graph (a graph break): {str(exc).splitlines()[0][:200]}"


def _locate(captures: list, names: dict, regs: list, out: CompiledReplay, t: Trial) -> None:
    """The region that reproduces: the only one, or each compiled alone on the lowest rung
    that reproduced."""
    if len(regs) == 1:
        out.region = regs[0].name
        _name_module(out, regs[0])
        return
    rung, alone = out.backend or DEFAULT, []
    for r in regs[:MAX_REGIONS]:
        outcome, _ = _run(captures, names, [r], rung, [], t)
        if outcome is not None and not outcome.finite:
            alone.append(r.name)
    out.alone = alone
    if alone:
        out.region = alone[0]
        _name_module(out, next(r for r in regs if r.name == alone[0]))


def _name_module(out: CompiledReplay, region: Region) -> None:
    """The op's module by the recorder's name for it (dynamo's path is from the region)."""
    op = out.op
    if op is not None and op.module is not None:
        rel = op.module
        out.op = replace(op, module=f"{region.prefix}{rel}" if rel else region.name)


def _trials(captures: list, names: dict, regs: list, out: CompiledReplay, finding: Culprit,
            step: Optional[int], t: Trial) -> dict[str, TriedFix]:
    """The fixes tried on the step, as ``proofs.prove`` writes them: the region run eagerly,
    the rest compiled by the default backend; a lower backend that kept it finite."""
    trials: dict[str, TriedFix] = {}
    region = out.region
    rest = [r for r in regs if r.name != region]
    if region is not None and rest:
        outcome, error = _run(captures, names, rest, DEFAULT, [], t)
        trials["compiler_disable"] = _as_trial(outcome, error, step)
    elif region is not None:
        again = finding.detail.rerun
        trials["compiler_disable"] = TriedFix(
            tried=True, finite=True, step=step, loss=again.loss if again else None, first="",
            note="the eager replay: the only compiled region run eagerly")
    finite = [r for r in out.rungs or [] if r.finite]
    if finite:
        best = finite[-1]
        trials["compile_backend"] = replace(_as_trial(_outcome(best), "", step),
                                            backend=best.backend)
    if t.scale is not None:  # as proofs.prove says a trial run at another loss scale
        scaled = recorded_scale(captures[0])
        trials = {k: replace(one, at_scale=t.scale, recorded_scale=scaled) if one.tried
                  else one for k, one in trials.items()}
    return trials


def _outcome(rung: CompiledRung) -> Outcome:
    o = rung.outcome or Outcome()
    return Outcome(o.trial, finite=o.finite, first=o.first, loss=o.loss)


def _as_trial(outcome: Optional[Outcome], error: str, step: Any) -> TriedFix:
    if outcome is None:
        return TriedFix(note=error or "not run", step=step)
    return TriedFix(tried=True, finite=outcome.finite, loss=outcome.loss, first=outcome.first,
                    step=step)


def summary(out: CompiledReplay) -> str:
    """The finding in one sentence, from what the compiled replay measured."""
    failed = [r.backend for r in out.rungs or [] if r.finite is False]
    finite = [r.backend for r in out.rungs or [] if r.finite]
    region = out.region or ", ".join(out.regions)
    text = (f"the replay run eagerly is finite, but compiled again ({', '.join(failed)}) the "
            f"step is non-finite: torch.compile of {region} makes the NaN, not the numbers")
    if finite:
        text += f" ({', '.join(finite)}: finite)"
    op = out.op
    if op is not None and op.op:
        text += f"; first non-finite op {op.op}"
        if op.decomposed_from:
            text += f" (decomposed from {op.decomposed_from})"
        if op.source:
            text += f" at {op.source}"
    return text


# ---------------------------------------------------------------------------------------------
# compiling a region afresh


def _call(forward: Callable, *args: Any, **kwargs: Any) -> Any:
    return forward(*args, **kwargs)


def _fresh() -> Callable:
    """``_call`` with a code object of its own: dynamo keeps its cache on the code object,
    so nothing compiled here is ever looked up by, or counted against, the user's code."""
    code = _call.__code__.replace()
    return types.FunctionType(code, _call.__globals__, "_call")


@contextlib.contextmanager
def _compiled(regs: list, rung: str, probe: list[CompiledOp]) -> Iterator[None]:
    """Inside the block, each region's module runs its forward compiled afresh by ``rung``'s
    backend (the modules' ``__dict__`` put back exactly after)."""
    made: list = []  # inductor's compiled graphs
    with writes_allowed():  # inductor and torch.compile make their cache folders
        entries = [_entry(r.forward, _backend(rung, probe, made)) for r in regs]
    saved = []
    try:
        for r, entry in zip(regs, entries):
            d = r.module.__dict__
            saved.append((d, "forward" in d, d.get("forward")))
            d["forward"] = entry
        yield
    finally:
        for d, had, old in reversed(saved):
            if had:
                d["forward"] = old
            else:
                d.pop("forward", None)
        for graph in made:
            # A graph inductor found in its cache shares the loaded module with the user's;
            # freeing this one would strip that module (CompiledFxGraph.__del__).
            graph.compiled_fn_runner = None


def _entry(forward: Callable, backend: Any) -> Callable:
    fn = torch.compile(_fresh(), backend=backend, fullgraph=True, dynamic=False)

    def run(*args: Any, **kwargs: Any) -> Any:
        # The replay runs under the force_eager stance; this region alone is compiled. Dynamo
        # and the backend write their caches here; the user's code is traced (fullgraph), and
        # never run as Python.
        with torch.compiler.set_stance("default"), writes_allowed():
            return fn(forward, *args, **kwargs)

    return run


def _backend(rung: str, probe: list[CompiledOp], made: list) -> Callable:
    """The rung's backend; inductor's with its backward compiled at once, inside the call
    (where writes are allowed: ``_entry``), its graphs into ``made``."""
    if rung == "inductor":
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner(*args: Any, **kwargs: Any) -> Any:
            graph = compile_fx_inner(*args, **kwargs)
            if hasattr(graph, "compiled_fn_runner"):
                made.append(graph)
            return graph

        def inductor(gm: Any, example_inputs: Any) -> Any:
            # (AOT autograd's cache would hand back graphs that ``inner`` never sees)
            with torch._functorch.config.patch(force_non_lazy_backward_lowering=True,
                                               enable_autograd_cache=False):
                return compile_fx(gm, example_inputs, inner_compile=inner)

        return inductor
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def probed(kind: str) -> Callable:
        def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            return make_boxed_func(lambda *args: _Probe(gm, kind, probe).run(*args))
        return compiler

    if rung == "aot_eager":
        return aot_autograd(fw_compiler=probed("forward"), bw_compiler=probed("backward"))
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    return aot_autograd(fw_compiler=probed("forward"), bw_compiler=probed("backward"),
                        decompositions=select_decomp_table(),
                        partition_fn=min_cut_rematerialization_partition)


class _Probe(torch.fx.Interpreter):
    """A graph run node by node: the first node whose output is non-finite while its inputs
    are finite, into ``found`` (once: the forward's graph runs before the backward's)."""

    def __init__(self, gm: torch.fx.GraphModule, kind: str, found: list[CompiledOp]):
        super().__init__(gm)
        self.kind = kind
        self.found = found

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if not self.found and n.op == "call_function" and not _finite(out) and \
                all(_finite(self.env.get(i)) for i in n.all_input_nodes):
            self.found.append(_node(n, self.kind))
        return out


def _finite(value: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors_in(value)
               if stats.measurable(t))


def _node(n: torch.fx.Node, kind: str) -> CompiledOp:
    """What a graph node says of where it came from: its op, the op it was decomposed from,
    the user's source line and module."""
    meta = n.meta
    frm = meta.get("original_aten")
    op = _op_name(n.target)
    trace = [line.strip() for line in str(meta.get("stack_trace") or "").splitlines()
             if line.strip() and set(line.strip()) - set("^~ ")]  # (3.11's carets)
    source = None
    if len(trace) >= 2:
        where = trace[-2].replace("File ", "")
        source = f"{where}: {trace[-1]}"[:300]
    stack = meta.get("nn_module_stack")
    module = None
    if isinstance(stack, dict) and stack:
        path = list(stack.values())[-1]
        module = _module_path(str(path[0] if isinstance(path, tuple) else path))
    return CompiledOp(graph=kind, node=n.name, op=op, source=source, module=module,
                      decomposed_from=_op_name(frm) if frm is not None and
                      _op_name(frm) != op else None)


def _module_path(path: str) -> str:
    """Dynamo's source of a module, from the region's forward, as a module name:
    ``L['forward'].__self__.blocks[0].attn`` -> ``blocks.0.attn`` ("": the region itself)."""
    for root in ("__self__", "L['self']"):
        if root in path:
            path = path.split(root, 1)[1]
    path = re.sub(r"\._modules\['([^']*)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path.strip(".")[:200]


def _op_name(target: Any) -> str:
    """``aten.cosh`` for ``torch.ops.aten.cosh.default`` (another overload keeps its name)."""
    if isinstance(target, torch._ops.OpOverload):
        name = str(target)
        return name[:-len(".default")] if name.endswith(".default") else name
    return str(getattr(target, "__name__", target))
