"""Thresholds that more than one module reads: one home, so ``diagnose`` and ``report`` agree.

A threshold used by one module only stays next to its use (each rule module keeps its block);
one read by two (a rule and the readiness table, a rule and the notes) lives here.
"""

# taxonomy §3: a layer whose gradient is >= 50 % subnormal-or-flushed in fp16 is underflowing
# (of its non-zero values at one sampled step; see streamed.ZEROS_FLUSHED_IF for the zeros). The
# subnormal band counts too because in a tensor recorded in fp16 what fell below it is already
# an exact zero: the pile-up just above is what can still be seen. (trends, readiness)
LAYER_UNDERFLOW = 0.5
# taxonomy §3: a "low" scale, S <= 2**3, no longer lifts small fp16 gradients out of the
# subnormal band; a fall that ends above it is the scale adapting, not collapsing.
# (trends: grad_underflow; facts: the scale story's collapse)
LOW_SCALE = 8.0
# taxonomy §3: GradScaler starts at 2**16 and doubles every 2000 clean steps; 2**24 is about as
# high as a real run's scale climbs before one overflow halves it again, so a scale at or over
# it and rising means the gradients are ~0 (C8b). (notes.py; readiness' settled scale)
RUNAWAY_SCALE = 2.0 ** 24
# taxonomy C9a: most sampled elements unchanged by a step although their gradient was not 0
# (ml-by-hand PR #85: "0 / 768 moved"). Half is far above the ~0 of fp32 master weights.
# (trends: lost_updates; progress)
UNCHANGED_HIGH = 0.5
# Below this many steps a run is "short": trends need several sampled steps. (engine, progress)
SHORT_RUN = 50
# fp8: a non-zero value cast to exactly 0 loses everything; one in a hundred of a tensor's
# non-zero values flushed is where a layer's output visibly shifts (its mean loses that share
# of its terms), far above a healthy tensor's (about 1e-5 for a Gaussian under per-tensor e4m3:
# only |x| below amax / 2**19 flush). A tenth subnormal (1 to 3 significant bits, not 4) is a
# tensor squeezed to the bottom of the range by a few large values. (rules/fp8.py: the casts a
# run in fp8 made; release/fp8.py: the readiness of every Linear)
FP8_FLUSHED = 1e-2
FP8_SUBNORMAL = 0.1
# ... and a tensor mostly flushed: more than half of its non-zero values cast to 0, as when one
# massive activation takes a per-tensor scale (blind7's sink token: 96 % of the input). The
# same model under row-wise scaling flushes 6 % (the sink token's own row), healthy.
FP8_MOSTLY_FLUSHED = 0.5
# ... and saturated: more than one value in a thousand clamped at the format's max (the
# readiness's ``saturates``, release/fp8.py): a clamped value's error grows with it, and the
# values clamped are the largest, those that carry the tensor.
FP8_SATURATED = 1e-3
# A run in fp8 measured against itself (rules/fp8own.py): the saved step re-run with its fp8
# layers in high precision. Every cast rounds, and a healthy run's step moves too: on blind7's
# healthy fp8 runs, up to 34 % of the gradient (the sink-token head under row-wise scaling) and
# 3.5 % of the loss; 18 % and -1.1 % on its two-branch classifier (three tensorwise layers).
# A drift is a step whose gradient is as much the casts' error as its own (half of its norm:
# a cosine under about 0.87), or whose loss moves by PARITY_DIVERGE (below), the tolerance
# past which `compare` calls two runs diverged. (blind7's small-model drift: 5.7 % of the
# gradient, +143 % of the loss to first order; with F.mse_loss for its loss, 112 % and +137 %.)
FP8_SELF_GRAD_ERROR = 0.5
# Parity of two loss curves (diagnosis/parity.py): their trailing means agree within 2 %
# ("match"), or one goes beyond 10 % and never comes back within 2 % ("diverged"). (release/
# comparison.py: fp32 parity; rules/fp8.py: an fp8 run's drift from its baseline)
PARITY_RTOL = 0.02
PARITY_DIVERGE = 0.10
