"""The run-file contract, shared by the recording side and the analysis side.

Everything a run file holds is declared here: the format name and version, the tables with
their numpy dtypes, and the small integer codes stored in them. The recorder writes these
tables (through ``store.Writer``); ``store.load`` reads them back into a ``Run``. This module
imports numpy only, so the analysis side never pulls in torch.

Layout of format version 5 (one HDF5 file per process; version 4 is the same without /fp8's
``kurtosis`` column, version 3 without ``/fp8``, version 2 without ``/losses`` and
``/optimizers`` too, version 1 without ``/summary`` too)::

    /            attrs: format, format_version, ampdoctor_version, created, pid, host,
                        rank, world_size, argv
    /steps       one row per optimizer step (sentinel tier)
    /groups      one row per step and param group: the LR of each group
    /losses      one row per step and loss, when a run backwards several losses (a GAN,
                 a multi-task model): each loss's own curve, named in /meta ``losses``
    /optimizers  one row per step and optimizer, when a run has several: each one's
                 gradient norm, LR, found_inf and whether it stepped
    /tensors     one row per recorded tensor: id, kind, owner name and type
    /stats       per-tensor statistics (sampled tier and forensic replays)
    /fp8         sampled tier: what each fp8 recipe would do to each Linear's input, weight
                 and output gradient (flushed, subnormal, saturated, SQNR)
    /events      what happened and when: skipped steps, non-finite values, API misuse
    /snapshots   forensic replays: culprit, phase, fp32 verdict
    /arrays      arrays saved with a snapshot (the batch), bytes in /blob
    /meta        key -> JSON value, appended as the run discovers its configuration
    /blob        uint8 heap for text and array bytes, addressed by (offset, length)
    /summary     one row, rewritten in place at every flush: the run in a few numbers
                 (steps, skips, first bad step, loss scale change points, status), so that
                 the rank files of a large job are diagnosed without reading every table

Every table exists from the first flush, because no dataset can be created once SWMR
writing has begun. Text is kept in ``/blob`` rather than in variable-length strings, which
SWMR readers do not handle reliably; nothing in a file is ever unpickled or evaluated.
"""

from __future__ import annotations

import enum

import numpy as np

FORMAT_NAME = "ampdoctor-run"
FORMAT_VERSION = 5  # 2: /summary; 3: /losses and /optimizers; 4: /fp8; 5: /fp8 kurtosis

# fp16 range: max finite 65504, min normal 2**-14, min subnormal 2**-24. A value whose
# magnitude is above 65504 overflows to inf once rounded; one below half the smallest
# subnormal (2**-25) flushes to zero. We count "below 2**-24" as would-flush, as the
# taxonomy does: values in [2**-25, 2**-24) survive only as the single smallest subnormal.
FP16_MAX = 65504.0
FP16_NEAR = 2.0**15
FP16_TINY = 2.0**-14  # 6.104e-5, smallest normal
FP16_SUBNORMAL_MIN = 2.0**-24  # 5.96e-8, smallest subnormal
# bf16 shares fp32's exponent range; only the top of the range and the subnormals differ.
BF16_MAX = 3.3895313892515355e38
BF16_TINY = 2.0**-126  # 1.1755e-38
BF16_SUBNORMAL_MIN = 2.0**-133  # 9.18e-41

TEXT = [("off", "<i8"), ("len", "<i4")]  # a reference into /blob


def _text(name: str) -> list[tuple[str, str]]:
    return [(f"{name}_off", "<i8"), (f"{name}_len", "<i4")]


class DType(enum.IntEnum):
    """Element type of a recorded tensor (or loss)."""

    UNKNOWN = 0
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    FLOAT64 = 4
    OTHER = 5


DTYPE_NAMES = {
    "float32": DType.FLOAT32,
    "float16": DType.FLOAT16,
    "bfloat16": DType.BFLOAT16,
    "float64": DType.FLOAT64,
}


