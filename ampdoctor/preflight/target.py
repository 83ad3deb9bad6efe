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

import contextlib
import importlib
import importlib.util
import os
import sys
import traceback
from typing import Any, Callable, Iterator, Optional

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
    return _run(what, fn, args, lambda tb: True)


def run_checked(what: str, fn: Callable, *args: Any) -> Any:
    """``fn(*args)``, ampdoctor's own check, which calls the user's model and loss: an
    exception raised in their code is one sentence (exit 2: the check could not run, apart
    from ``--fail-on``'s exit 1, the check failed); one raised in ampdoctor's own code, or in
    torch called by it, is a bug and keeps its traceback."""
    return _run(what, fn, args, _raised_by_user)


def _run(what: str, fn: Callable, args: tuple, theirs: Callable[[Any], bool]) -> Any:
    """An exit is one sentence too (``sys.exit``; ``os._exit``, which would end ampdoctor
    with the script's code: 0 would pass a CI gate that checked nothing)."""
    try:
        with _no_exit():
            return fn(*args)
    except SystemExit as exc:
        raise AmpDoctorError(f"{what} exited (code {exc.code!r}) while ampdoctor ran it: the "
                             "code parity runs must return, not exit") from None
    except AmpDoctorError:
        raise
    except Exception:  # noqa: BLE001 - the user's code: told in one sentence, exit 2
        if not theirs(sys.exc_info()[2]):
            raise
        raise _raised(what) from None


@contextlib.contextmanager
def _no_exit() -> Iterator[None]:
    """``os._exit`` raises SystemExit while the user's code runs (it ends a process at once,
    past every handler: the exit code would be the script's, with nothing said)."""
    real = os._exit

    def exit_raises(code: int) -> None:
        raise SystemExit(code)

    os._exit = exit_raises  # type: ignore[assignment]
    try:
        yield
    finally:
        os._exit = real


_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ours(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_HERE + os.sep)


def _raised_by_user(tb: Any) -> bool:
    """Whether a frame after ampdoctor's last is the user's (not torch's, not the standard
    library's): their model or loss raised, directly or through torch."""
    frames = traceback.extract_tb(tb)
    last = max((i for i, f in enumerate(frames) if _ours(f.filename)), default=-1)
    return any(not _library(f.filename) for f in frames[last + 1:])


def _library(filename: str) -> bool:
    import numpy
    import torch

    roots = tuple(os.path.dirname(m.__file__ or "") for m in (torch, numpy, os))
    path = os.path.abspath(filename)
    return path.startswith(roots) or filename.startswith("<")


def _raised(what: str) -> AmpDoctorError:
    exc_type, exc, tb = sys.exc_info()
    frames = [f for f in traceback.extract_tb(tb) if not _ours(f.filename)]
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return AmpDoctorError(f"{what} raised {exc_type.__name__}: {exc}{where}")
