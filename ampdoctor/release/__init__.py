"""Release material as data (numpy only): per-layer tables (``layers``), fp16 readiness
(``readiness``), baseline comparison (``comparison``) and the release report (``report``).
"""
