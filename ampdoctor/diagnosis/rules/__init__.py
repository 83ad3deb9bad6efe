"""The diagnosis rules, in the order ``engine.diagnose`` tries them (``RULES``): small functions
from ``Facts`` to a ``Finding`` (or None), one family per module. They read the facts and the
readers of the forensic facts beside ``engine`` (``facts``, ``culprit``, ``singular``,
``schedules``, ``reproduced``, ``progress``, ``verdict``, ``fixes``), never the engine or what
it assembles. This package is the one door: the rest of ampdoctor imports ``RULES`` and
``PREFLIGHT_CHECKS`` from here and no rule module, and a family never imports another; a fact
two readers share lives beside ``facts.py`` (``.importlinter`` holds all three):

* ``fallbacks.py``: the script never trained (``no_training``), a scale that collapsed with no
  cause told, non-finite values no class explains;
* ``misuse.py``: the script's own AMP errors and GradScaler API misuse (exact fingerprints);
* ``located.py``: the batch (``diagnosis/batches.py`` reads it), an fp16 accumulation buffer,
  module buffers, Adam's eps, the loss;
* ``reproduced.py``: a failure the replay did not reproduce (the machine, not the numbers), one
  only the compiled model makes (the compiler), and
  targets that make the loss non-finite in fp32 too;
* ``overflow.py``: one op's overflow or the LR's growth, located by the forensic replay
  (``culprit.py`` reads the replays) or by the sampled tier;
* ``amplified.py``: one op's backward that amplifies its gradient past fp16 while GradScaler
  keeps lowering the scale and the loss still falls;
* ``hidden.py``: an overflow hidden inside a module (the sampled step's op probe);
* ``trends.py``: underflow and updates lost to bf16/fp16 rounding, with no NaN at all;
* ``fp8.py``: a run already in fp8 (torchao's Float8Linear) whose casts lose a layer's values:
  an operand flushed whole, saturated under a delayed scale, a gradient that underflows its
  format, a loss that drifts from
  the baseline's (``diagnose --baseline``);
* ``fp8own.py``: the same run measured against itself: an operand mostly flushed (one outlier
  took a per-tensor scale), and without a baseline the drift the fp8 trial measures by
  re-running the fp8 layers in high precision on the saved step;
* ``fp8ranks.py``: an fp8 operand that several ranks hold whole (a DDP weight, a replicated
  DTensor) with a different amax or scale on some of them, from the job's rank files compared;
* ``progress.py``: a loss that diverged or units that died, with no NaN at all;
* ``learning.py``: a loss that did not fall, with no cause found (below every other cause).

Each rule follows one failure class of ``shared/reference/taxonomy.md`` (class ids in the
docstrings) and decides on the signal the taxonomy names as its discriminator; the thresholds
are the taxonomy's §3 defaults unless a comment says otherwise. ``engine._conclude`` picks
the root cause among the findings by priority (``verdict.PRIORITY``) and turns the rest into
the causal chain.

Priorities (higher wins among root causes): exact fingerprints of the training script's own
failure (exceptions, API misuse events) above located numeric causes, above trends, above the
fallbacks. A rule that can only be a consequence (scale collapse, underflow after a collapse)
returns ``root=False``.
"""

from __future__ import annotations

from . import (
               amplified,
               fallbacks,
               fp8,
               fp8own,
               fp8ranks,
               hidden,
               learning,
               located,
               misuse,
               overflow,
               progress,
               reproduced,
               trends,
)

RULES = [
    fallbacks.rule_no_training,
    fallbacks.rule_loaded_nonfinite,
    misuse.rule_exception,
    misuse.rule_clip_before_unscale,
    misuse.rule_scaler_bypass,
    misuse.rule_scaler_recreated,
    misuse.rule_stale_grads,
    misuse.rule_unscale_twice,
    misuse.rule_backward_unscaled,
    misuse.rule_backward_after_unscale,
    misuse.rule_scaled_grads_in_loss,
    located.rule_state_poisoning,
    located.rule_adam_eps,
    located.rule_accum_overflow,
    located.rule_bad_input,
    reproduced.rule_bad_targets,
    reproduced.rule_compiler,
    reproduced.rule_not_reproducible,
    located.rule_fp16_loss,
    located.rule_loss_backward,
    overflow.rule_culprit,
    overflow.rule_sampled_culprit,
    hidden.rule_hidden_overflow,
    amplified.rule_amplified_backward,
    trends.rule_grad_underflow,
    trends.rule_masked_underflow,
    trends.rule_lost_updates,
    fallbacks.rule_scale_collapse,
    fallbacks.rule_nonfinite,
    fp8ranks.rule_fp8_amax_mismatch,
    fp8.rule_fp8_grad_underflow,
    fp8.rule_fp8_flushed,
    fp8.rule_fp8_saturated,
    fp8.rule_fp8_drift,
    fp8own.rule_fp8_mostly_flushed,
    fp8own.rule_fp8_self_drift,
    progress.rule_diverged,
    progress.rule_dead_units,
    learning.rule_not_learning,
]

# What ``preflight.check_amp_step`` asks of the step it records, beside its own listener: the
# rules that read one of the recorder's misuse events (not a trend), reused as they are, and
# the step's exception when it is one of GradScaler's or autocast's own
# (``misuse.EXCEPTIONS``).
PREFLIGHT_CHECKS = (misuse.rule_clip_before_unscale, misuse.rule_scaler_bypass,
                    misuse.rule_unscale_twice, misuse.rule_backward_unscaled,
                    misuse.rule_backward_after_unscale, misuse.rule_scaled_grads_in_loss)
PREFLIGHT_EXCEPTION = misuse.rule_exception

__all__ = ["RULES", "PREFLIGHT_CHECKS", "PREFLIGHT_EXCEPTION"]