class Kind(enum.IntEnum):
    """What a row of /tensors describes."""

    OUTPUT = 0  # a module's forward output
    GRAD_OUTPUT = 1  # the gradient arriving at a module's output in backward
    PARAM_GRAD = 2  # a parameter's .grad, in scaled space (what fp16 actually held)
    PARAM = 3  # a parameter's values: norm, update ratio across the optimizer step
    INPUT = 4  # a module's forward input (forensic replay, batch audit)
    GRAD_INPUT = 5  # the gradient leaving a module towards its inputs (forensic replay)
    BUFFER = 6  # a module buffer such as BatchNorm running statistics
    LOSS = 7  # the loss tensor


class Source(enum.IntEnum):
    """Where a /stats row comes from."""

    SAMPLED = 0  # the sampled tier, every N steps
    REPLAY = 1  # forensic replay in the run's own precision
    REPLAY_FP32 = 2  # forensic re-run of the culprit in fp32
    AUDIT = 3  # a one-off audit (buffers, inputs) outside the sampled tier


class Phase(enum.IntEnum):
    """Where the first non-finite value of an event was found."""

    UNKNOWN = 0
    FORWARD = 1
    BACKWARD = 2
    INPUT = 3  # the batch itself was non-finite
    LOSS = 4  # the loss computation, outside the model
    OPTIMIZER = 5  # parameters became non-finite in the optimizer step
    NONE = 6  # replay found every value finite (the event did not reproduce)


