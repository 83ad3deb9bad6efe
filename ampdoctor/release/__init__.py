"""Release material as data (numpy only): per-layer tables (``layers``), fp16 readiness
(``readiness``), fp8 readiness (``fp8``; ``fp8trial``: the fp8 trial read, and the lines to
paste; ``fp8pays``: the dtype decision's fp8 line, which cards and which layers), baseline
comparison (``comparison``, over ``curves``: two loss curves lined up; ``fix_outcome``: a run
against its fix) and the release report (``report``).
"""
