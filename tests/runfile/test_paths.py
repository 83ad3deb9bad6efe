"""Run file names: rank files, and what a name given to a command resolves to."""

import os

from ampdoctor.runfile import paths


def test_rank_file_names(tmp_path):
    base = str(tmp_path / "run.h5")
    assert paths.rank_path(base, 3) == str(tmp_path / "run.rank3.h5")
    assert paths.run_name(str(tmp_path / "run.rank3.h5")) == base
    for r in (10, 2, 0):
        (tmp_path / f"run.rank{r}.h5").write_bytes(b"")
    (tmp_path / "run.rankx.h5").write_bytes(b"")
    (tmp_path / "runner.rank1.h5").write_bytes(b"")
    assert [os.path.basename(p) for p in paths.rank_files(base)] == \
        ["run.rank0.h5", "run.rank2.h5", "run.rank10.h5"]
    assert len(paths.resolve(base)) == 3
    (tmp_path / "run.h5").write_bytes(b"")
    assert paths.resolve(base) == [base]  # a file of that name wins over rank files