class Event(enum.IntEnum):
    """Kinds of rows in /events."""

    SKIPPED = 0  # GradScaler skipped the optimizer step (found inf/NaN)
    NONFINITE_LOSS = 1
    NONFINITE_GRAD = 2  # global grad norm non-finite
    # Reserved, never written: non-finite parameters show in /stats PARAM rows and in a
    # replay's weights_nonfinite.
    NONFINITE_PARAM = 3  # a parameter non-finite after the optimizer step
    NONFINITE_BUFFER = 4  # a module buffer (BatchNorm stats) non-finite
    CLIP_BEFORE_UNSCALE = 5  # clip_grad_norm_ on scaled gradients
    STEP_BYPASSES_SCALER = 6  # optimizer.step() called directly while a scaler is in use
    SCALER_CREATED = 7  # a GradScaler was constructed (value: init_scale)
    # Reserved, never written: the diagnosis derives resets from /steps scale and scale_after.
    SCALE_RESET = 8  # the scale jumped up without a growth interval's worth of clean steps
    FP16_WITHOUT_SCALER = 9  # fp16 autocast with no (enabled) GradScaler (once, first step)
    UNSCALE_TWICE = 10  # unscale_ more than once per step, or per micro-batch
    FORENSICS = 11  # a forensic replay ran (value: snapshot id)
    RECORDER_ERROR = 12  # ampdoctor stepped aside after an internal failure (text: what)
    EXCEPTION = 13  # the training script raised (text: type and message)
    NONFINITE_INPUT = 14  # the batch given to the root module held NaN/inf
    GRAD_NOT_ZEROED = 15  # .grad already non-finite before this step's backward
    # A step flag, never an /events row: the step's grad_norm is this rank's share of a
    # sharded model's norm (no clip_grad_norm_ combined the shards); see sharding.py.
    GRAD_NORM_LOCAL = 16
    # On a sampled step, an op inside a module made inf/NaN from finite inputs while the
    # module's output stayed finite (record/opprobe.StepProbe): tensor, the module's OUTPUT
    # id; value, what the op made (bits 1 NaN, 2 +inf, 4 -inf, as /stats nonfinite); text, JSON
    # (payloads.HiddenNonfinite) {"op", "dtype" (of the op's result), "inner" (the module
    # running the op: this one or one inside it), "index" (ops probed before it in the step),
    # "ops" (ops of the step that made one in this module)}. An additive code, not a format
    # change: a reader that does not know it passes the rows by (the diagnosis reads events by
    # kind).
    HIDDEN_NONFINITE = 17
    # An LR scheduler stepped more than once in one optimizer step (once per micro-batch):
    # value: its steps that took effect in this one, text: its class. Written when that count
    # first passes 1 and whenever it changes (record/schedules.py).
    SCHEDULER_STEPS = 18
    # The loss's backward was non-finite with a loss written by hand: on a later event the
    # input of each op of its graph whose derivative is infinite at a point (a power below 1,
    # sqrt, log at 0; acos at +-1), read before that step's backward (record/forensic/singular.py).
    # value: how many of those values have a non-finite derivative in fp32 too; text: JSON
    # (payloads.LossSingular) {"ops": [{"op", "node", "exponent", "points", "dtype", "numel",
    # "at_point", "nearest", "run", "fp32", "eps", "clamped"}, ...]}, the most singular first.
    # Additive, as 17.
    LOSS_SINGULAR = 19
    # The step was sampled, op probe included, because the loss had not fallen for a while
    # (record/flatloss.py), not because the interval was due: value, the recent loss over the
    # run's start; text, JSON (payloads.FlatLossProbe) {"start" (median of the first losses),
    # "recent" (median of the last ten), "flat_steps" (in a row, when armed), "probe" (which
    # of the run's, from 1)}.
    # Additive, as 17.
    FLAT_LOSS_PROBE = 20
    # A loss was backwarded without scaler.scale in a step where an enabled GradScaler scaled
    # another (an auxiliary loss's own .backward()): its gradients reach the optimizer divided
    # by the loss scale. value: how many such backwards in the step. Written at the step's
    # end. Additive, as 17.
    BACKWARD_UNSCALED = 21
    # torch.autograd.grad(create_graph=True) of what scaler.scale returned (a gradient
    # penalty), then the step's next scaler.scale with no scaler.get_scale() between: the
    # penalty was built from gradients still multiplied by the loss scale, not unscaled as the
    # AMP docs' recipe does (record/hooks.py). One row per step. Additive, as 17.
    SCALED_GRADS_IN_LOSS = 22
    # A step flag, never an /events row: this rank's own found_inf was set, read before a
    # scaler that combines found_inf across ranks (FSDP's ShardedGradScaler all-reduces it in
    # unscale_) made every rank's the same. Under FSDP it is this rank's shard of the reduced
    # gradients that held inf/NaN. Written only where the scaler combines found_inf (/meta
    # scaler "own_found_inf": true); on such a run an unflagged step's own gradients were
    # finite. Additive, as 17.
    OWN_NONFINITE_GRAD = 23
    # A step flag, never an /events row: the step took torch.autograd.grad of a scaled output
    # with create_graph=True (a gradient penalty, as the AMP docs build one): its loss holds
    # gradients computed at the loss scale, so a scale too high for them makes the loss
    # itself non-finite on a step GradScaler skips. While it calibrates, that is its
    # calibration at work (diagnosis/facts.py), not a failure. Additive, as 17.
    PENALTY_AT_SCALE = 24
    # When the recording closed, the last sampled step re-run with its Linear layers in
    # emulated fp8, one at a time and together, per recipe (record/forensic/fp8trial.py):
    # value, the re-runs; text, JSON (payloads.Fp8Trial): the loss and gradient each moved,
    # the layers to keep in high precision, the recipe that suits the model. Additive, as 17.
    FP8_TRIAL = 25
    # A loss backwarded through scaler.scale after scaler.unscale_ in the same step (a
    # two-pass optimizer such as SAM, a second loss after the first's unscale_): GradScaler
    # unscales each optimizer once per update(), so scaler.step applies the later backward's
    # gradients still multiplied by the loss scale, and the skip decision is the earlier
    # pass's. value: how many such backwards in the step. Written at the step's end
    # (record/callorder.py). Additive, as 17.
    BACKWARD_AFTER_UNSCALE = 26


# Bits of steps["flags"], one per event kind seen on that step.
def flag(event: Event) -> int:
    return 1 << int(event)


