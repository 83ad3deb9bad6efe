"""The column lists the analysis side reads by name are checked against the schema
(``schema.columns``): a misspelt or removed column fails at import, not on a run."""

import pytest

from ampdoctor.diagnosis import dose, streamed
from ampdoctor.live import tensorboard
from ampdoctor.release import readiness
from ampdoctor.runfile import schema


def test_a_column_the_table_does_not_have_fails_when_declared():
    assert schema.columns("stats", "step", "absmax") == ("step", "absmax")
    with pytest.raises(KeyError, match="/stats has no column absmaxx"):
        schema.columns("stats", "step", "absmaxx")


@pytest.mark.parametrize("names", [dose._COLUMNS, streamed._COLUMNS, readiness.COLUMNS,
                                   tensorboard._STATS_COLUMNS])
def test_each_module_reads_columns_of_stats(names):
    assert set(names) <= set(schema.STATS.names)
