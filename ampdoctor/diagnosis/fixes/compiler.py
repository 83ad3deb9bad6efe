"""Fixes for a NaN only the compiled model makes (verdict ``compiler``): run the region that
makes it eagerly, compile with a backend the replay found finite, report it upstream.

Each names what the compiled replay measured (``Context.compiled``: the region, the first
non-finite op and the module it sits in, the backend that kept the step finite).
"""

from __future__ import annotations

from .registry import Advice, Context, fix, module_expr


def _where(c: Context) -> str:
    """The module to run eagerly: the one the first non-finite op sits in, else the region."""
    got = c.compiled or {}
    return str(got.get("op_module") or c.module or "")


@fix("compiler_disable", "run the compiled region that makes the NaN eagerly "
     "(torch.compiler.disable)", manual="the script wraps the module's forward itself")
def compiler_disable(c: Context) -> Advice:
    where = _where(c)
    target = module_expr(where, c.handles) if where and not c.root else "model"
    op = (c.compiled or {}).get("op")
    why = f" (its {op} is what the compiled graph gets wrong)" if op else ""
    snippet = (f"{target}.forward = torch.compiler.disable({target}.forward)\n"
               "# before torch.compile(model): dynamo breaks the graph around it, and the "
               "rest stays compiled")
    return (f"Run {where or 'the region'} eagerly inside the compiled model{why}: "
            "torch.compiler.disable leaves it to eager PyTorch, whose step the replay found "
            "finite.", snippet)


@fix("compile_backend", "compile with a backend the replay found finite (aot_eager)",
     manual="the script passes the backend to torch.compile")
def compile_backend(c: Context) -> Advice:
    backend = (c.compiled or {}).get("finite_backend") or "aot_eager"
    snippet = (f'model = torch.compile(model, backend="{backend}")\n'
               "# dynamo's graph and AOT autograd kept, each op run eagerly (slower than "
               "inductor)")
    return (f"Compile with backend=\"{backend}\" until the default backend is fixed: the "
            "same step compiled with it is finite.", snippet)


@fix("report_compiler_bug", "report the compiled model's NaN upstream, with the minifier's "
     "repro", manual="the report is filed by hand",
     replay="a report is filed, not run")
def report_compiler_bug(c: Context) -> Advice:
    got = c.compiled or {}
    op = got.get("op") or "the op"
    frm = f" (decomposed from {got['decomposed_from']})" if got.get("decomposed_from") else ""
    snippet = ("# a minimal repro of the accuracy failure, written by PyTorch's minifier:\n"
               "#   TORCHDYNAMO_REPRO_AFTER=aot TORCHDYNAMO_REPRO_LEVEL=4 python train.py\n"
               "# then file it at https://github.com/pytorch/pytorch/issues with\n"
               f"#   {op}{frm}, python -m torch.utils.collect_env")
    return (f"Report it upstream: eager PyTorch computes this step finite and torch.compile "
            f"does not, at {op}{frm}. PyTorch's minifier cuts the model down to a repro.",
            snippet)
