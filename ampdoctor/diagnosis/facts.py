"""Views of a loaded run that the diagnosis rules share, each computed once.

numpy only (no torch). ``Facts`` wraps a ``store.Run``: the small tables are read whole, the
big ``/stats`` table is streamed once in chunks (``Reduced``), reduced on the fly to arrays per
step and per tensor, so memory stays bounded however long the run. ``ScaleStory`` reads the
GradScaler's history from ``/steps`` and tells normal calibration apart from trouble.

Thresholds live next to the rules that read them (``thresholds.py`` for the shared ones); the
few here describe GradScaler itself and are commented where they are defined.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import numpy as np

from ..runfile import schema
from ..runfile.meta import OptimizerInfo, ScalerInfo
from ..runfile.payloads import FlatLossProbe, HiddenNonfinite, SnapshotDetail
from ..runfile.run import one_line
from ..runfile.schema import DType, Event, Kind, Phase, flag
from . import curve, objectives
from .dose import Doses
from .fixes import Context
from .fixes.premises import relu_free
from .scale import ScaleStory, scale_story
from .streamed import Reduced, stream_stats

PHASES = {Phase.FORWARD: "forward", Phase.BACKWARD: "backward", Phase.INPUT: "input",
          Phase.LOSS: "loss", Phase.OPTIMIZER: "optimizer", Phase.NONE: "none",
          Phase.UNKNOWN: "unknown"}

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


class Facts:
    """Derived views of a ``Run`` for the rules. Properties are computed on first use.

    Example::

        f = Facts(ampdoctor.load("run.h5"))
        f.low_precision, f.story.collapsed, f.reduced.layer_under
    """

    def __init__(self, run: Any, chunk: int = 1 << 16):
        self.run = run
        self.steps = run.steps
        self.meta = run.meta
        self.chunk = chunk
        self._cache: dict[str, Any] = {}
        # the run this one is measured against (``diagnose(..., baseline=)``: fp8.Baseline)
        self.baseline: Any = None

    def memo(self, key: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, computed on the first call with ``key`` and kept (a view other modules
        derive once per run, like ``progress.dead_units``)."""
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

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

    # -- events and snapshots --------------------------------------------------------------

    def events(self, kind: Event) -> np.ndarray:
        ev = self.run.events
        return ev[ev["kind"] == int(kind)]

    @property
    def stopped(self) -> Optional[dict]:
        """Where and why ampdoctor stopped recording (an internal fault), or None."""
        return recording_stopped(self.run)

    @property
    def exception(self) -> Optional[tuple[str, str]]:
        """(type, message) of the exception the training script raised, if any."""
        rows = self.events(Event.EXCEPTION)
        status = self.run.status
        if len(rows):
            # one line: a message is quoted inside a sentence (a traceback's lines would start
            # lines of their own in a diagnosis)
            text = one_line(str(rows["text"][-1]))
            typ, _, msg = text.partition(": ")
            return typ, msg
        if status.startswith(schema.STATUS_EXCEPTION):
            return status.split(":", 1)[1], ""
        return None

    @property
    def snapshots(self) -> list[dict]:
        """Forensic replays, oldest first, as dicts (detail JSON parsed)."""
        def build():
            out = []
            for s in self.run.snapshots:
                detail = SnapshotDetail.from_json(s["detail"])
                out.append({"id": int(s["id"]), "step": int(s["step"]),
                            "phase": _phase_name(int(s["phase"])),
                            "module": str(s["module"]) or None,
                            "module_type": str(s["module_type"]) or None,
                            "fp32_finite": int(s["fp32_finite"]),
                            "fp32_absmax": float(s["fp32_absmax"]),
                            "in_absmax": float(s["in_absmax"]),
                            "out_absmax": float(s["out_absmax"]),
                            "scale": float(s["scale"]), "lr": float(s["lr"]),
                            "trigger": int(s["trigger"]), "detail": detail})
            return out
        return self.memo("snapshots", build)

    @property
    def hidden_nonfinite(self) -> list[dict]:
        """The sampled steps' op probe findings (``hidden_nonfinite``)."""
        return self.memo("hidden", lambda: hidden_nonfinite(self.run))

    @property
    def flat_probes(self) -> dict[int, dict]:
        """Steps sampled because the loss had not fallen (``flat_probes``)."""
        return self.memo("flat_probes", lambda: flat_probes(self.run))

    def batch_absmax(self, snapshot_id: int) -> tuple[float, bool]:
        """Largest finite magnitude in a snapshot's saved float batch, and whether it held
        NaN/inf. Only the batch ("args.*", "kwargs.*"): not the culprit's own inputs, the
        output gradient or the RNG state saved beside it."""
        arrays = self.run.arrays
        rows = np.flatnonzero(arrays["snapshot"] == snapshot_id)
        biggest, bad = math.nan, False
        for r in rows:
            name = str(arrays["name"][r])
            if not name.startswith(("args.", "kwargs.")):
                continue
            try:
                a = self.run.array(int(r))
            except Exception:  # noqa: BLE001 - a damaged array must not stop the diagnosis
                continue
            if a.dtype.kind != "f" or not a.size:
                continue
            fin = np.isfinite(a)
            bad = bad or not bool(fin.all())
            if fin.any():
                m = float(np.abs(a[fin]).max())
                biggest = m if math.isnan(biggest) else max(biggest, m)
        return biggest, bad

    # -- tensors and statistics ------------------------------------------------------------

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
        for i, value in zip(self.run.tensors["id"], self.run.tensors[column]):
            out[int(i)] = str(value)
        return out

    def module_type(self, name: str) -> Optional[str]:
        """Class of the module called ``name`` (from its OUTPUT row), if recorded."""
        kinds, names, types = self.tensor_kinds, self.tensor_names, self.tensor_types
        for i, n in enumerate(names):
            if n == name and kinds[i] == Kind.OUTPUT:
                return types[i] or None
        return None

    @property
    def reduced(self) -> Reduced:
        """The /stats table streamed once and reduced per step and per tensor (``Reduced``)."""
        return self.memo("reduced", lambda: stream_stats(
            self.run, self.tensor_kinds, self.tensor_names, self.step_values, self.skipped,
            self.horizon, self.low_precision or "fp16", self.chunk))

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
                         snap["fp32_finite"], "op": SnapshotDetail.of(snap["detail"]).op}

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

    def window(self, step: int, before: int = 5, after: int = 2) -> dict:
        """Scale, LR, loss and grad norm around ``step`` (for the report)."""
        s = self.steps
        i = self.index_of(step)
        sel = slice(max(0, i - before), min(self.n, i + after + 1))
        return {k: [_num(v) for v in s[k][sel]] for k in ("step", "loss", "scale", "lr",
                                                          "grad_norm", "skipped")}


