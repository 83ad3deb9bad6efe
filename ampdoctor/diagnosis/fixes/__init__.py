"""The fixes a diagnosis suggests, each with a snippet written for the user's own run.

A fix id is part of the public contract (JSON output, tests, docs). Snippets use what the run
recorded: the culprit module's path and class (``blocks.3.attn``, ``Attention``), the optimizer
class and its learning rate and eps, the scaler's settings, the autocast device. The names of
the user's *variables* are not recorded, so snippets call them ``model``, ``optimizer``,
``scaler`` and ``loss``.

Each fix is one function, registered under its id by ``@fix(id, meaning)``: it returns the
advice and its snippet (and, when the snippet carries a number, the ``Dose`` it took the
number from), and ``make`` turns them into a ``Fix`` with that id.

The numbers are the run's: ``Context.dose(name)`` asks the measurer the diagnosis gives the
context (``diagnosis/dose.py``: the LR from the update ratios, the loss scale from the
gradients, Adam's eps from the optimizer state, ``max_norm`` from the healthy steps), and a
context with no run behind it gets the documented defaults of ``DEFAULTS``, each saying why.

Each fix also says how to try it on the whole run with no code change (``apply``: the
argument of ``ampdoctor record --apply``, see ``record/apply/prescription.py``), or why it cannot be
applied from outside the code (``apply_note``); and whether it was tried on the saved failing
step (``tried``, ``outcome``, ``finite``: filled by the forensic replay where it can try it).

Example::

    ctx = Context(module="blocks.3.attn", module_type="Attention", lr=3e-4)
    [fx.id for fx in make(["fp32_island", "lower_lr"], ctx)]   # ['fp32_island', 'lower_lr']
    make(["adam_eps"], ctx)[0].values                          # {'eps': 0.0001} (the default)

numpy-free and torch-free: plain strings. ``registry.py`` holds the registry and the helpers
the writers share; the writers live by family: ``precision.py`` (range and precision: islands,
bf16, the loss scale, eps, master weights), ``loss.py`` (the loss and its inputs),
``script.py`` (the training script's calls), ``training.py`` (not the precision: the LR, dead
units, the device), ``fp8.py`` (a run already in fp8: a layer kept in bf16, another
recipe), ``compiler.py`` (a NaN only the compiled model makes). ``FIX_IDS`` lists every id
with its meaning. ``premises.py`` holds what must hold for a fix to apply, each declared on
its ``@fix(..., premise=...)``: ``make`` offers a fix only where it holds, and ``unmet`` checks
a finished diagnosis's fixes against the same declarations.
"""

from . import compiler, fp8, loss, precision, script, training  # noqa: F401 - each registers its fixes
from .registry import (
                       DEFAULTS,
                       FIX_IDS,
                       MAKERS,
                       NOT_REPLAYABLE,
                       PREMISES,
                       Advice,
                       Applier,
                       Context,
                       Dose,
                       Fix,
                       assign_module,
                       fix,
                       is_attention,
                       make,
                       module_expr,
                       unmet,
)

__all__ = ["DEFAULTS", "FIX_IDS", "MAKERS", "NOT_REPLAYABLE", "PREMISES", "Advice", "Applier",
           "Context", "Dose", "Fix", "assign_module", "fix", "is_attention", "make",
           "module_expr", "unmet"]
