"""The torch side: recording a run.

``recorder.Recorder`` is the facade behind ``ampdoctor.watch``, over its parts: ``journal``
(the run file's rows), ``watched`` (model, optimizers, scaler), ``hooks`` (the hook
callbacks, declared in ``listener``, reached through ``patches``), ``steplog`` and ``steps``
(the step buffer and its rows), ``skips`` (the skip decision and its syncs), ``exits``
(SIGTERM, atexit, fork); ``stats``, ``sampler``, ``readback``, ``amp_state``, ``compiled`` and
``sharding`` are what its hooks use; ``forensics`` (with ``findings``, ``snapshot``, ``kept``),
``replay`` (``trace``, ``culprit``, ``rerun``) and ``opprobe`` are tier 3 (the culprit of the
first non-finite value); ``launch``, ``child`` and ``_bootstrap/`` are ``ampdoctor record``.

Importing this package imports nothing (``launch`` is imported by the CLI without torch).
"""
