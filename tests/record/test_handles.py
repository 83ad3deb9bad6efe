"""Snippets written against the script's own objects (record/handles.py, /meta handles, and
diagnosis/fixes' module_expr / assign_module): each printed assignment is run against the
objects a recorded script holds, through the names it holds them by, and must replace the
module the diagnosis named."""

from __future__ import annotations

import pytest
import torch
from helpers import batches

import ampdoctor
from ampdoctor.diagnosis import fixes


class Net(torch.nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU())
            for _ in range(2))
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Task(torch.nn.Module):
    """A training task around the network, as timm's train.py builds one: the recorder's
    root, while the script calls the network ``model``."""

    def __init__(self, model):
        super().__init__()
        self.trainable_module = model

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.trainable_module(x), y)


class DistributedDataParallel(torch.nn.Module):
    """Stands for torch's DDP (recognised by its class name, as the recorder does): the
    wrapper holds the model as ``.module`` and has none of its attributes."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)


def _steps(run_path, call, params, n=2):
    opt = torch.optim.SGD(params, lr=0.01)
    with ampdoctor.watch(path=run_path, strict=True, forensics=False):
        for x, y in batches(n):
            call(x[:, :16], y % 4).backward()
            opt.step()
            opt.zero_grad()
    return ampdoctor.load(run_path)


def _island(path: str, handles: dict) -> str:
    ctx = fixes.Context(device="cpu", module=path, module_type="Linear", handles=handles)
    return fixes.make(["fp32_island"], ctx)[0].snippet


def _run_snippet(snippet: str, scope: dict) -> None:
    exec(compile(snippet, "<snippet>", "exec"), scope)  # noqa: S102 - the test's own snippet


def test_the_script_calls_the_network_inside_a_task_model(run_path):
    model = Net()
    task = Task(model)
    run = _steps(run_path, lambda x, y: task(x, y), model.parameters())
    # the recorder's root is the task; the script's `model` is the network inside it
    assert run.handles.get("trainable_module") == "model" and run.handles.get("") == "task"
    snippet = _island("trainable_module.head", run.handles)
    assert "model.head = FP32Island(model.head)" in snippet, snippet
    _run_snippet(snippet, {"model": model, "task": task})
    assert type(model.head).__name__ == "FP32Island"
    assert type(task.trainable_module.head).__name__ == "FP32Island"


def test_a_wrapper_is_reached_through_its_module_attribute(run_path):
    net = Net()
    model = DistributedDataParallel(net)
    del net  # the script holds only the wrapper
    run = _steps(run_path, lambda x, y: torch.nn.functional.cross_entropy(model(x), y),
                 model.parameters())
    assert run.handles == {"": "model.module"}
    snippet = _island("blocks.1.0", run.handles)
    assert "for block in model.module.blocks:" in snippet, snippet
    _run_snippet(snippet, {"model": model})
    assert all(type(b[0]).__name__ == "FP32Island" for b in model.module.blocks)


def test_two_roots_each_by_the_scripts_own_name(run_path):
    gen, disc = Net(), torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))

    def loss(x, y):
        return disc(gen(x)).mean() + 0 * y.sum()

    run = _steps(run_path, loss, list(gen.parameters()) + list(disc.parameters()))
    assert run.meta["roots"] == ["Net", "Sequential"]
    assert run.handles == {"Net": "gen", "Sequential": "disc"}
    snippet = _island("Sequential.1", run.handles)
    assert "disc[1] = FP32Island(disc[1])" in snippet, snippet
    _run_snippet(snippet, {"gen": gen, "disc": disc})
    assert type(disc[1]).__name__ == "FP32Island"


@pytest.mark.parametrize("name", ["we'ird\"name", "two\nlines", "class", "with space"])
def test_any_module_name_gives_valid_python(name):
    """A name that is no identifier (quotes, a line break, a keyword) is reached through
    get_submodule with the name quoted, and replaced through setattr on its parent."""
    model = Net()
    for block in model.blocks:  # (an island covers the same module in every block)
        block.add_module(name, torch.nn.Linear(16, 16))
    path = f"blocks.0.{name}"
    for fix_id in ("fp32_island", "revive_units", "rebalance_losses"):
        ctx = fixes.Context(device="cpu", module=path, module_type="ReLU", ratio=1e3)
        snippet = fixes.make([fix_id], ctx)[0].snippet
        compile(snippet, "<snippet>", "exec")  # valid Python, whatever the name
    _run_snippet(_island(path, {}), {"model": model})
    assert type(model.get_submodule(path)).__name__ == "FP32Island"


def test_a_handle_from_the_file_is_only_ever_a_dotted_name():
    """A run file travels: what /meta handles says reaches a snippet only as a dotted name."""
    from ampdoctor.runfile.run import _is_expression
    crafted = {"": "__import__('os').system('x')", "head": "net", "blocks": "a b",
               "x": "self.model.module", "y": "", "z": "model.", "w": "a;b"}
    assert [k for k, v in crafted.items() if _is_expression(v)] == ["head", "x"]
