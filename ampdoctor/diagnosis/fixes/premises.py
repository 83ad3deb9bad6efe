"""What must hold for a fix to apply: the premises each ``@fix(..., premise=...)`` declares,
over the ``Context`` the fix is written for. ``registry.make`` offers no fix whose premise
fails, and ``unmet`` checks the fixes a finished diagnosis offers against the same
declarations (``tests/integration/test_verdicts.py`` over every fixture's recording,
``benchmarks/premises.py`` over the blind corpora's).

A premise returns None when it holds (or the run holds nothing that would tell) and, when it
fails, the measured fact that rules the fix out, as a clause ("re-run in fp32, blocks.0.attn
is non-finite too").

Also here, as the premises read them: the kind of non-finite value the first bad op made
(``nonfinite_kind``; ``culprit.py`` tells it in the evidence; ``squares_overflow``: a norm's
NaN that is its squares overflowing, not a domain error) and the activation families
(``relu_free``: a model whose recorded activations are all smooth has no ReLU to swap).

Example::

    ctx = Context(low="fp16", culprit={"module": "attn", "fp32_finite": 0, "op": None})
    use_bf16_applies(ctx)   # "re-run in fp32, attn is non-finite too: ..."
"""

from __future__ import annotations

from typing import Iterable, Optional

from ...runfile.detail import OpRecord
from .registry import Context, Fix

# What the first non-finite op made, from the op probe (issue 28 item 3).
OVERFLOW = "overflow"  # finite inputs, a result past the dtype's max: +-inf
OPERAND = "nonfinite_operand"  # an inf among the inputs turned into NaN: 0 x inf, inf - inf
DOMAIN = "domain"  # NaN from finite inputs: sqrt/log of a negative, 0/0, an empty reduction

# Units that can die by going negative (revive_units swaps them), and activations that cannot.
RELU_FAMILY = ("relu", "relu6", "threshold", "hardtanh", "leakyrelu", "prelu", "rrelu")
SMOOTH = ("silu", "gelu", "mish", "tanh", "sigmoid", "softplus", "elu", "selu", "celu",
          "hardswish", "hardsigmoid", "logsigmoid", "swish")
# Ops whose NaN from finite inputs is a negative argument: in a one-pass variance
# (E[x^2] - E[x]^2) that is cancellation, which bf16's 8-bit mantissa makes worse.
NEGATIVE_ARGUMENT = ("sqrt", "rsqrt", "log", "log2", "log10", "pow", "acos", "asin")


def nonfinite_kind(op: Optional[OpRecord]) -> Optional[str]:
    """OVERFLOW, OPERAND or DOMAIN for the op probe's finding ``op``; None where there is none
    or it fits none (a mix of kinds).

    Example::

        nonfinite_kind(OpRecord(created=["nan"], in_posinf=True))   # "nonfinite_operand"
    """
    if op is None:
        return None
    created = set(op.created)
    bad_in = op.in_posinf or op.in_neginf or op.in_nan
    if created == {"nan"}:
        return OPERAND if op.in_posinf or op.in_neginf else \
            (DOMAIN if not bad_in else None)
    if created and created <= {"posinf", "neginf"} and not bad_in:
        return OVERFLOW
    return None


# A norm's variance (and var/std) sums squares in fp32 whatever the input dtype (PyTorch's
# opmath for bf16 and fp16): inputs past sqrt(fp32 max) = 1.8e19 square to inf, and inf - inf
# (E[x^2] - E[x]^2, or a Welford update) is NaN: an overflow inside the op that makes only NaN.
FP32_MAX = 3.4028234663852886e38
SQUARING = ("norm", "var", "std")


def squares_overflow(op: Optional[OpRecord]) -> bool:
    """``op`` made NaN from finite inputs, squares them (a norm, var, std) and its inputs'
    squares pass fp32's largest value: its DOMAIN NaN is an overflow inside it.

    Example::

        squares_overflow(OpRecord(op="group_norm", created=["nan"], in_absmax=7e21))  # True
    """
    if nonfinite_kind(op) != DOMAIN or op is None or op.in_absmax is None:
        return False
    words = set(op.op.lower().replace(".", "_").split("_"))  # aten.native_layer_norm.default
    return bool(words & set(SQUARING)) and float(op.in_absmax) ** 2 > FP32_MAX