STEPS = np.dtype(
    [
        ("step", "<i8"),  # optimizer step index, 0-based
        ("time", "<f8"),  # unix time at the step boundary
        ("dt", "<f4"),  # seconds since the previous boundary
        ("loss", "<f4"),  # mean over micro-batches, unscaled; NaN if not seen
        ("loss_dtype", "i1"),  # DType
        ("micro", "<i2"),  # backward calls (micro-batches) in this step
        ("scale", "<f4"),  # loss scale before GradScaler.update; NaN without a scaler
        ("scale_after", "<f4"),  # loss scale after update
        ("found_inf", "i1"),  # 1/0, -1 unknown
        ("skipped", "i1"),  # 1 if the optimizer step did not run
        ("grad_norm", "<f4"),  # global L2 grad norm, unscaled, before clipping
        ("clip_norm", "<f4"),  # what clip_grad_norm_ returned (NaN if not called)
        ("lr", "<f4"),  # largest LR over param groups (each group in /groups)
        ("peak_mem", "<i8"),  # bytes: CUDA allocator peak, or process peak RSS on CPU
        ("sampled", "i1"),  # 1 if the sampled tier ran on this step
        ("flags", "<i4"),  # bit per Event seen on this step
    ]
)

GROUPS = np.dtype([("step", "<i8"), ("group", "<i2"), ("lr", "<f4"), ("weight_decay", "<f4")])

# Written only by a run that backwards losses from two or more lines of code (record/
# objectives.py): each loss is a "slot", named by /meta ``losses`` (its line, the optimizers
# it feeds); micro-batches backwarded from one line are one slot.
LOSSES = np.dtype(
    [
        ("step", "<i8"),
        ("slot", "<i2"),  # /meta losses[slot]
        ("loss", "<f4"),  # mean over the slot's backwards in the step, unscaled
        ("micro", "<i2"),  # backwards of the slot in the step
    ]
)

# Written only by a run with two or more optimizers (index: /meta optimizer order).
OPTIMIZERS = np.dtype(
    [
        ("step", "<i8"),
        ("optimizer", "<i2"),
        ("grad_norm", "<f4"),  # L2 norm of its own gradients, unscaled, before clipping
        ("lr", "<f4"),  # largest LR over its param groups
        ("found_inf", "i1"),  # its own GradScaler flag: 1/0, -1 unknown (no scaler step)
        ("stepped", "i1"),  # 1: its step() ran in this step
    ]
)

TENSORS = np.dtype(
    [
        ("id", "<i4"),
        ("kind", "i1"),  # Kind
        ("index", "<i2"),  # which output/input of the module (0 for the first tensor)
        ("dtype", "i1"),  # DType when first seen
        ("numel", "<i8"),
        *_text("name"),  # module qualified name, or parameter name
        *_text("type"),  # module class name (or parameter's owner module class)
    ]
)

STATS = np.dtype(
    [
        ("step", "<i8"),
        ("tensor", "<i4"),  # /tensors id
        ("call", "<i2"),  # k-th call of the module in this step (shared modules)
        ("seq", "<i4"),  # order of the row within the step and source (execution order)
        ("source", "i1"),  # Source
        ("snapshot", "<i4"),  # /snapshots row for replay rows, -1 otherwise
        ("dtype", "i1"),  # DType of the tensor as recorded
        ("numel", "<i8"),
        ("sample_n", "<i8"),  # elements the counts below were taken over (numel if exact)
        ("nonfinite", "i1"),  # exact presence bits over the whole tensor: 1 NaN, 2 +inf, 4 -inf
        ("nan", "<i8"),
        ("posinf", "<i8"),
        ("neginf", "<i8"),
        ("zeros", "<i8"),
        ("absmax", "<f4"),  # exact over the whole tensor; NaN if the tensor holds NaN
        ("absmin", "<f4"),  # smallest non-zero magnitude (over the sample); inf if none
        ("rms", "<f4"),  # root mean square of the finite values (over the sample)
        ("over16", "<i8"),  # |x| > 65504: overflows in fp16
        ("near16", "<i8"),  # |x| >= 2**15: within a factor 2 of fp16 overflow
        ("sub16", "<i8"),  # 0 < |x| < 2**-14: fp16 subnormal band (precision lost)
        ("flush16", "<i8"),  # 0 < |x| < 2**-24: flushes to zero in fp16
        ("overbf16", "<i8"),  # |x| > bf16 max (finite in fp32)
        ("subbf16", "<i8"),  # 0 < |x| < 2**-126
        ("flushbf16", "<i8"),  # 0 < |x| < 2**-133
        ("norm", "<f4"),  # PARAM rows: L2 norm of the weights before the step
        ("update", "<f4"),  # PARAM rows: |dW|/|W| across the optimizer step
        # PARAM rows: fraction with dW == 0 of the sampled elements with grad != 0 (NaN: none)
        ("unchanged", "<f4"),
    ]
)

