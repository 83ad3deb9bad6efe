"""The forensic tier (tier 3): the failing step caught, replayed, explained and tried again.

Entered from the rest of ``ampdoctor`` through four modules only (``.importlinter`` holds
it): ``forensics`` (the recorder, its hooks and skip decision), ``losscall`` (the hooks' loss
capture), ``isolated`` (``preflight`` reuses its guarantees: the RNG saved and put back,
the buffers restored) and ``fp8trial`` (the recorder's fp8 trial at close); the others are
its own parts. Importing this package imports nothing.

- ``forensics``: the facade (``Forensics``): capture each step, trigger, replay, keep, write;
  ``capture``: each step's root calls, references only (``StepCapture``); ``policy``: which
  events are replayed, the rate limit (``EventPolicy``)
- ``findings``: what the tier reports: ``ForensicEvent``, ``ReplayResult``, ``TraceRow``
- ``snapshot``: a replay's findings written to the run file (/snapshots, /stats, /arrays)
- ``kept``: CPU copies of a replayed event's micro-batches, for ``rec.replay(step)`` later
- ``isolated``: a replay leaves no trace: RNG forked, module buffers and Python state put
  back, the user's hooks set aside and their output held back
- ``sideeffects``: what a replay cannot put back, refused while it runs (``SideEffect``)
- ``trace``: the instrumented pass: a captured root call re-run with every module measured
- ``culprit``: who went non-finite first, decided over a ``Trace`` (the ``Culprit``)
- ``computed``: a non-finite root input computed in this step (a custom Function between
  two roots): the op that made it, not the data
- ``replay``: the replay: one captured root call re-run instrumented, its culprit named
- ``culprit_rerun``: the culprit alone, re-run in the run's precision and in fp32
- ``reproduced``: the step re-run as recorded: did the replay repeat what the real step saw
- ``losscall``: the loss as the step computed it (a torch loss function's call, held)
- ``losssum``: how the step's loss calls combine into the loss it recorded, verified
- ``accum``: micro-batch gradients recomputed and summed in a half ``.grad``
- ``singular``: is the loss's backward singular at the failing values in fp32 too
- ``trial``: a saved step re-run with one change applied (``Trial``), finite or not
- ``proofs``: the fixes a diagnosis will name, each tried on the saved step as a ``Trial``
- ``fp8trial``: the last sampled step re-run with Linears in emulated fp8, alone and
  together: which to keep in bf16, and the recipe that suits the model
- ``fp8matmul``: a Linear's three matmuls in emulated fp8 (``in_fp8``)
- ``compiled_replay``: a compiled model's step that replays finite, replayed compiled again
  (aot_eager, inductor's decompositions, inductor): the region and op the compiler gets wrong
- ``lrrange``: the LR range test: the first state kept, trained again at a ladder of LRs on
  the failing step's batch at the first failure
"""
