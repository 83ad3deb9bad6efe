"""Which ranks hold an fp8 layer's operand whole (``record/replicas.py``), read from the layout
in one process under torch's fake process group (4 ranks, this one rank 3; no collective runs):
a DTensor's placements on a 2 x 2 mesh, DDP's process group (the default one and a sub-group),
what is never declared (a plain activation, a shard, a partial sum), and a torchao fp8 model
given to ``watch()`` inside DDP, whose /meta fp8_layers names the ranks. The same through
``ampdoctor record -- torchrun``: ``tests/integration/test_fp8_ranks.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

import ampdoctor
from ampdoctor.record.replicas import Replicas


@pytest.fixture(scope="module")
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    yield DeviceMesh("cpu", torch.arange(4).view(2, 2))  # rank 3 at (1, 1)
    dist.destroy_process_group()


@pytest.mark.parametrize("placements,ranks", [
    ((Shard(0), Replicate()), [2, 3]),  # sharded over rows of the mesh: its row's ranks
    ((Replicate(), Shard(0)), [1, 3]),
    ((Replicate(), Replicate()), [0, 1, 2, 3]),
    ((Shard(0), Shard(1)), None),  # a shard: this rank's alone
    ((Partial(), Replicate()), None),  # a partial sum is not the tensor
])
def test_a_dtensor_is_held_whole_along_its_replicated_mesh_dimensions(fake_world, placements,
                                                                        ranks):
    t = DTensor.from_local(torch.randn(4, 4), fake_world, placements, run_check=False)
    found = Replicas().of("input", t)
    assert (found or {}).get("ranks") == ranks
    if ranks:
        assert found["by"] == "dtensor" and len(found["placements"]) == 2


def test_a_ddp_weight_is_held_whole_by_its_process_group(fake_world):
    r = Replicas()
    whole, part = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    r.saw(DDP(whole))
    r.saw(DDP(part, process_group=dist.new_group([1, 3])))
    x = torch.randn(2, 4)
    assert r.describe(whole, x) == {"weight": {"ranks": [0, 1, 2, 3], "by": "ddp"}}
    assert r.describe(part, x) == {"weight": {"ranks": [1, 3], "by": "ddp"}}
    # the input is each rank's own batch; a module DDP does not wrap is not declared
    assert r.of("input", x) is None and r.describe(torch.nn.Linear(4, 4), x) == {}


def test_a_ddp_model_given_to_watch_names_its_fp8_weights_replicas(fake_world, tmp_path):
    ao = pytest.importorskip("torchao.float8")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
    ao.convert_to_float8_training(model, config=dataclasses.replace(
        ao.Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    path = tmp_path / "run.h5"
    with ampdoctor.watch(ddp, opt, path=str(path), every=1, fp8_trial=0):
        for _ in range(2):
            with ddp.no_sync():  # (the fake group's all-reduce cannot run DDP's comm hook)
                ddp(torch.randn(8, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    with ampdoctor.load(str(path)) as run:
        layers = run.fp8_layers
    assert sorted(layers) == ["0", "1"]
    for layer in layers.values():
        assert layer["replicas"] == {"weight": {"ranks": [0, 1, 2, 3], "by": "ddp"}}