EVENTS = np.dtype(
    [
        ("step", "<i8"),
        ("kind", "<i2"),  # Event
        ("tensor", "<i4"),  # /tensors id or -1
        ("value", "<f8"),  # kind-specific number (scale, norm, snapshot id, ...)
        *_text("text"),
    ]
)

SNAPSHOTS = np.dtype(
    [
        ("id", "<i4"),
        ("step", "<i8"),
        ("micro", "<i2"),  # which micro-batch of the step was replayed
        ("trigger", "<i2"),  # Event that armed the replay
        ("phase", "i1"),  # Phase
        ("culprit", "<i4"),  # /tensors id of the culprit's OUTPUT (or INPUT) row, -1 if none
        *_text("module"),  # culprit module name ('' if none)
        *_text("module_type"),
        ("autocast", "i1"),  # DType autocast ran in during the step (UNKNOWN if off)
        ("fp32_finite", "i1"),  # 1 finite in fp32, 0 not, -1 not run
        ("fp32_absmax", "<f4"),  # culprit output abs max when re-run in fp32
        ("in_absmax", "<f4"),  # culprit input abs max (run precision)
        ("out_absmax", "<f4"),  # culprit output abs max (run precision, NaN if NaN)
        ("scale", "<f4"),
        ("lr", "<f4"),
        *_text("detail"),  # JSON: what else the replay learnt, payloads.SnapshotDetail
    ]
)

ARRAYS = np.dtype(
    [
        ("snapshot", "<i4"),
        *_text("name"),  # e.g. "args.0", "kwargs.input_ids", "grad_output"
        ("dtype", "S12"),  # numpy dtype string ('<f4', '<i8', '|b1'); bf16 saved as '<f4'
        ("ndim", "i1"),
        ("shape", "<i8", (8,)),
        ("numel", "<i8"),  # elements in the original tensor
        ("saved", "<i8"),  # elements saved (leading rows kept when over the size cap)
        ("data_off", "<i8"),
        ("data_len", "<i8"),
    ]
)

META = np.dtype([("step", "<i8"), ("key", "S32"), *_text("value")])

# fp8 element formats (OCP FP8; torch.float8_e4m3fn and torch.float8_e5m2): the largest finite
# value, the exponent of the smallest normal and the mantissa bits. e4m3fn has no inf, so its
# top is 448 (1.75 * 2**8), not 480; e5m2 keeps IEEE's inf, its top is 57344 (1.75 * 2**15).
# A value below the smallest normal is subnormal (steps of 2**(emin - mbits)); one below half
# the smallest subnormal flushes to zero.
E4M3_MAX = 448.0
E4M3_EMIN = -6
E4M3_MBITS = 3
E5M2_MAX = 57344.0
E5M2_EMIN = -14
E5M2_MBITS = 2
# Saturated: a scaled value that round-to-nearest-even cannot keep below the top, i.e. above
# max + half the top's step (448 + 16, 57344 + 4096); values between the max and these round
# to the max in any cast, clamped or not, and lose no more than rounding does.
E4M3_OVER = 464.0
E5M2_OVER = 61440.0
# The exponent of the largest power of two under e4m3's top (2**8 <= 448): an MX block's
# shared scale is 2**(floor(log2(block amax)) - 8), the OCP MX spec's rule, which leaves the
# block's largest value in [256, 512): above 448 it saturates (the spec's own trade-off).
E4M3_MAX_POW2 = 8
MX_BLOCK = 32  # elements per MX block along the last dimension (OCP MX: k = 32)
DELAYED_HISTORY = 16  # sampled amaxes a delayed recipe takes its scale from (torchao's default)


