"""``SCRIPT[:FUNCTION]`` for ``ampdoctor parity``: a function of the user's that builds what to
check and returns ``(model, batch)`` or ``(model, batch, loss_fn)``.

SCRIPT is a Python file (``models/check.py``) or an importable module (``mypkg.models``);
FUNCTION defaults to ``make``. A file is imported under a name of its own, not ``__main__``,
so that its ``if __name__ == "__main__":`` training block does not run; its directory is on
``sys.path`` while it loads, so it can import the modules beside it::

    # parity_check.py
    def make():
        model = GPT(GPTConfig(n_layer=2))
        x = torch.randint(0, 50257, (4, 64))
        return model, x, lambda logits: F.cross_entropy(logits.flatten(0, 1), x.flatten())

    $ ampdoctor parity parity_check.py:make --dtype float16
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from typing import Any, Callable, Optional

from ..errors import AmpDoctorError

DEFAULT_FUNCTION = "make"


def load(target: str) -> tuple[Any, Any, Optional[Callable]]:
    """Import SCRIPT, call FUNCTION(), and check what it returned."""
    script, _, name = target.rpartition(":") if ":" in target else (target, "", "")
    name = name or DEFAULT_FUNCTION
    module = _import(script)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AmpDoctorError(f"{script} has no function {name}: define {name}() returning "
                             "(model, batch) or (model, batch, loss_fn)")
    made = _guarded(f"{script}:{name}()", fn)
    if not isinstance(made, (tuple, list)) or len(made) not in (2, 3):
        raise AmpDoctorError(f"{script}:{name}() returned {type(made).__name__}; it must "
                             "return (model, batch) or (model, batch, loss_fn)")
    model, batch, loss_fn = (tuple(made) + (None,))[:3]
    if loss_fn is not None and not callable(loss_fn):
        raise AmpDoctorError(f"the third value {script}:{name}() returned is a "
                             f"{type(loss_fn).__name__}, not a loss function")
    return model, batch, loss_fn


def _import(script: str) -> Any:
    if script.endswith(".py") or os.sep in script or os.path.isfile(script):
        if not os.path.isfile(script):
            raise AmpDoctorError(f"{script} does not exist")
        path = os.path.abspath(script)
        spec = importlib.util.spec_from_file_location(
            "ampdoctor_target_" + os.path.splitext(os.path.basename(path))[0], path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(path))
        try:
            _guarded(script, spec.loader.exec_module, module)
        finally:
            sys.path.remove(os.path.dirname(path))
        return module
    try:
        found = importlib.util.find_spec(script) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise AmpDoctorError(f"{script} is neither a file nor an importable module")
    return _guarded(script, importlib.import_module, script)


def _guarded(what: str, fn: Callable, *args: Any) -> Any:
    """Run the user's code; an exception becomes one sentence naming where it was raised."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - the user's code: told in one sentence, exit 2
        raise _raised(what) from None


def _raised(what: str) -> AmpDoctorError:
    exc_type, exc, tb = sys.exc_info()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frames = [f for f in traceback.extract_tb(tb)
              if not os.path.abspath(f.filename).startswith(here + os.sep)]
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return AmpDoctorError(f"{what} raised {exc_type.__name__}: {exc}{where}")
