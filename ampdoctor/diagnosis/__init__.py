"""From a run to a diagnosis: numpy only.

``engine.diagnose`` is the facade, over:

- the facts, what the rules read: ``facts`` (a run reduced to what the rules need, over
  ``tensors``: the /tensors table by id, and ``events``: the /events and /snapshots tables;
  with ``scale``: the loss scale's story, ``streamed``: /stats in one pass, its per-step arrays
  held over the sampled steps only in ``sampled``), ``layers``, ``curve``;
  the readers of what the forensic tier recorded, each named as its writer in
  ``record/forensic/`` or ``record/``: ``culprit`` (the replays), ``singular`` (the loss's
  fp32 check), ``schedules`` (LR scheduler steps per optimizer step), ``proofs`` (the fixes
  tried on the saved step: outcome, proven, order), ``reproduced`` (did the replay repeat the
  failure), ``opprobe`` (the sampled step's op probe: the overflows hidden inside a module);
  the facts more than one rule family (or the engine) reads: ``progress`` (dead units, would
  fp32 do the same, the loss's fall and the warnings of a healthy run), ``restarts`` (a
  GradScaler that restarted mid-run), ``batches`` (what the replays and samples say of the
  batch)
- ``rules/``: the rules by family, one function per verdict, tried in the order of
  ``rules.RULES``, and nothing else: entered only through the package (``RULES``,
  ``PREFLIGHT_CHECKS``), a family never importing another (its own docstring lists its
  modules)
- ``fixes/``: the fixes they propose; ``dose``: the numbers a fix prescribes, from the run
  (``lrrange``: the LR range test the recorder ran, read)
- ``verdict``: ``Diagnosis``, ``Finding``, ``Evidence``, ``Premise``, the verdict table;
  ``notes``: what a diagnosis could not tell; ``thresholds``: the shared thresholds
- ``forecast``: the early warning (``crossing``: each layer's fit and where it passes its
  dtype's limit; ``forecastrows``: the sampled rows it reads); ``fp8watch``: the early
  warning in fp8 terms (each Linear's headroom against the recipe's range, its growth, its
  input's kurtosis)
- ``ranks`` (the files of a multi-process run, merged), ``job`` (a job's ranks from their
  summaries), ``rankview`` (the rank view), ``jobfiles`` (what a job's diagnosis says of its
  files: node summaries used or passed over, rank files unreadable)
- ``fp8``: the facts of an fp8 run (its layers' own casts, headroom); ``fp8ranks``: a job's
  fp8 operands that several ranks hold whole, compared across its rank files; ``parity``: a
  run against its baseline, step by step (what ``compare`` and ``fp8_drift`` both decide on)
- ``objectives``: each loss of a run that backwards several, and which pull against each other
"""
