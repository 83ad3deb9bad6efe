"""A replay leaves no trace on the run, and the user's code does not see it.

``preserved`` is what every replay, culprit re-run, trial and proof runs inside. It

- forks the RNG of the CPU and of the listed CUDA devices;
- puts every module buffer back bit for bit (BatchNorm's running statistics, which a
  replayed forward updates);
- puts back the Python-side state of every module of the roots (a call counter, an EMA kept
  in a float or a plain tensor attribute, a list the forward appends to, an attribute it adds)
  and what each module's ``forward`` writes outside itself that its code names: the globals
  it assigns (``global CALLS``), the closure cells it rebinds (``nonlocal``), and the lists,
  dicts, sets and deques it reads from its globals or closure (a module-level ``LOG.append``);
  and, through a profile function while the replay runs, the same for every function of the
  user's it calls (a helper that logs, a method of a plain object: that object's attributes),
  each saved at its first call, before its body runs (``_Calls``); a signal handler that
  runs meanwhile is not the replay (a SIGTERM's stop flag, a signal ampdoctor holds back
  for later stay as it left them);
- sets the user's hooks aside while it runs and puts them back in their order afterwards:
  forward, backward and pre-hooks on the roots' modules, the global module hooks, the tensor
  hooks on their parameters, and any tensor hook the user's forward registers while the
  replay runs (it is not installed). torch's own hooks (``weight_norm``'s pre-hook computes
  the weight the module uses) and ampdoctor's keep running: they compute, they do not record;
- holds back what the user's code prints, logs or warns while it runs (stdout, stderr,
  ``logging``, every warning however it is shown) and leaves the ``warnings`` registries as
  they were, so that a warning the replay raised is not taken as already shown when the
  training raises it.

``rng_state`` and ``set_rng`` save and put back the generators a captured call ran with (the
replay's dropout masks are the step's own; preflight uses them too). ``.grad`` and the
optimizer are never touched by a replay in the first place (gradients are
read with ``torch.autograd.grad``). What it yields (``Isolation``) counts what was set aside
and held back; a snapshot's detail carries it (``isolation``), so a diagnosis can say that a
hook that changes values (a gradient reversal written as a tensor hook) did not run in the
replay.

What cannot be put back is refused: while a replay runs, its thread may not open a file for
writing, remove or rename one, start a process or open a connection (a Python audit hook,
installed at the first replay: ``sideeffects.py``). The user's code gets ``SideEffect`` where
it tried, so the replay stops there, the step is not replayed, and its snapshot says why
(``replay_error``). Other threads (a logger, a TensorBoard writer) are not affected.

What it cannot see: a file object opened before the replay and written in it, C-level state
(an ``lru_cache``), and an object reached only through another's attributes and changed in
place by library code (torch's, the standard library's).
A replay runs from the state the step left (a call counter one higher than the step saw): a
forward whose output depends on such state may replay differently, which ``reproduced``
reports.

Example (what ``Forensics`` wraps every replay and re-run in)::

    with preserved(roots, devices=[0]) as isolation:
        trace.run()
    isolation.hooks_set_aside   # user hooks that did not run
"""

from __future__ import annotations

import collections
import contextlib
import dis
import functools
import inspect
import logging
import os
import signal
import sys
import types
import warnings
from typing import Any, Iterator, Optional

import torch
from torch.nn.modules import module as module_hooks
from torch.utils.hooks import RemovableHandle

from ...runfile.detail import Isolation
from .sideeffects import no_writes


@contextlib.contextmanager
def preserved(roots: list, devices: list) -> Iterator[Isolation]:
    """Fork the RNG of the CPU and the listed CUDA devices; restore module buffers and the
    modules' Python state; set the user's hooks aside and hold back their output."""
    modules = list({id(m): m for root in roots for m in root.modules()}.values())
    isolation = Isolation()
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=devices))
        stack.callback(restore_buffers, saved_buffers(modules))
        stack.enter_context(_python_state(modules))
        stack.enter_context(_hooks_aside(modules, isolation))
        stack.enter_context(_no_user_tensor_hooks(isolation))
        stack.enter_context(_quiet(isolation))
        stack.enter_context(no_writes())
        yield isolation