class Fp8Format(enum.IntEnum):
    E4M3 = 0  # float8_e4m3fn: forward tensors (and every tensor of the rowwise and MX recipes)
    E5M2 = 1  # float8_e5m2: the output gradient under per-tensor and delayed scaling


class Recipe(enum.IntEnum):
    """How an /fp8 row's scale was chosen."""

    TENSOR = 0  # per-tensor current scaling: scale = fmt max / amax of this tensor
    DELAYED = 1  # per-tensor, from the max of the tensor's previous sampled amaxes
    ROWWISE = 2  # one power-of-two scale per row (along the last dimension), e4m3
    MX = 3  # one power-of-two (E8M0) scale per block of MX_BLOCK elements, e4m3


class Role(enum.IntEnum):
    """Which operand of the matmul an /fp8 row describes."""

    INPUT = 0  # the module's input (activation)
    WEIGHT = 1
    GRAD_OUTPUT = 2  # the gradient arriving at the module's output


FP8 = np.dtype(
    [
        ("step", "<i8"),
        ("tensor", "<i4"),  # /tensors id of the module's OUTPUT row (the module's name)
        ("call", "<i2"),  # k-th call of the module in this step
        ("role", "i1"),  # Role
        ("recipe", "i1"),  # Recipe
        ("format", "i1"),  # Fp8Format the elements were cast to
        ("numel", "<i8"),
        ("sample_n", "<i8"),  # elements counted below (numel if exact)
        ("zeros", "<i8"),  # exact zeros before the cast
        ("flushed", "<i8"),  # non-zero before, zero after the cast
        ("subnormal", "<i8"),  # non-zero and below the format's smallest normal after it
        ("saturated", "<i8"),  # |x * scale| > E4M3_OVER / E5M2_OVER: clamped to the max
        ("sqnr_db", "<f4"),  # 10 log10(sum x^2 / sum (x - dequantised)^2); inf: no error
        ("amax", "<f4"),  # abs max of the whole tensor (exact)
        ("scale", "<f4"),  # TENSOR, DELAYED: the scale applied; ROWWISE, MX: the smallest
        # The operand's kurtosis over the sampled values, E[(x - mean)^4] / E[(x - mean)^2]^2
        # (3 for a Gaussian; one channel in C holding the energy: C to 3C): an outlier
        # emerging, whatever the recipe (the same on its four rows). NaN: constant, not
        # finite, or a file before format 5 (runfile/migrations.py).
        ("kurtosis", "<f4"),
    ]
)

TABLES: dict[str, np.dtype] = {
    "steps": STEPS,
    "groups": GROUPS,
    "losses": LOSSES,
    "optimizers": OPTIMIZERS,
    "tensors": TENSORS,
    "stats": STATS,
    "events": EVENTS,
    "snapshots": SNAPSHOTS,
    "arrays": ARRAYS,
    "meta": META,
    "fp8": FP8,
}
BLOB = "blob"
# The format version that added a table: a file of an older version has none, and reads as
# if it were empty.
SINCE = {"losses": 3, "optimizers": 3, "fp8": 4}


def tables_of(version: int) -> tuple[str, ...]:
    """The tables (of ``TABLES``) a file of format ``version`` holds."""
    return tuple(name for name in TABLES if SINCE.get(name, 1) <= version)


def columns(table: str, *names: str) -> tuple[str, ...]:
    """``names``, checked to be columns of ``table``: a module that reads a few columns
    declares them so, and a misspelt or removed one fails when it is imported, not when a
    run is read.

    Example::

        _COLUMNS = schema.columns("stats", "step", "tensor", "absmax")
    """
    have = TABLES[table].names or ()
    missing = [n for n in names if n not in have]
    if missing:
        raise KeyError(f"/{table} has no column {', '.join(missing)} (runfile/schema.py)")
    return names

