"""ampdoctor's bootstrap for ``ampdoctor record -- <command>``.

``record`` puts this directory first on ``PYTHONPATH``, so every Python interpreter the command
starts (the script, torchrun's workers, helper processes) runs this file at startup. It does as
little as it can there:

1. it waits for ``import torch`` with a one-shot import hook; only then does it load ampdoctor
   and start recording (``ampdoctor.record.command.child``). A script that never imports
   torch loads nothing of ampdoctor and records nothing;
2. it runs the ``sitecustomize`` this one hides (the user's own, or the distribution's), the
   way coverage.py's subprocess support does.

Outside ``ampdoctor record`` (``AMPDOCTOR_RECORD`` unset) it only does step 2.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
# the ampdoctor of ampdoctor/record/command/_bootstrap
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
# = record.command.launch.ENV_ACTIVE (not imported: startup stays light)
_ACTIVE = "AMPDOCTOR_RECORD"


def _start_recording():
    """torch has just been imported: start ampdoctor's recorder in this process."""
    try:
        _ampdoctor()
        import ampdoctor.record.command.child

        ampdoctor.record.command.child.start()
    except Exception as exc:  # noqa: BLE001 - never stop the user's script from starting
        sys.stderr.write("ampdoctor: not recording this process (%s: %s)\n"
                         % (type(exc).__name__, exc))


def _ampdoctor():
    """Import the ampdoctor that ``record`` runs from, whatever this interpreter's path holds."""
    if "ampdoctor" in sys.modules:
        return sys.modules["ampdoctor"]
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "ampdoctor", os.path.join(_PACKAGE, "__init__.py"), submodule_search_locations=[_PACKAGE])
    module = importlib.util.module_from_spec(spec)
    sys.modules["ampdoctor"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["ampdoctor"]
        raise
    return module


class _TorchLoader:
    """Wraps torch's own loader for one call: run torch's ``__init__``, then start recording."""

    def __init__(self, loader, hook):
        self._loader = loader
        self._hook = hook

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        # torch sees its real loader (resources, reloads); this wrapper never outlives the call.
        module.__spec__.loader = module.__loader__ = self._loader
        first = self._hook.take()
        self._loader.exec_module(module)
        if first:
            _start_recording()


class _TorchImportHook:
    """A meta path finder that answers nothing but ``import torch``, until torch is imported.

    A lookup is not an import: ``importlib.util.find_spec("torch")``, which datasets,
    transformers and accelerate call to ask whether torch is installed before any of them
    imports it, gets torch's spec with the loader wrapped and leaves the hook in place; the
    hook goes, and the recording starts, only when a loader it handed out runs torch's
    ``__init__``."""

    def __init__(self):
        self._taken = False

    def take(self):
        """Torch is being imported: the hook leaves ``sys.meta_path``; True the first time."""
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        first, self._taken = not self._taken, True
        return first

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or self._taken:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _TorchLoader(spec.loader, self)
        return spec


def _chain():
    """Run the next ``sitecustomize`` on the path, which this file would otherwise hide.

    Executed from source without importlib.util, whose import would cost every interpreter
    of the command more than the rest of this file.
    """
    here = os.path.normcase(_HERE)
    for entry in sys.path:
        folder = os.path.abspath(entry or os.curdir)
        if os.path.normcase(folder) == here:
            continue
        for candidate in (os.path.join(folder, "sitecustomize.py"),
                          os.path.join(folder, "sitecustomize", "__init__.py")):
            if os.path.isfile(candidate):
                module = type(sys)("sitecustomize")
                module.__file__ = candidate
                if candidate.endswith("__init__.py"):
                    module.__path__ = [os.path.dirname(candidate)]
                sys.modules["sitecustomize"] = module  # `import sitecustomize` finds theirs
                with open(candidate, "rb") as source:
                    code = compile(source.read(), candidate, "exec")
                exec(code, module.__dict__)
                return


if os.environ.get(_ACTIVE) == "1":
    if "torch" in sys.modules:  # imported by a .pth file before we ran
        _start_recording()
    else:
        sys.meta_path.insert(0, _TorchImportHook())
_chain()