def saved_buffers(modules: list, *, empty: bool = False) -> list:
    """``(module, name, buffer, copy)`` for each buffer of ``modules`` (``empty``: the None
    ones too), for ``restore_buffers``; preflight's ``Snapshot`` keeps its buffers so too."""
    return [(m, name, b, b.detach().clone() if b is not None else None)
            for m in modules for name, b in m._buffers.items() if b is not None or empty]


def restore_buffers(saved: list) -> None:
    """Put back each buffer object (a forward may have replaced the attribute) with its saved
    values bit for bit, written only where they differ; one that changed shape, dtype or
    device in place, or was None, gets the saved copy instead."""
    with torch.no_grad():
        for m, name, b, value in saved:
            if b is None or value is None or not _same_kind(b, value):
                m._buffers[name] = value
                continue
            m._buffers[name] = b
            if not same_bits(b, value):
                b.copy_(value)


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    try:
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    except RuntimeError:
        return False


def rng_devices() -> list:
    """CUDA devices whose RNG a replay may draw from: all of them, once CUDA is initialised
    (never initialise it here: a CPU run must not get a CUDA context)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return list(range(torch.cuda.device_count()))
    return []


def rng_state(devices: list) -> dict:
    """The CPU generator's state and that of each listed CUDA device (host copies, no sync):
    torch's RNGs saved once for the replay and for preflight (``set_rng`` puts them back)."""
    state: dict[Any, torch.Tensor] = {"cpu": torch.get_rng_state()}
    for d in devices:
        state[d] = torch.cuda.get_rng_state(d)
    return state


def set_rng(state: dict) -> None:
    """Put back the generators ``rng_state`` saved."""
    for key, value in state.items():
        if key == "cpu":
            torch.set_rng_state(value)
        else:
            torch.cuda.set_rng_state(value, key)


# -- the modules' Python state -----------------------------------------------------------------

# Attributes torch keeps on every module: the parameters, buffers, submodules and hook dicts
# have their own restore (buffers) or are set aside (hooks); they are never rebound here.
_TORCH_OWN = frozenset(k for k, v in vars(torch.nn.Module()).items() if isinstance(v, dict))
_CONTAINERS = (list, dict, set, collections.deque, bytearray)
_MISSING = object()


@contextlib.contextmanager
def _python_state(modules: list) -> Iterator[None]:
    """Put back every module's attributes (rebound, added, or changed in place), the globals
    and closure cells its forward's own code writes or mutates, and what each function of the
    user's that the replay calls finds before it runs (``_Calls``)."""
    saved = [_Namespace(vars(m)) for m in modules]
    for m in modules:
        saved.extend(_forward_namespaces(m))
    calls = _Calls(saved, {id(m) for m in modules})
    previous = sys.getprofile()
    if previous is None:  # (a profiler the user runs is left alone, and sees the replay)
        sys.setprofile(calls)
    try:
        yield
    finally:
        if previous is None:
            sys.setprofile(None)
        for ns in reversed(saved):
            ns.restore()


