"""The torch side: recording a run.

``recorder.Recorder`` is the hook state machine behind ``ampdoctor.watch``; ``patches``,
``stats``, ``sampler``, ``readback``, ``amp_state``, ``compiled`` and ``sharding`` are what its
hooks use; ``forensics``, ``replay`` and ``opprobe`` are tier 3 (the culprit of the first
non-finite value); ``launch``, ``child`` and ``_bootstrap/`` are ``ampdoctor record``.

Importing this package imports nothing (``launch`` is imported by the CLI without torch).
"""