# /summary (format 2): one row, rewritten in place at each flush (no dataset may be created
# once SWMR writing has begun, and a /meta key appended at every flush would grow without
# bound). It covers the rows of the flush that wrote it: a reader checks the counts against
# the tables and reads the file in full where they disagree (a flush cut short by a kill).
SUMMARY_TABLE = "summary"
SCALE_POINTS = 64  # loss scale change points a summary holds; a run with more is read from /steps
STATUS_BYTES = 64
SUMMARY = np.dtype(
    [
        ("written", "<f8"),  # unix time of the flush that wrote it
        ("rank", "<i8"),  # the root attributes' rank and world_size, at hand
        ("world_size", "<i8"),
        ("steps", "<i8"),  # rows of /steps it covers; -1: not written yet (read the tables)
        ("events", "<i8"),  # rows of /events it covers
        ("snapshots", "<i8"),  # rows of /snapshots it covers
        ("first_step", "<i8"),  # -1 without a step
        ("last_step", "<i8"),
        ("contiguous", "i1"),  # 1: every step from first_step to last_step, once, in order
        ("skipped", "<i8"),  # steps with skipped == 1
        ("bad_steps", "<i8"),  # steps flagged skipped, non-finite loss or non-finite gradient
        ("first_bad", "<i8"),  # the first of them, -1 none
        ("loss_bad_steps", "<i8"),  # steps whose loss was non-finite (born on this rank)
        ("first_loss_bad", "<i8"),
        ("local_norm_steps", "<i8"),  # steps flagged GRAD_NORM_LOCAL (a shard's grad norm)
        ("located", "<i4"),  # /snapshots row of the first replay that located a value, -1
        ("located_step", "<i8"),
        ("located_phase", "i1"),  # its Phase
        ("replays", "<i4"),  # /snapshots rows
        ("replays_finite", "<i4"),  # replays that found every value finite (Phase.NONE)
        ("sampled_step", "<i8"),  # first non-finite tensor of the sampled tier: step, -1 none
        ("sampled_tensor", "<i4"),  # ... and its /tensors id
        ("stopped", "<i8"),  # /events row of the first RECORDER_ERROR, -1 none
        ("status", f"S{STATUS_BYTES}"),  # the last /meta status, UTF-8
        ("status_state", "i1"),  # 0 none written, 1 in ``status``, 2 read /meta (longer, not text)
        ("scaled", "i1"),  # 1: some step has a loss scale
        ("scale_n", "<i8"),  # change points of the loss scale over the whole run
        ("scale_step", "<i8", (SCALE_POINTS,)),  # the first SCALE_POINTS: step where it changed
        ("scale_value", "<f4", (SCALE_POINTS,)),  # ... and the scale from there (NaN: none)
        ("scale_digest", "S16"),  # blake2b of every change point: equal digests, equal scales
    ]
)

# The order in which a step measures each Kind (the sampled tier's first non-finite value is
# the earliest step, then this order, then the row's seq). diagnosis/streamed.py keeps the
# same order with each kind's phase name (tests/runfile/test_store.py checks that they agree).
KIND_ORDER: dict[int, int] = {int(Kind.INPUT): 0, int(Kind.OUTPUT): 1, int(Kind.GRAD_OUTPUT): 2,
                              int(Kind.PARAM_GRAD): 3, int(Kind.PARAM): 4, int(Kind.BUFFER): 5}
KIND_ORDER_UNKNOWN = 9

# Rows per HDF5 chunk. Small tables get small chunks so that a short run stays small.
CHUNK_ROWS = {
    "steps": 1024,
    "groups": 1024,
    "losses": 1024,
    "optimizers": 1024,
    "tensors": 256,
    "stats": 4096,
    "events": 256,
    "snapshots": 16,
    "arrays": 64,
    "meta": 64,
    "fp8": 4096,
}
BLOB_CHUNK = 1 << 16

