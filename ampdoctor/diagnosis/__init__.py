"""From a run to a diagnosis: numpy only.

``facts`` reduces a run to what the rules need; the rules decide the verdicts (one function per
verdict, by family: ``misuse``, ``located``, ``overflow`` with ``culprit`` reading the forensic
replays, ``trends``, ``progress``), tried in the order of ``rules.RULES`` by
``engine.diagnose``; ``fixes`` are the fixes they propose; ``forecast`` is the early warning;
``ranks`` merges the files of a multi-process run.
"""