def relu_free(types: Iterable[str]) -> bool:
    """The recorded activation modules (``types``: module class names) are all smooth ones
    (SiLU, GELU, ...), none of the ReLU family. False where none is recorded: activations
    called as functions (F.relu)."""
    names = {str(t).lower() for t in types if t}
    return not names & set(RELU_FAMILY) and bool(names & set(SMOOTH))


# -- the premises, by what they read -----------------------------------------------------------


def fp32_cannot_fix(c: Context, fx: Optional[Fix] = None) -> Optional[str]:
    """The culprit re-run in fp32 was non-finite too: no wider format fixes it."""
    snap = c.culprit
    if snap and snap.get("fp32_finite") == 0:
        return (f"re-run in fp32, {snap.get('module') or 'the culprit'} is non-finite too: a "
                "wider format cannot fix what fp32 cannot")
    return None


def use_bf16_applies(c: Context, fx: Optional[Fix] = None) -> Optional[str]:
    """bf16 fixes a range failure of an fp16 run: not a run already in bf16 or fp32, not a
    NaN fp32 makes too, not a cancellation (a negative under a sqrt or log from finite inputs,
    finite in fp32), which bf16's fewer mantissa bits make worse."""
    if c.low != "fp16":
        return f"the run computes in {c.low or 'fp32'} already: it has fp32's exponent range"
    out = fp32_cannot_fix(c)
    if out:
        return out
    snap = c.culprit or {}
    op: Optional[OpRecord] = snap.get("op")
    name = (op.op if op else "").split(".")[-1].lower()
    if op is not None and nonfinite_kind(op) == DOMAIN and snap.get("fp32_finite") == 1 and \
            name.lstrip("_").rstrip("_") in NEGATIVE_ARGUMENT:
        return (f"{op.op} made NaN from finite inputs and is finite in fp32: a "
                "cancellation (a negative where none should be), a precision failure that "
                "bf16's 8-bit mantissa makes worse, not a range one")
    return None


def island_applies(c: Context, fx: Optional[Fix] = None) -> Optional[str]:
    """An fp32 island changes a module's precision: not where fp32 fails too, nor where the
    first bad op already computed in fp32 from finite inputs."""
    out = fp32_cannot_fix(c)
    if out:
        return out
    snap = c.culprit or {}
    op: Optional[OpRecord] = snap.get("op")
    if op is not None and op.dtype in ("float32", "torch.float32", "fp32") and \
            nonfinite_kind(op) in (OVERFLOW, DOMAIN) and snap.get("fp32_finite") != 1:
        return (f"{op.op} in {snap.get('module')} already computed in fp32 when it made "
                "the non-finite value")
    return None


def units_can_die(c: Context, fx: Optional[Fix] = None) -> Optional[str]:
    """revive_units swaps a ReLU-family unit for one with a slope everywhere: the model needs
    one to swap."""
    if c.relu_free:
        return ("the model's recorded activations are all smooth ones (no ReLU-family unit): "
                "none dies as a ReLU does")
    return None


def lr_to_lower(c: Context, fx: Optional[Fix] = None) -> Optional[str]:
    """A lower LR needs an LR above 0 to lower, and the clip it keeps is the script's own."""
    if c.lr is not None and not c.lr > 0:
        return f"the run's learning rate is {c.lr:g}: there is nothing to lower"
    return own_clip(c, fx)


def own_clip(c: Context, fx: Optional[Fix] = None) -> Optional[str]:
    """A fix that clips at ``max_norm`` uses the script's own max_norm where it clips."""
    own = c.clip_max_norm
    values = fx.values if fx is not None else {}
    if own is not None and "max_norm" in values and abs(values["max_norm"] - own) > 1e-6 * own:
        return (f"the fix clips at {values['max_norm']:g} while the script already clips at "
                f"{own:g}")
    return None