# Keys of /meta (JSON values, the last row of a key wins), each read through the ``Run``
# accessor named here (runfile/run.py), never parsed ad hoc:
# - status: how the run ended: 'running' until it did (Run.status)
# - recorder: the recorder's settings: every, sample, forensics, ... (Run.recorder_settings)
# - torch: torch's version and build (the diagnosis's environment: diagnosis/engine.py)
# - roots: class names of the root module(s) the recorder hooked (Run.roots)
# - model: parameter counts and param_dtypes of the model (Run.model)
# - device: type, name and memory of the training device (Run.device)
# - compiled: torch.compile regions: module and kind (Run.compiled)
# - sharding: FSDP/DTensor: kind, world size, replay on or off (Run.sharding)
# - scaler: GradScaler settings: enabled, init_scale, growth_interval... (Run.scaler)
# - optimizer: one dict per optimizer: type, hyperparameters, param_dtypes (Run.optimizers)
# - autocast: the autocast state seen in the loss: enabled, dtype, device_type (Run.autocast)
# - clip: the clip as called: how (clip_grad_norm_, clip_grads_with_norm_, clip_grad_value_,
#   adaptive_clip_grad), max_norm ('tensor' if one was given), clip_value or clip_factor,
#   norm_type, foreach; rewritten when they change (Run.clip)
# - handles: what the training code calls the recorded modules: {recorded path: expression},
#   e.g. {'': 'model.module'} (Run.handles)
# - losses: the losses of a run that backwards several (record/objectives.py), one dict per
#   /losses slot: site (file:line of the backward), optimizers (indices it feeds: stepped after
#   its backward, its graph reaching their parameters), reaches (indices whose parameters its
#   graph reaches); rewritten when a slot is added or settled (Run.losses)
# - applied: record --apply: the fixes the run was treated with, one dict each: fix, arg, and what
#   the treatment found (fp32_island's modules and missing names, use_bf16's scaler, an error);
#   rewritten when that changes (Run.applied)
# - skipped_modules: modules the recorder left out because recording them failed while the
#   model was discovered (the rest recorded): one dict each, module (class), where (the hook),
#   why (the error); rewritten when one is added (Run.skipped_modules)
# - buffers: the floating-point buffers already non-finite when the recorder first saw their
#   model, before its forward (nonfinite_at_start, more_nonfinite), and the models whose
#   buffers could not be read (unchecked); written at the end of the first step
#   (record/buffers.py, Run.buffers)
# - fp8_layers: the layers the run trains in fp8 (torchao's Float8Linear), by module name: the
#   library, torchao's recipe name, emulate, and per operand (input, weight, grad_output) the
#   cast: scaling, granularity, dtype (record/fp8layers.py); ``replicas``: per operand several
#   ranks hold whole, {ranks, by: "ddp" | "dtensor"[, placements]} (record/replicas.py);
#   rewritten when one is first seen on a sampled step (Run.fp8_layers)
# - lr_range: the LR range test run where the loss rose to RISE times the first step's with no
#   non-finite value (record/forensic/lrrange.py; payloads.LrRange with its trigger): written
#   once (Run.lr_range). One run at a non-finite loss is in that snapshot's detail instead

STATUS_RUNNING = "running"
STATUS_FINISHED = "finished"
STATUS_EXCEPTION = "exception:"  # followed by the exception type name
STATUS_SIGNAL = "signal:"  # followed by the signal name: stopped by SIGTERM


def empty(table: str, n: int = 0) -> np.ndarray:
    """Rows of ``table`` with every field at its neutral value (NaN floats, -1 ids)."""
    rows = np.zeros(n, TABLES[table])
    for name in rows.dtype.names:
        kind = rows.dtype[name].kind
        if kind == "f":
            rows[name] = np.nan
    for name in ("tensor", "culprit", "snapshot", "found_inf", "fp32_finite"):
        if name in rows.dtype.names:
            rows[name] = -1
    return rows
