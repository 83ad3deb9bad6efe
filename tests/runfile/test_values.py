"""values.py: what a writer never writes is one sentence at the reader (exit 2)."""

import math

import pytest

from ampdoctor.errors import RunFileError
from ampdoctor.runfile import values


@pytest.mark.parametrize("key,value,said", [
    ("scaler", {"growth_interval": math.nan}, "scaler.growth_interval = nan"),
    ("recorder", {"every": math.inf}, "recorder.every = inf"),
    ("model", {"param_dtypes": {"float16": -1}}, "model.param_dtypes.float16 = -1"),
    ("optimizer", [{"groups": 1, "param_dtypes": {"float32": math.inf}}],
     "optimizer[0].param_dtypes.float32 = inf"),
    ("optimizer", [{"groups": True}], "optimizer[0].groups = True"),
])
def test_a_count_that_is_no_count_is_refused(key, value, said):
    with pytest.raises(RunFileError, match="where a count") as err:
        values.check_meta("run.h5", key, value, 3)
    assert said in str(err.value) and "/meta row 3" in str(err.value)


def test_counts_a_writer_writes_pass():
    values.check_meta("run.h5", "scaler", {"growth_interval": 2000, "init_scale": math.inf}, 0)
    values.check_meta("run.h5", "optimizer", [{"groups": 2, "param_dtypes": {"float32": 10.0},
                                               "hyper": {"lr": math.nan}}], 0)
    values.check_meta("run.h5", "model", {"param_dtypes": None, "trainable": None}, 0)
