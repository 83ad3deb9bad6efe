"""Views of a loaded run that the diagnosis rules share, each computed once.

numpy only (no torch). ``Facts`` wraps a ``store.Run``: the small tables are read whole, the
big ``/stats`` table is streamed once in chunks (``Reduced``), reduced on the fly to arrays per
step and per tensor, so memory stays bounded however long the run. ``ScaleStory`` reads the
GradScaler's history from ``/steps`` and tells normal calibration apart from trouble. The
views of the /tensors table (names, kinds, a module's siblings) are ``tensors.TensorViews``',
those of /events and /snapshots (the exception, the replays, the probes) ``events.EventViews``':
``Facts`` builds on both.

Thresholds live next to the rules that read them (``thresholds.py`` for the shared ones); the
few here describe GradScaler itself and are commented where they are defined.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..runfile.meta import OptimizerInfo, ScalerInfo
from ..runfile.payloads import SnapshotDetail
from ..runfile.schema import DType, Event, flag
from . import curve, objectives
from .dose import Doses
from .events import EventViews
from .fixes import Context
from .fixes.premises import relu_free
from .scale import ScaleStory, scale_story
from .streamed import Reduced, stream_stats

ADAM_FAMILY = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "SparseAdam", "Adagrad", "Adadelta",
               "RMSprop", "Adafactor", "LAMB", "Lamb", "FusedAdam", "FusedLAMB", "AdamW8bit",
               "Adam8bit", "PagedAdamW", "DeepSpeedCPUAdam")


def fp16_rounds_to_zero(x: float) -> bool:
    """Does ``x`` become 0.0 when stored in fp16? (round to nearest: |x| <= 2**-25)"""
    return x != 0 and abs(float(np.float16(x))) == 0.0


def module_of(param_name: str) -> str:
    """'blocks.3.attn.qkv.weight' -> 'blocks.3.attn.qkv'; buffers alike."""
    return param_name.rsplit(".", 1)[0] if "." in param_name else param_name


# -- the run's precision: decided here once, for the diagnosis and the release material ------


def autocast_dtype(run: Any) -> Optional[str]:
    """The dtype autocast computed in, or None when it was off (or never seen)."""
    ac = run.autocast
    return ac.get("dtype") if ac is not None and ac.get("enabled") else None


def param_dtypes(run: Any) -> dict[str, int]:
    """Elements per dtype of the trained parameters (optimizer's view, else the model's)."""
    out: dict[str, int] = {}
    for o in run.optimizers:
        for k, v in o.param_dtypes.items():
            out[k] = out.get(k, 0) + int(v)
    if not out and run.model is not None:
        out = {k: int(v) for k, v in (run.model.get("param_dtypes") or {}).items()}
    return out


def params_mostly(run: Any, dtype: str) -> bool:
    d = param_dtypes(run)
    total = sum(d.values())
    return bool(total) and d.get(dtype, 0) * 2 >= total


def low_precision(run: Any) -> Optional[str]:
    """'fp16', 'bf16' or None: the narrow float type the run computes in (autocast's dtype,
    else the trained weights' when they are mostly half, else an fp16 loss).

    Example::

        low_precision(ampdoctor.load("run.h5"))   # 'fp16'
    """
    ac = autocast_dtype(run)
    if ac == "float16" or params_mostly(run, "float16"):
        return "fp16"
    if ac == "bfloat16" or params_mostly(run, "bfloat16"):
        return "bf16"
    if len(run.steps) and np.any(run.steps["loss_dtype"] == DType.FLOAT16):
        return "fp16"
    return None


class Facts(EventViews):
    """Derived views of a ``Run`` for the rules. Properties are computed on first use; the
    views of the /tensors table are ``tensors.TensorViews``', those of /events and /snapshots
    ``events.EventViews``'.

    Example::

        f = Facts(ampdoctor.load("run.h5"))
        f.low_precision, f.story.collapsed, f.reduced.layer_under
    """

    def __init__(self, run: Any, chunk: int = 1 << 16):
        super().__init__(run)
        self.steps = run.steps
        self.meta = run.meta
        self.chunk = chunk
        # the run this one is measured against (``diagnose(..., baseline=)``: fp8.Baseline)
        self.baseline: Any = None
        self.fp8_ranks: Any = None  # a job's rank files side by side: fp8ranks.Agreement

    # -- configuration ---------------------------------------------------------------------

    @property
    def n(self) -> int:
        return len(self.steps)

    @property
    def autocast_dtype(self) -> Optional[str]:
        return autocast_dtype(self.run)

    @property
    def device_type(self) -> str:
        ac = self.run.autocast
        if ac is not None and ac.get("device_type"):
            return str(ac["device_type"])
        dev = self.run.device
        return str(dev.get("type", "cuda")) if dev is not None else "cuda"

    @property
    def optimizers(self) -> list[OptimizerInfo]:
        return self.run.optimizers

    @property
    def param_dtypes(self) -> dict[str, int]:
        """Elements per dtype of the trained parameters (optimizer's view, else the model's)."""
        return param_dtypes(self.run)

    def params_mostly(self, dtype: str) -> bool:
        return params_mostly(self.run, dtype)

    @property
    def low_precision(self) -> Optional[str]:
        """'fp16', 'bf16' or None: the narrow float type the run computes in."""
        return low_precision(self.run)

    @property
    def scaler(self) -> Optional[ScalerInfo]:
        return self.run.scaler

    @property
    def has_scaler(self) -> bool:
        return self.story.has_scaler

    # -- steps -----------------------------------------------------------------------------

    @property
    def step_values(self) -> np.ndarray:
        return self.steps["step"]

    @property
    def skipped(self) -> np.ndarray:
        return self.steps["skipped"] == 1

    @property
    def loss_bad(self) -> np.ndarray:
        """Steps whose loss was non-finite, less those of GradScaler's calibration whose loss
        held gradients taken at the loss scale (``Event.PENALTY_AT_SCALE``: the AMP docs'
        gradient penalty), where a scale too high for them is what the loss shows."""
        def find() -> np.ndarray:
            flags = self.steps["flags"]
            bad = (flags & flag(Event.NONFINITE_LOSS)) != 0
            skipped = self.skipped
            lead = int(np.argmin(skipped)) if not skipped.all() else len(skipped)
            at_scale = (flags & flag(Event.PENALTY_AT_SCALE)) != 0
            calibrating = np.zeros(len(bad), bool)
            calibrating[:lead] = True
            return bad & ~(calibrating & at_scale & skipped)
        return self.memo("loss_bad", find)

    @property
    def grad_bad(self) -> np.ndarray:
        return (self.steps["flags"] & flag(Event.NONFINITE_GRAD)) != 0

    @property
    def loss_ok(self) -> np.ndarray:
        loss = self.steps["loss"]
        return np.isfinite(loss)

    def step_at(self, index: int) -> int:
        return int(self.steps["step"][index])

    def index_of(self, step: int) -> int:
        return min(int(np.searchsorted(self.steps["step"], step)), max(self.n - 1, 0))

    def first(self, mask: np.ndarray) -> Optional[int]:
        """Step number of the first True in a per-step mask."""
        idx = np.flatnonzero(mask)
        return int(self.steps["step"][idx[0]]) if len(idx) else None

    @property
    def objectives(self) -> list[objectives.Objective]:
        """Each loss of a run that backwarded several, with its own curve (``objectives``)."""
        return self.memo("objectives", lambda: objectives.read(self))

    @property
    def curve(self) -> curve.Curve:
        """The loss curve read once: start and end levels, noise, spikes (``curve.read``)."""
        return self.memo("curve", lambda: curve.read(self.steps["loss"]))

    @property
    def story(self) -> ScaleStory:
        return self.memo("story", lambda: scale_story(self.steps, self.scaler, self.loss_bad))

    @property
    def failure_index(self) -> Optional[int]:
        """Position of the first failing step: the first non-finite loss or the start of the
        skipping that lasts to the end, whichever is first; else the first skipped step that
        GradScaler's calibration and probing do not explain. Without a scaler a non-finite
        gradient is applied to the weights, so it starts the failure too."""
        def find():
            if not self.n:
                return None
            # A non-finite loss, or skipping that goes on to the end, is the failure; the
            # unexplained skips before it are the scale's staircase on the way there.
            applied = self.grad_bad if not self.story.has_scaler else np.zeros(self.n, bool)
            starts = [int(i[0]) for i in (np.flatnonzero(self.loss_bad | applied),) if len(i)]
            if self.story.terminal_run:
                starts.append(self.n - self.story.terminal_run)
            if starts:
                return self._walk_back(min(starts))
            bad = self.story.bad_skip | (self.grad_bad if not self.story.has_scaler else False)
            idx = np.flatnonzero(bad)
            return int(idx[0]) if len(idx) else None
        return self.memo("failure_index", find)

    def _walk_back(self, i: int) -> int:
        """Back over the unexplained skips that lead into the failure (the scale's staircase),
        across single applied steps between them."""
        bad = self.story.bad_skip
        while i > 0:
            if bad[i - 1]:
                i -= 1
            elif i > 1 and bad[i - 2]:
                i -= 2
            else:
                break
        return i

    @property
    def failure_step(self) -> Optional[int]:
        i = self.failure_index
        return None if i is None else self.step_at(i)

    @property
    def horizon(self) -> int:
        """Step number where pre-failure reductions stop (failure step, or past the end)."""
        s = self.failure_step
        return int(s) if s is not None else (int(self.steps["step"][-1]) + 1 if self.n else 0)


    # -- statistics --------------------------------------------------------------------------


    @property
    def reduced(self) -> Reduced:
        """The /stats table streamed once and reduced per step and per tensor (``Reduced``)."""
        return self.memo("reduced", lambda: stream_stats(
            self.run, self.tensor_kinds, self.tensor_names, self.step_values, self.skipped,
            self.horizon, self.low_precision or "fp16", self.chunk,
            still=self.steps["lr"] == 0))

    def first_nonfinite_sampled(self) -> Optional[dict]:
        """The first non-finite tensor in the sampled tier: {"step", "module", "phase"}."""
        x = self.reduced.first_nonfinite
        return {k: x[k] for k in ("step", "module", "phase")} if x else None

    @property
    def sampled_steps(self) -> int:
        return int(self.reduced.sampled.sum())

    def fix_context(self, module: Optional[str] = None, module_type: Optional[str] = None,
                    step: Optional[int] = None) -> Context:
        """What fix snippets may name, from the run's recorded configuration: the optimizer,
        its peak LR and eps, the scaler's settings, the device, and the culprit ``module`` (its
        class looked up when not given) and first bad ``step`` a rule found."""
        opt = self.optimizers[0] if self.optimizers else OptimizerInfo()
        scaler = self.scaler or ScalerInfo()
        lrs = self.steps["lr"][np.isfinite(self.steps["lr"])] if self.n else np.zeros(0)
        lr = float(lrs.max()) if len(lrs) else opt.lr
        if module and not module_type:
            module_type = self.module_type(module)
        clip_call = self.run.clip or {}
        clip = clip_call.get("max_norm")
        value = clip_call.get("clip_value", clip_call.get("clip_factor"))
        return Context(device=self.device_type, optimizer=opt.name or "AdamW",
                       lr=lr, eps=opt.eps, init_scale=scaler.init_scale,
                       growth_interval=scaler.growth_interval, module=module,
                       module_type=module_type, autocast=self.autocast_dtype, step=step,
                       low=self.low_precision,
                       scaler=self.has_scaler if self.n else bool(self.scaler),
                       siblings=self.siblings(module) if module else [],
                       kin=self.modules_of_class(module_type) if module_type else [],
                       params=self.own_params(module) if module else [],
                       argv=[str(a) for a in self.run.attrs.get("argv") or []],
                       world_size=int(self.run.attrs.get("world_size") or 1),
                       handles=self.run.handles,
                       clip_max_norm=_number(clip), clip_value=_number(value),
                       clip_call=str(clip_call.get("how") or "clip_grad_norm_"),
                       replayed=self.failure_replayed, measure=self.doses,
                       culprit=self.culprit_at(module, step),
                       relu_free=relu_free(self.tensor_types))

    def culprit_at(self, module: Optional[str], step: Optional[int]) -> Optional[dict]:
        """The first located replay at or after ``step`` (of ``module``, if named), as the
        fixes' premises read it (None: none)."""
        found = (s for s in self.snapshots if step is not None and s["step"] >= step and
                 s["phase"] in ("forward", "backward") and module in (None, s["module"]))
        snap = next(found, None)
        return snap and {"module": snap["module"], "phase": snap["phase"], "fp32_finite":
                         snap["fp32_finite"], "op": SnapshotDetail.from_json(snap["detail"]).op}

    @property
    def doses(self) -> Doses:
        """The numbers fixes prescribe, measured from this run on first use (``dose.py``)."""
        return self.memo("doses", lambda: Doses(self))

    @property
    def failure_replayed(self) -> Optional[int]:
        """The step of the first forensic replay at or after the failure, if any."""
        step = self.failure_step
        later = [s["step"] for s in self.snapshots if step is not None and s["step"] >= step]
        return min(later) if later else None


    def window(self, step: int, before: int = 5, after: int = 2) -> dict:
        """Scale, LR, loss and grad norm around ``step`` (for the report)."""
        s = self.steps
        i = self.index_of(step)
        sel = slice(max(0, i - before), min(self.n, i + after + 1))
        return {k: [_num(v) for v in s[k][sel]] for k in ("step", "loss", "scale", "lr",
                                                          "grad_norm", "skipped")}


def _num(v: Any) -> Any:
    """A plain Python number; NaN stays NaN (the text report prints it, JSON makes it null)."""
    return v.item() if isinstance(v, np.generic) else v


def _number(value: Any) -> Optional[float]:
    """A number as /meta recorded it (a tensor argument was recorded as "tensor")."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None
