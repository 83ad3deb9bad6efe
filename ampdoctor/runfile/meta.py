"""The records of ``/meta`` (schema.py lists its keys): the optimizers, the GradScaler, the
losses, the sharding, the buffers at start and the fixes applied (``record --apply``) of a
run, declared once as frozen dataclasses (records.py). The recorder builds them and
``Writer.meta`` writes their JSON; ``Run``'s accessors (run.py) read them back, so that a
reader names a field mypy knows, never a key.

Example::

    opt = run.optimizers[0]         # OptimizerInfo(name='AdamW', hyper={'lr': 0.001, ...})
    opt.name, opt.lr, opt.eps       # 'AdamW', 0.001, 1e-08
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .records import Record


def _number(value: Any) -> float | None:
    """A hyperparameter as a number: None where torch's default was not one (a tensor kept
    as text, a tuple)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


@dataclass(frozen=True)
class OptimizerInfo(Record):
    """One ``/meta`` ``optimizer`` entry (record/environment.py): an optimizer as its run
    built it. ``hyper`` is its ``defaults`` as torch names them (lr, eps, betas, momentum,
    weight_decay, ...: those it has)."""

    name: str = ""  # its class: "AdamW"
    hyper: dict[str, Any] = field(default_factory=dict)
    groups: int = 0  # param groups
    param_dtypes: dict[str, int] = field(default_factory=dict)  # dtype -> elements
    state_dtypes: dict[str, str] = field(default_factory=dict)  # state name -> its dtype

    NAMES = {"name": "class"}

    @property
    def lr(self) -> float | None:
        return _number(self.hyper.get("lr"))

    @property
    def eps(self) -> float | None:
        return _number(self.hyper.get("eps"))

    @property
    def momentum(self) -> float | None:
        return _number(self.hyper.get("momentum"))


@dataclass(frozen=True)
class ScalerInfo(Record):
    """``/meta`` ``scaler`` (record/environment.py): the GradScaler's settings."""

    name: str = ""  # its class: "GradScaler", "ShardedGradScaler"
    enabled: bool = False
    init_scale: float | None = None
    growth_factor: float | None = None
    backoff_factor: float | None = None
    growth_interval: int | None = None
    device: str = ""
    own_found_inf: bool = False  # each step's own found_inf is recorded (OWN_NONFINITE_GRAD)

    NAMES = {"name": "class"}


@dataclass(frozen=True)
class LossSlot(Record):
    """One ``/meta`` ``losses`` entry (record/objectives.py): a loss of a run that backwards
    several, by its ``/losses`` slot."""

    site: str = ""  # file:line of its backward
    frames: list[str] = field(default_factory=list)  # the frames that called it
    optimizers: list[int] = field(default_factory=list)  # those it feeds
    reaches: list[int] | None = None  # those whose parameters its graph reaches (None: unknown)
    settled: bool = False


@dataclass(frozen=True)
class ShardingInfo(Record):
    """``/meta`` ``sharding`` (record/sharding.py): how the watched model is sharded, and
    why forensic replay is off. The layout's own fields are those of its kind: a DTensor's
    mesh, placements and counts, FSDP1's strategies."""

    kind: str = ""  # "fsdp2", "fsdp1", "dtensor", "deepspeed"
    local_shards: bool = False  # per-parameter statistics are of each rank's own shard
    world_size: int = 1
    grad_norm: str = ""  # what /steps grad_norm is on such a run
    replay: str = ""  # "off" (always, for a sharded model) or "disabled" (forensics off)
    replay_reason: str | None = None
    mesh: list[int] | None = None  # DTensor: the device mesh's shape
    placements: list[str] | None = None
    sharded_params: int | None = None
    params: int | None = None
    strategy: list[str] | None = None  # FSDP1: the sharding strategies

    OMIT = frozenset({"replay_reason", "mesh", "placements", "sharded_params", "params",
                      "strategy"})


@dataclass(frozen=True)
class BuffersInfo(Record):
    """``/meta`` ``buffers`` (record/buffers.py): the buffers non-finite when the recording
    first saw each model, before its first forward."""

    nonfinite_at_start: list[str] = field(default_factory=list)  # the first MAX_NAMED
    more_nonfinite: int = 0  # those past them
    unchecked: list[str] = field(default_factory=list)  # models whose buffers were not read


@dataclass(frozen=True)
class AppliedFix(Record):
    """One ``/meta`` ``applied`` entry (record/apply/treatment.py, record/command/child.py):
    a ``record --apply`` form and what applying it did. The fields after ``error`` are each
    form's own (``use_bf16``: scaler; ``losses_fp32``: functions; ``fp32_island``: modules,
    missing, skipped; ``fp8``: recipe to model), written only where they apply."""

    fix: str = ""  # the form's name: "lr_factor", "fp32_island"
    arg: str = ""  # as given: "lr_factor=0.028"
    error: str | None = None  # why it could not be applied (the run ran without it)
    scaler: str | None = None  # "disabled": the GradScaler bf16 no longer needs
    functions: int | None = None  # the torch loss functions run in fp32
    modules: list[str] | None = None  # the islands found so far
    missing: list[str] | None = None  # the islands named that no module matched (yet)
    skipped: dict[str, str] | None = None  # island -> why it was left as it was
    recipe: str | None = None  # the fp8 recipe
    keep: list[str] | None = None  # the Linears named to keep in high precision
    converted: list[str] | None = None  # the Linears converted to fp8
    kept: dict[str, str] | None = None  # Linear -> why it was not converted
    emulated: bool | None = None  # fp8 emulated (no fp8 matmul on the device)
    model: str | None = None  # the class of the model converted

    OMIT = frozenset({"error", "scaler", "functions", "modules", "missing", "skipped",
                      "recipe", "keep", "converted", "kept", "emulated", "model"})
