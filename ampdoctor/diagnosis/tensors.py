"""The /tensors table by tensor id, for the rules: the root modules (and whether a module is
the model itself), each id's kind, name, module class and size, a module's class, its siblings
in the other blocks, the modules of one class, a module's own parameters. ``TensorViews`` is
the first base of ``facts.Facts`` (with ``events.EventViews`` over it); each view is computed
once per run (``memo``).

Example::

    f = Facts(ampdoctor.load("run.h5"))
    f.siblings("blocks.0.attn")      # ['blocks.0.attn', 'blocks.1.attn', ...]
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from ..runfile.schema import Kind


class TensorViews:
    """The /tensors table of ``run`` by tensor id, each view computed on first use."""

    def __init__(self, run: Any):
        self.run = run
        self._cache: dict[str, Any] = {}

    def memo(self, key: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, computed on the first call with ``key`` and kept (a view other modules
        derive once per run, like ``progress.dead_units``)."""
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    @property
    def root_names(self) -> set[str]:
        """Names the recorder gives the root module(s): its class name, for a single root."""
        return set(self.run.roots)

    def is_the_model(self, module: str) -> bool:
        """Is ``module`` the model itself, so that an island around it would be the whole
        model in fp32? A root is, unless it is one of several models and has no submodule of
        its own (a Gram matrix after a frozen extractor: the island is around its op)."""
        roots = self.root_names
        if module not in roots:
            return False
        if len(roots) == 1:
            return True
        return any(n.startswith(module + ".") for n in self.tensor_names)

    @property
    def tensor_kinds(self) -> np.ndarray:
        """Each tensor id's ``Kind`` (-1 for an id the /tensors table does not hold)."""
        def build() -> np.ndarray:
            kinds = np.full(self._id_count(), -1, np.int64)
            kinds[self.run.tensors["id"]] = self.run.tensors["kind"]
            return kinds
        return self.memo("kinds", build)

    @property
    def tensor_names(self) -> list[str]:
        """Each tensor id's name ("blocks.0.attn", "fc.weight"; "" when unknown)."""
        return self.memo("names", lambda: self._by_id("name"))

    @property
    def tensor_types(self) -> list[str]:
        """Each tensor id's module class ("Attention"; "" when unknown or not a module)."""
        return self.memo("types", lambda: self._by_id("type"))

    @property
    def tensor_numel(self) -> np.ndarray:
        """Each tensor id's element count when first seen (0 when unknown)."""
        def build() -> np.ndarray:
            out = np.zeros(self._id_count(), np.int64)
            out[self.run.tensors["id"]] = self.run.tensors["numel"]
            return out
        return self.memo("numel", build)

    def _id_count(self) -> int:
        t = self.run.tensors
        return int(t["id"].max()) + 1 if len(t) else 0

    def _by_id(self, column: str) -> list[str]:
        """A /tensors text column as a list indexed by tensor id."""
        out = [""] * self._id_count()
        for i, value in zip(self.run.tensors["id"].tolist(), self.run.tensors[column].tolist()):
            out[i] = str(value)
        return out

    def module_type(self, name: str) -> Optional[str]:
        """Class of the module called ``name`` (from its OUTPUT row), if recorded."""
        kinds, names, types = self.tensor_kinds, self.tensor_names, self.tensor_types
        for i, n in enumerate(names):
            if n == name and kinds[i] == Kind.OUTPUT:
                return types[i] or None
        return None

    def siblings(self, module: str) -> list[str]:
        """``module`` and the same module in every block of its ModuleList, as recorded
        (``blocks.0.attn`` -> ``blocks.0.attn``, ``blocks.1.attn``, ...)."""
        parts = module.split(".")
        idx = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        if idx is None or not 0 < idx < len(parts) - 1:
            return [module]
        head, tail = ".".join(parts[:idx]) + ".", "." + ".".join(parts[idx + 1:])
        found = {n for n, k in zip(self.tensor_names, self.tensor_kinds)
                 if k == Kind.OUTPUT and n.startswith(head) and n.endswith(tail)
                 and n[len(head):len(n) - len(tail)].isdigit()}
        found.add(module)
        return sorted(found, key=lambda n: int(n[len(head):len(n) - len(tail)]))

    def modules_of_class(self, module_type: str) -> list[str]:
        """Every recorded module of class ``module_type`` (its OUTPUT rows), in the order the
        first forward met them: ``modules_of_class("RMSNorm")`` -> ``["blocks.0.norm", ...,
        "norm"]``. The root module is left out (an island around it is no island)."""
        roots = self.root_names
        return list(dict.fromkeys(
            n for n, k, t in zip(self.tensor_names, self.tensor_kinds, self.tensor_types)
            if k == Kind.OUTPUT and t == module_type and n and n not in roots))

    def own_params(self, module: str) -> list[str]:
        """The attribute names of ``module``'s own parameters, as recorded: ``["g"]`` for a
        norm whose gain is ``norm.g`` (those of its submodules left out)."""
        head = module + "."
        return list(dict.fromkeys(
            n[len(head):] for n, k in zip(self.tensor_names, self.tensor_kinds)
            if k == Kind.PARAM and n.startswith(head) and "." not in n[len(head):]))
