"""Node summaries (runfile/nodes.py): a node's rank summaries in run.node{R}.json, never taken
for a run file; the same summary as the rank file's own, used only while the rank file is
unchanged; a file that is not one passed over in one sentence; ``index`` idempotent. Synthetic
rank files (tests/support/synthetic.py), no torch."""

import json
import os

import pytest
from synthetic import Synth, write

from ampdoctor.errors import FormatTooNewError, RunFileError
from ampdoctor.runfile import nodes, paths, summary


def job(tmp_path, n=10, bad=7):
    base = str(tmp_path / "run.h5")
    files = []
    for r in range(n):
        s = Synth(60).skip([40], loss_nan=r == bad)
        files.append(paths.rank_path(base, r))
        write(s, files[-1], rank=r, world_size=n)
    return base, files


def test_a_node_summary_is_named_apart_from_every_run_file(tmp_path):
    base = str(tmp_path / "run.h5")
    assert paths.node_path(base, 8) == str(tmp_path / "run.node8.json")
    for name in ("run.node8.json", "run.node0.json", "run.rank1.h5"):
        (tmp_path / name).write_text("")
    assert paths.rank_files(base) == [str(tmp_path / "run.rank1.h5")]
    assert str(tmp_path / "run.node8.json") not in paths.related_files(base)
    assert paths.node_files(base) == [str(tmp_path / f"run.node{r}.json") for r in (0, 8)]


def test_an_entry_says_what_the_rank_files_own_summary_says(tmp_path):
    base, files = job(tmp_path)
    node = paths.node_path(base, 0)
    assert nodes.write(node, files[:8]) == 8
    assert os.stat(node).st_mode & 0o777 == os.stat(files[0]).st_mode & 0o777  # as readable
    found = nodes.lookup(files)
    assert found.nodes == [node] and set(found.summaries) == set(files[:8])
    for p in files[:8]:
        assert found.summaries[p] == summary.read(p)
    assert found.summaries[files[7]].located is None and found.summaries[files[7]].first_bad == 40


def test_an_entry_older_than_its_rank_file_is_not_used(tmp_path):
    base, files = job(tmp_path)
    nodes.write(paths.node_path(base, 0), files)
    later = os.stat(files[3]).st_mtime_ns + 10**9
    os.utime(files[3], ns=(later, later))
    found = nodes.lookup(files)
    assert files[3] not in found.summaries and list(found.stale) == [files[3]]
    assert len(found.summaries) == len(files) - 1


def test_a_rank_file_a_node_summary_names_but_is_gone_is_named(tmp_path):
    base, files = job(tmp_path)
    node = paths.node_path(base, 0)
    nodes.write(node, files)
    os.unlink(files[5])
    found = nodes.lookup([p for p in files if p != files[5]])
    assert found.missing == {os.path.abspath(files[5]): node}


def test_an_unfinished_ranks_status_is_asked_again_when_read(tmp_path):
    """A writer alive when the entry was written, gone when it is read: interrupted."""
    base = str(tmp_path / "run.h5")
    path = paths.rank_path(base, 0)
    w = write(Synth(30), path, flush_steps=10, stop_after=25)
    node = paths.node_path(base, 0)
    nodes.write(node, [path])
    assert nodes.lookup([path]).summaries[path].status == "running"
    doc = json.loads(open(node).read())
    doc["ranks"][0]["summary"]["writer"]["pid"] = 2**22 + 1  # no such process
    open(node, "w").write(json.dumps(doc))
    assert nodes.lookup([path]).summaries[path].status == "interrupted"
    w.close("finished")


@pytest.mark.parametrize("text, says", [
    ("{not json", "could not be read as a node summary"),
    ('{"format": "something-else", "format_version": 1}', "is not an ampdoctor node summary"),
    ('{"format": "ampdoctor-node-summary"}', "no format version"),
])
def test_a_file_that_is_not_a_node_summary_is_passed_over_in_one_sentence(tmp_path, text, says):
    base, files = job(tmp_path, n=2, bad=1)
    node = paths.node_path(base, 0)
    open(node, "w").write(text)
    with pytest.raises(RunFileError, match=says):
        nodes.read(node)
    assert not nodes.is_node_summary(node)  # record --force leaves it alone
    found = nodes.lookup(files)
    assert not found.summaries and not found.nodes and says in found.unreadable[0]


def test_a_newer_node_summary_says_upgrade(tmp_path):
    node = str(tmp_path / "run.node0.json")
    open(node, "w").write(json.dumps({"format": nodes.FORMAT, "format_version": 99}))
    with pytest.raises(FormatTooNewError, match="upgrade ampdoctor"):
        nodes.read(node)


def test_an_entry_cannot_name_a_file_outside_its_folder(tmp_path):
    base, files = job(tmp_path, n=2, bad=1)
    (tmp_path / "sub").mkdir()
    node = str(tmp_path / "sub" / "run.node0.json")
    entry = nodes.entry(files[0])
    entry["file"] = "../run.rank0.h5"
    nodes.dump(node, [entry])
    assert not nodes.lookup(files).summaries


def test_index_writes_what_is_missing_and_nothing_twice(tmp_path):
    base, files = job(tmp_path, n=20)
    nodes.write(paths.node_path(base, 0), files[:8])  # node 0 wrote its own
    done = nodes.index(base)
    assert done.covered == 8 and done.entries == 12
    assert done.written == [paths.node_path(base, 8), paths.node_path(base, 16)]
    stamps = {p: os.stat(p).st_mtime_ns for p in paths.node_files(base)}
    again = nodes.index(base)
    assert again.written == [] and again.covered == 20
    assert {p: os.stat(p).st_mtime_ns for p in paths.node_files(base)} == stamps
    assert len(nodes.lookup(files).summaries) == 20


def test_index_rewrites_an_entry_its_rank_file_outgrew(tmp_path):
    base, files = job(tmp_path, n=4, bad=1)
    nodes.index(base)
    later = os.stat(files[2]).st_mtime_ns + 10**9
    os.utime(files[2], ns=(later, later))
    done = nodes.index(base)
    assert done.covered == 3 and done.written == [paths.node_path(base, 0)]  # rewritten
    assert paths.node_files(base) == [paths.node_path(base, 0)]
    assert len(nodes.lookup(files).summaries) == 4 and nodes.index(base).written == []


def test_index_of_a_run_without_rank_files_is_one_sentence(tmp_path):
    with pytest.raises(RunFileError, match="has no rank files"):
        nodes.index(str(tmp_path / "run.h5"))
