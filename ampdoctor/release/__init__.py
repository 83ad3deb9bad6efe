"""Release material as data (numpy only): per-layer tables (``layers``), fp16 readiness
(``readiness``), fp8 readiness (``fp8``; ``fp8trial``: the fp8 trial read, and the lines to
paste), baseline comparison (``comparison``, over ``curves``: two loss curves lined up;
``fix_outcome``: a run against its fix) and the release report (``report``).
"""