def _library_roots() -> tuple[str, ...]:
    """Where torch's, ampdoctor's and the standard library's code lives: their functions are
    not the user's (torch's own state is the RNG and the buffers, put back above)."""
    import sysconfig

    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    roots = {os.path.dirname(os.path.abspath(torch.__file__)), here}
    for key in ("stdlib", "platstdlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.add(os.path.abspath(path))
    return tuple(r + os.sep for r in sorted(roots))


class _Calls:
    """A profile function while a replay runs: when a function of the user's (a helper the
    forward calls, a method of an object it holds) is first called, before its body runs,
    the globals it assigns, the containers it reads from its globals and the attributes of
    the object it is a method of are saved, to be put back with the rest."""

    _LIBRARIES: Optional[tuple[str, ...]] = None

    def __init__(self, saved: list, known: set):
        self.saved, self.known = saved, known
        self.users: dict = {}  # code -> is it the user's (and a method)
        if _Calls._LIBRARIES is None:
            _Calls._LIBRARIES = _library_roots()
        self.handlers = _signal_handler_codes()
        self.handling: Any = None  # the frame of a signal handler running now

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if self.handling is not None:
            if frame is self.handling and event == "return":
                self.handling = None
            return
        if event != "call":
            return
        code = frame.f_code
        if code in self.handlers:
            # A signal that lands while the replay runs (a SIGTERM, the user's own handler
            # or ampdoctor's) is not the replay: what its handler changes (a stop flag, a
            # signal held back for later) stays changed.
            self.handling = frame
            return
        method = self.users.get(code)
        if method is None:
            method = self._first(frame, code)
        if method:
            self._method(frame)

    def _first(self, frame: Any, code: Any) -> bool:
        """A code object's first call: its globals saved if it is the user's; whether it is
        a method of the user's (its object is then saved at each call, once per object)."""
        name = code.co_filename
        if name.startswith(self._LIBRARIES or ()) or name.startswith("<"):
            self.users[code] = False
            return False
        self.saved.append(_globals_of(code, frame.f_globals))
        method = bool(code.co_argcount) and code.co_varnames[0] == "self"
        self.users[code] = method
        return method

    def _method(self, frame: Any) -> None:
        obj = frame.f_locals.get("self")
        namespace = getattr(obj, "__dict__", None)
        if isinstance(namespace, dict) and id(obj) not in self.known:
            self.known.add(id(obj))
            self.saved.append(_Namespace(namespace))
        return None


def _signal_handler_codes() -> frozenset:
    """The code of every Python signal handler set now (a function, a bound method, an
    object's ``__call__``)."""
    codes = set()
    for signum in signal.valid_signals():
        try:
            handler = signal.getsignal(signum)
        except (ValueError, OSError):
            continue
        if not callable(handler):
            continue
        target = getattr(handler, "__func__", handler)
        code = getattr(target, "__code__", None)
        if code is None:
            code = getattr(vars(type(handler)).get("__call__"), "__code__", None)
        if code is not None:
            codes.add(code)
    return frozenset(codes)


class _Namespace:
    """One dict of names (a module's ``__dict__``, a function's globals), saved for the names
    ``only`` lists (all but torch's own when None): each value's identity, and the contents
    of a container or a plain tensor, put back in place so that whoever else holds the same
    object sees it unchanged."""

    def __init__(self, names: dict, only: Any = None):
        self.names, self.only = names, only
        keys = [k for k in names if k not in _TORCH_OWN] if only is None else \
            [k for k in only]
        self.values = {k: names.get(k, _MISSING) for k in keys}
        self.contents = {k: c for k, v in self.values.items()
                         if (c := _contents(v)) is not None}

    def restore(self) -> None:
        if self.only is None:
            for k in [k for k in self.names if k not in self.values and k not in _TORCH_OWN]:
                del self.names[k]  # an attribute the replay added
        for k, v in self.values.items():
            if v is _MISSING:
                self.names.pop(k, None)
                continue
            self.names[k] = v
            if k in self.contents:
                _put_back(v, self.contents[k])


def _contents(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        return value.detach().clone()
    if isinstance(value, _CONTAINERS):
        # the items in a plain container of the base type: copying a subclass would rebuild
        # it through its own methods (a mapping that refuses writes raises)
        base: Any = next(t for t in _CONTAINERS if isinstance(value, t))
        return base(value)
    return None


def _put_back(obj: Any, saved: Any) -> None:
    if isinstance(obj, torch.Tensor):
        if not same_bits(obj, saved):
            with torch.no_grad():
                obj.copy_(saved)
    elif _unchanged(obj, saved):
        # nothing to put back: a container that refuses writes (diffusers' FrozenDict
        # config raises in update, after a clear would already have emptied it) is never
        # written
        return
    elif isinstance(obj, (dict, set, collections.deque)):
        obj.clear()
        obj.update(saved) if not isinstance(obj, collections.deque) else obj.extend(saved)
    else:  # list, bytearray
        obj[:] = saved


def _unchanged(obj: Any, saved: Any) -> bool:
    """The same items as when saved, each the same object (no value compared by ``==``)."""
    if len(obj) != len(saved):
        return False
    if isinstance(obj, dict):
        return all(k in obj and obj[k] is v for k, v in saved.items())
    if isinstance(obj, set):
        ids = {id(x) for x in obj}
        return all(id(x) in ids for x in saved)
    return all(a is b for a, b in zip(obj, saved))


class _Cells:
    """A function's closure cells, saved and put back (``nonlocal`` rebinds one)."""

    def __init__(self, cells: tuple):
        self.cells = cells
        self.values = [_cell_value(c) for c in cells]
        self.contents = [_contents(v) for v in self.values]

    def restore(self) -> None:
        for cell, value, content in zip(self.cells, self.values, self.contents):
            if value is _MISSING:
                continue
            cell.cell_contents = value
            if content is not None:
                _put_back(value, content)


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _MISSING


def _forward_namespaces(module: torch.nn.Module) -> list:
    """The globals a module's forward assigns or whose containers it reads, and its closure
    cells, each saved (``_Namespace``, ``_Cells``)."""
    fn = _function(getattr(module, "forward", None))
    if fn is None:
        return []
    out: list = [_globals_of(fn.__code__, fn.__globals__)]
    if fn.__closure__:
        out.append(_Cells(fn.__closure__))
    return out


def _globals_of(code: types.CodeType, names: dict) -> _Namespace:
    """The globals ``code`` assigns, and those whose containers it reads, saved."""
    stores, loads = _global_names(code)
    wanted = set(stores) | {n for n in loads if isinstance(names.get(n), _CONTAINERS)}
    return _Namespace(names, only=sorted(wanted))


def _function(fn: Any) -> Any:
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = inspect.unwrap(getattr(fn, "__func__", fn)) if fn is not None else None
    fn = getattr(fn, "__func__", fn)
    return fn if isinstance(fn, types.FunctionType) else None


@functools.lru_cache(maxsize=1024)
def _global_names(code: types.CodeType) -> tuple[tuple, tuple]:
    """(globals assigned, globals read) by ``code`` and the functions nested in it."""
    stores: list = []
    loads: list = []
    for ins in dis.get_instructions(code):
        if ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            stores.append(ins.argval)
        elif ins.opname == "LOAD_GLOBAL":
            loads.append(ins.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            inner = _global_names(const)
            stores.extend(inner[0])
            loads.extend(inner[1])
    return tuple(dict.fromkeys(stores)), tuple(dict.fromkeys(loads))


# -- the user's hooks ---------------------------------------------------------------------------

_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks",
                 "_backward_hooks")
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks",
                 "_global_backward_pre_hooks", "_global_backward_hooks")


@contextlib.contextmanager
def _hooks_aside(modules: list, isolation: Isolation) -> Iterator[None]:
    """Take the user's hooks out of every hook dict the replay would call, in place (a tensor's
    hook dict is held by autograd itself), and put them back in their order afterwards."""
    dicts = [getattr(m, name) for m in modules for name in _MODULE_HOOKS]
    dicts += [getattr(module_hooks, name) for name in _GLOBAL_HOOKS]
    dicts += [p._backward_hooks for m in modules for p in m.parameters(recurse=False)
              if p._backward_hooks]
    aside = []
    for hooks in dicts:
        users = [k for k, hook in hooks.items() if _users(hook)]
        if users:
            aside.append((hooks, list(hooks.items()), users))
            for k in users:
                del hooks[k]
            isolation.hooks_set_aside += len(users)
    try:
        yield
    finally:
        for hooks, items, users in aside:
            _put_hooks_back(hooks, items, users)


def _put_hooks_back(hooks: dict, items: list, users: list) -> None:
    """The saved order, with any hook added since (and still there) after it."""
    now = dict(hooks)
    hooks.clear()
    for k, hook in items:
        if k in users or k in now:
            hooks[k] = hook
    for k, hook in now.items():
        if k not in hooks:
            hooks[k] = hook


def _users(hook: Any) -> bool:
    """A hook that is neither torch's nor ampdoctor's: the user's code (or a library's)."""
    owner = _owner(hook)
    return not (owner == "torch" or owner.startswith(("torch.", "ampdoctor.")))


def _owner(hook: Any) -> str:
    fn = hook
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    owner = getattr(fn, "__module__", None)
    if not isinstance(owner, str):
        owner = type(fn).__module__
    return owner or ""


@contextlib.contextmanager
def _no_user_tensor_hooks(isolation: Isolation) -> Iterator[None]:
    """A tensor hook the user's code registers while the replay runs (a forward that collects
    its activations' gradients) gets a handle and is not installed; torch's and ampdoctor's
    own are."""
    original = torch.Tensor.register_hook

    def register_hook(self: torch.Tensor, hook: Any) -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller == "torch" or caller.startswith(("torch.", "ampdoctor.")):
            return original(self, hook)
        isolation.hooks_not_installed += 1
        return RemovableHandle(collections.OrderedDict())

    torch.Tensor.register_hook = register_hook  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.register_hook = original  # type: ignore[method-assign]


# -- the user's output --------------------------------------------------------------------------


class _Sink:
    """Stands in for stdout and stderr during a replay: the user's text is counted and held
    back; ampdoctor's own warnings go through to the real stream."""

    def __init__(self, through: Any):
        self.through, self.held = through, 0

    def write(self, text: str) -> int:
        if "ampdoctor" in text:
            return self.through.write(text)
        self.held += len(text)
        return len(text)

    def flush(self) -> None:
        pass


@contextlib.contextmanager
def _quiet(isolation: Isolation) -> Iterator[None]:
    """Hold back the user's printed and logged output; leave the warnings registries as they
    were (a warning shown in the replay would otherwise count as shown for the training)."""
    sink = _Sink(sys.stderr)
    registries = _warning_registries()
    disabled = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    show = getattr(warnings, "_showwarnmsg", None)

    def held(message: Any) -> None:
        # where every warning is shown, the C implementation's included: a user's
        # showwarning, logging.captureWarnings or catch_warnings(record=True) sees none
        if show is not None and "ampdoctor" in str(message.message):
            show(message)
        else:
            sink.held += len(str(message.message))

    warnings._showwarnmsg = held  # type: ignore[attr-defined]
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):  # type: ignore[type-var]
            yield
    finally:
        warnings._showwarnmsg = show  # type: ignore[attr-defined]
        logging.disable(disabled)
        _restore_registries(registries)
        isolation.output_held_back = sink.held


def _warning_registries() -> dict:
    once = getattr(warnings, "onceregistry", {})
    out: dict[Any, tuple] = {None: (once, dict(once))}
    for name, mod in list(sys.modules.items()):
        namespace = getattr(mod, "__dict__", None)
        registry = namespace.get("__warningregistry__") if isinstance(namespace, dict) else None
        if isinstance(registry, dict):
            out[name] = (registry, dict(registry))
    return out


def _restore_registries(saved: dict) -> None:
    for registry, content in saved.values():
        if registry != content:
            registry.clear()
            registry.update(content)
    for name, mod in list(sys.modules.items()):
        namespace = getattr(mod, "__dict__", None)
        if isinstance(namespace, dict) and name not in saved and \
                "__warningregistry__" in namespace:
            del namespace["__warningregistry__"]  # made by a warning in the replay
