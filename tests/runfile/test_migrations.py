"""Declared migrations (runfile/migrations.py): a table an older format wrote, with fewer
columns, is lifted into the current dtype, the added columns at their declared defaults; a
table of a dtype no migration declares is still refused as damaged."""

import os
import shutil

import h5py
import numpy as np
import pytest
from conftest import ROOT

from ampdoctor.diagnosis import engine
from ampdoctor.errors import RunFileError
from ampdoctor.runfile import migrations, schema, store

V2 = os.path.join(ROOT, "fixtures", "formats", "v2.h5")


def _without(dtype, column):
    return np.dtype([(n, dtype.fields[n][0]) for n in dtype.names if n != column])


def _stored(name):
    """The dtype v2.h5 stores ``name`` in: the schema's of format 2, whatever columns a later
    format adds (declared by its own migration)."""
    with h5py.File(V2, "r") as f:
        return f[name].dtype


OLD_STEPS = _without(_stored("steps"), "peak_mem")
OLD_GROUPS = _without(_stored("groups"), "weight_decay")  # read on demand (a Table)
DECLARED = (migrations.Migration("steps", (2,), OLD_STEPS, {"peak_mem": 7}),
            migrations.Migration("groups", (2,), OLD_GROUPS, {"weight_decay": 0.5}))


def _rewrite(f, name, dtype):
    """Table ``name`` of ``f`` stored again as ``dtype``: the columns it shares, in order."""
    rows = f[name][:]
    old = np.zeros(len(rows), dtype)
    for column in dtype.names:
        old[column] = rows[column]
    chunks = f[name].chunks
    del f[name]
    f.create_dataset(name, data=old, maxshape=(None,), chunks=chunks)
    return rows


@pytest.fixture
def older(tmp_path):
    """v2.h5 with /steps and /groups as a writer without two of their columns wrote them."""
    path = str(tmp_path / "older.h5")
    shutil.copy(V2, path)
    with h5py.File(path, "r+") as f:
        steps = _rewrite(f, "steps", OLD_STEPS)
        groups = _rewrite(f, "groups", OLD_GROUPS)
    return path, steps, groups


def test_the_declarations_name_tables_and_columns_of_the_schema(monkeypatch):
    migrations.check_declarations()
    monkeypatch.setattr(migrations, "MIGRATIONS", DECLARED)
    migrations.check_declarations()


def test_an_undeclared_older_dtype_is_damage(older):
    path, _, _ = older
    with pytest.raises(RunFileError, match="unexpected columns"):
        store.load(path)


def test_an_older_table_is_lifted_with_the_declared_defaults(older, monkeypatch):
    path, steps, groups = older
    monkeypatch.setattr(migrations, "MIGRATIONS", DECLARED)
    with store.load(path) as run:
        assert run.steps.dtype == schema.STEPS and len(run.steps) == len(steps)
        assert (run.steps["peak_mem"] == 7).all()
        for column in OLD_STEPS.names:
            np.testing.assert_array_equal(run.steps[column], steps[column])
        assert run.groups.dtype == schema.GROUPS and len(run.groups) == len(groups)
        assert (run.groups["weight_decay"] == 0.5).all()
        np.testing.assert_array_equal(run.groups.column("lr", 1), groups["lr"][1:])
        np.testing.assert_array_equal(run.groups.columns(["step", "group"])["step"],
                                      groups["step"])
        engine.diagnose(run)
    np.testing.assert_array_equal(store.load_steps(path)["step"], steps["step"])
    with store.Tail(path) as tail:
        assert (tail.read()["steps"]["peak_mem"] == 7).all()
    tables = store.inspect(path)["tables"]
    assert not tables["steps"]["damaged"] and not tables["groups"]["damaged"]


def test_a_migration_for_another_version_does_not_apply(older, monkeypatch):
    path, _, _ = older
    monkeypatch.setattr(migrations, "MIGRATIONS",
                        tuple(migrations.Migration(m.table, (1,), m.dtype, m.defaults)
                              for m in DECLARED))
    with pytest.raises(RunFileError, match="unexpected columns"):
        store.load(path)
