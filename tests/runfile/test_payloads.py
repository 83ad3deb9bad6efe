"""The declared JSON payloads (runfile/payloads.py): every key a writer in ``ampdoctor/`` sets
and every key a reader reads on the one payload left a checked dict (a snapshot's
``detail``) is declared (the records, in payloads.py, detail.py and meta.py, are mypy's to
check: the event texts, compiled, lr_range, targets, /meta);
a payload checks its keys when used, reads a missing key as its default, keeps a newer
writer's keys, and writes the bytes ``json.dumps`` of a plain dict writes."""

import ast
import json
import math
import pathlib

import pytest
from conftest import ROOT

from ampdoctor.runfile import payloads
from ampdoctor.runfile.payloads import SnapshotDetail, UndeclaredKey

PACKAGE = pathlib.Path(ROOT) / "ampdoctor"
BY_NAME = {p.__name__: p for p in payloads.PAYLOADS}
METHODS = ("get", "setdefault", "pop")


class _Uses(ast.NodeVisitor):
    """Each (payload, key, line) a module names: ``x["key"]``, ``x.get("key")``, ``"key" in x``
    and ``Payload(key=...)``, where ``x`` is a snapshot's detail (``.detail``,
    ``["detail"]``), a payload built or parsed by name, or a local name bound to one."""

    def __init__(self):
        self.uses = []
        self.scopes = [{}]

    def payload(self, node):
        if isinstance(node, ast.Attribute) and node.attr == "detail":
            return SnapshotDetail
        if isinstance(node, ast.Subscript) and _const(node.slice) == "detail":
            return SnapshotDetail
        if isinstance(node, ast.Name):
            return self.scopes[-1].get(node.id)
        if isinstance(node, ast.IfExp):
            return self.payload(node.body)
        if isinstance(node, ast.BoolOp):
            return self.payload(node.values[0])
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in BY_NAME:
                return BY_NAME[f.id]
            if isinstance(f, ast.Attribute) and f.attr in ("from_json", "of") and \
                    isinstance(f.value, ast.Name) and f.value.id in BY_NAME:
                return BY_NAME[f.value.id]
        return None

    def use(self, payload, key, node):
        if payload is not None and isinstance(key, str):
            self.uses.append((payload, key, node.lineno))

    def visit_FunctionDef(self, node):
        self.scopes.append(dict(self.scopes[-1]))
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node):
        self.generic_visit(node)
        for target in node.targets:
            if isinstance(target, ast.Name):
                found = self.payload(node.value)
                if found is None:
                    self.scopes[-1].pop(target.id, None)
                else:
                    self.scopes[-1][target.id] = found

    def visit_Subscript(self, node):
        self.use(self.payload(node.value), _const(node.slice), node)
        self.generic_visit(node)

    def visit_Call(self, node):
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in METHODS and node.args:
            self.use(self.payload(f.value), _const(node.args[0]), node)
        found = self.payload(node)
        if found is not None and isinstance(f, (ast.Name, ast.Attribute)) and \
                getattr(f, "id", None) in BY_NAME:
            for kw in node.keywords:
                self.use(found, kw.arg, node)
        self.generic_visit(node)

    def visit_Compare(self, node):
        if len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            self.use(self.payload(node.comparators[0]), _const(node.left), node)
        self.generic_visit(node)


def _const(node):
    return node.value if isinstance(node, ast.Constant) else None


def uses_in(source):
    v = _Uses()
    v.visit(ast.parse(source))
    return v.uses


def all_uses():
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "payloads.py":
            continue
        for payload, key, line in uses_in(path.read_text()):
            out.append((payload, key, f"{path.relative_to(ROOT)}:{line}"))
    return out


def test_every_key_written_or_read_in_the_package_is_declared():
    uses = all_uses()
    assert len(uses) > 80  # the scan sees the writers and readers (a broken scan sees none)
    undeclared = [f"{where}: {key!r} is not a key of {p.__name__}"
                  for p, key, where in uses if key not in p.KEYS]
    assert not undeclared, "\n".join(undeclared)


def test_every_declared_key_is_used():
    used = {(p, key) for p, key, _ in all_uses()}
    unused = [f"{p.__name__}.{key}" for p in payloads.PAYLOADS for key in p.KEYS
              if (p, key) not in used]
    assert not unused, f"declared but never written or read: {unused}"


@pytest.mark.parametrize("line", [
    'f.detail["reproducd"] = True',                       # a writer's typo
    'x = s["detail"].get("stale_grad")',                  # a reader's
    'd = SnapshotDetail.of(snap["detail"])\nd.get("weight_nonfinite")',
    'ok = "fp32_eror" in finding.detail',
])
def test_a_typo_on_either_side_is_found(line):
    found = uses_in(line)
    assert found and any(key not in p.KEYS for p, key, _ in found)


def test_a_payload_checks_its_keys_when_used():
    d = SnapshotDetail(reproduced=True)
    with pytest.raises(UndeclaredKey, match="not a key of a snapshot's detail"):
        d["reproducd"] = False
    with pytest.raises(UndeclaredKey):
        d.get("stale_grad")
    with pytest.raises(UndeclaredKey):
        "fp32_eror" in d  # noqa: B015
    with pytest.raises(UndeclaredKey):
        SnapshotDetail(replay_eror="x")


def test_missing_keys_read_as_their_default_and_newer_keys_are_kept():
    d = SnapshotDetail.from_json('{"reproduced": false, "from_a_newer_writer": [1]}')
    assert d["reproduced"] is False and d.get("input_modified") is False
    assert d.get("micro_batches") == 1 and d["micro_batches"] == 1 and d.get("how") is None
    assert d.get("how", "") == ""
    assert json.loads(d.to_json())["from_a_newer_writer"] == [1]
    probe = payloads.FlatLossProbe.from_text("")
    assert math.isnan(probe.start) and probe.probe == 0
    assert payloads.HiddenNonfinite.from_text("not json").op == "?"
    for damaged in ("[1, 2]", "not json", None, "3"):
        assert SnapshotDetail.from_json(damaged) == {}


def test_the_json_written_is_what_a_plain_dict_writes():
    value = {"summary": "x", "trials": [{"fix": "a", "v": math.inf}], "history": {"lr": [1e-3]},
             "weights_nonfinite": ["w"], "op": object()}
    assert SnapshotDetail(value).to_json() == json.dumps(value, default=str)


def test_a_record_writes_the_keys_its_writer_set_in_the_order_the_dict_it_replaced_did():
    ran = payloads.LrRange(state="start", state_step=0, event_step=8, lr=0.1, batch="b",
                           steps=12, rungs=[payloads.LrRung(factor=1.0, lr=0.1,
                                                            losses=[2.0, math.inf])],
                           optimizer="SGD", seconds=1.5)
    assert list(json.loads(ran.to_text())) == ["state", "state_step", "event_step", "lr",
                                               "batch", "steps", "rungs", "optimizer",
                                               "max_norm", "seconds"]  # no clip: null
    assert ran.to_json()["rungs"][0]["losses"] == [2.0, "inf"]  # as text where not finite
    back = payloads.LrRange.from_text(ran.to_text())
    assert back.rungs is not None and math.isinf(back.rungs[0].losses[1])
    assert not payloads.LrRange.trains(back.rungs[0])
    note = payloads.LrRange(note="why", seconds=0.1)
    assert note.to_text() == json.dumps({"note": "why", "seconds": 0.1})
    op = payloads.CompiledOp(graph="forward", node="cosh", op="aten.cosh", module="1")
    assert list(op.to_json()) == ["graph", "node", "op", "module"]
