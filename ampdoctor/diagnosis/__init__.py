"""From a run to a diagnosis: numpy only.

``facts`` reduces a run to what the rules need; ``rules`` and ``progress`` decide the verdicts
(one function per verdict), tried in order by ``engine.diagnose``; ``fixes`` are the fixes
they propose; ``ranks`` merges the files of a multi-process run.
"""