def recording_stopped(run: Any) -> Optional[dict]:
    """``{"step", "why"}`` when ampdoctor stepped aside after an internal fault (its
    RECORDER_ERROR event): the file holds the steps before ``step`` and nothing after.

    Example::

        recording_stopped(ampdoctor.load("run.h5"))
        # {'step': 0, 'why': "before_clip: RuntimeError: aten.take.default got mixed ..."}
    """
    ev = run.events
    rows = ev[ev["kind"] == int(Event.RECORDER_ERROR)]
    if not len(rows):
        return None
    return {"step": int(rows["step"][0]), "why": one_line(str(rows["text"][0]))}


def hidden_nonfinite(run: Any) -> list[dict]:
    """The sampled steps' op probe findings (``Event.HIDDEN_NONFINITE``: a module whose output
    stayed finite although an op inside it made inf/NaN), in step and execution order:
    {"step", "module", "type", "tensor", "created" (bits 1 NaN, 2 +inf, 4 -inf), "op",
    "dtype", "inner", "index", "ops"}.

    Example::

        hidden_nonfinite(ampdoctor.load("run.h5"))[0]["op"]     # 'mul'
    """
    ev, t = run.events, run.tensors
    names = {int(i): str(n) for i, n in zip(t["id"], t["name"])}
    types = {int(i): str(c) for i, c in zip(t["id"], t["type"])}
    out = []
    for row in ev[ev["kind"] == int(Event.HIDDEN_NONFINITE)]:
        detail = HiddenNonfinite.from_json(str(row["text"]))
        tid = int(row["tensor"])
        value = float(row["value"])
        out.append({"step": int(row["step"]), "module": names.get(tid) or None,
                    "type": types.get(tid) or None, "tensor": tid,
                    "created": int(value) if math.isfinite(value) else 0,
                    "op": str(detail.get("op")), "dtype": str(detail.get("dtype")),
                    "inner": detail.get("inner") or names.get(tid),
                    "index": int(detail.get("index")), "ops": int(detail.get("ops"))})
    return sorted(out, key=lambda h: (h["step"], h["index"]))


def flat_probes(run: Any) -> dict[int, dict]:
    """The steps the recorder sampled (op probe included) because the loss had not fallen for
    a while (``Event.FLAT_LOSS_PROBE``, ``record/flatloss.py``), by step: {"start", "recent"
    (the loss's median at the start and over the last ten steps), "flat_steps", "probe"}.

    Example::

        flat_probes(ampdoctor.load("run.h5"))   # {29: {'start': 1.43, 'recent': 2.08, ...}}
    """
    ev = run.events
    out = {}
    for row in ev[ev["kind"] == int(Event.FLAT_LOSS_PROBE)]:
        detail = FlatLossProbe.from_json(str(row["text"]))
        out[int(row["step"])] = {"start": float(detail.get("start")),
                                 "recent": float(detail.get("recent")),
                                 "flat_steps": int(detail.get("flat_steps")),
                                 "probe": int(detail.get("probe"))}
    return out


def _phase_name(code: int) -> str:
    try:
        return PHASES[Phase(code)]
    except ValueError:
        return "unknown"


def _num(v: Any) -> Any:
    """A plain Python number; NaN stays NaN (the text report prints it, JSON makes it null)."""
    return v.item() if isinstance(v, np.generic) else v


def _number(value: Any) -> Optional[float]:
    """A number as /meta recorded it (a tensor argument was recorded as "tensor")."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None
