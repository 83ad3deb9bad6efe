"""Rank files diagnosed together at scale: each file's /summary, the fast path against the full
read, the rank view, ``diagnose --rank``, ``top`` over many rank files, and the closing line of
one node of a multi-node job. Synthetic rank files (tests/support/synthetic.py), no torch,
except the multi-node recording on localhost at the end (slow)."""

import ast
import json
import os
import signal
import socket
import subprocess
import textwrap

import pytest
from conftest import PYTHON, ROOT, SUPPORT, python_env
from synthetic import Synth, write, write_rank

import ampdoctor
from ampdoctor import cli
from ampdoctor.diagnosis import engine, job, ranks
from ampdoctor.record.command import launch, written
from ampdoctor.runfile import nodes, paths, schema, store, summary
from ampdoctor.runfile.schema import Kind


def job_files(tmp_path, runs: dict, world=None, **kw) -> list:
    """Write ``{rank: Synth}`` as the rank files of one job; return their paths."""
    base = str(tmp_path / "run.h5")
    world = world or len(runs)
    out = []
    for rank, s in sorted(runs.items()):
        out.append(paths.rank_path(base, rank))
        write(s, out[-1], rank=rank, world_size=world, **kw)
    return out


def received(n=60, at=40):
    """A rank that only received a NaN through the all-reduce: skipped, gradients inf."""
    return Synth(n).skip([at])


def both(files):
    return engine.diagnose_files(files), engine.diagnose_files(files, full=True)


def assert_same(fast, full):
    """The fast path's answer is the full read's: verdict, first bad step and rank, the
    origin, the evidence, every rank's outline and the rank view (but for what was read)."""
    assert fast.verdict == full.verdict
    assert fast.first_bad == full.first_bad
    assert fast.run["origin_rank"] == full.run["origin_rank"]
    assert [e.text for e in fast.evidence] == [e.text for e in full.evidence]
    assert fast.run["ranks"] == full.run["ranks"]
    view = {k: v for k, v in fast.rank_view.items() if k != "read_in_full"}
    assert view == {k: v for k, v in full.rank_view.items() if k != "read_in_full"}


# ---------------------------------------------------------------------------------------------
# The summary a writer keeps


def test_summary_says_what_the_outline_says(tmp_path):
    s = Synth(50).skip(range(20, 23), loss_nan=True)
    s.snapshot(20, "forward", "blocks.1.attn", "Attention")
    s.sampled([10, 20], Kind.OUTPUT, "blocks.1.attn", nonfinite=lambda i: int(i == 20))
    path = str(tmp_path / "run.h5")
    write(s, path, flush_steps=7)
    found = summary.read(path)
    with store.load(path) as run:
        assert job.from_summary(found).outline == ranks.outline(run)
        facts = job.from_run(run)
    assert (found.steps, found.skipped, found.first_bad, found.loss_bad_steps) == (50, 3, 20, 3)
    assert found.located == {"step": 20, "phase": schema.Phase.FORWARD,
                             "module": "blocks.1.attn"}
    assert found.sampled["module"] == "blocks.1.attn" and found.sampled["step"] == 20
    # the loss scale as its change points: the three skips halve it
    assert found.scale_points == [(0, 65536.0), (21, 32768.0), (22, 16384.0), (23, 8192.0)]
    assert facts.scale_key == job.from_summary(found).scale_key


def test_a_file_of_format_1_or_a_summary_behind_its_tables_is_read_in_full(tmp_path):
    import h5py

    path = str(tmp_path / "run.h5")
    write(Synth(10).skip([4]), path)
    with h5py.File(path, "r+") as f:  # the summary of a flush that never reached /steps
        row = f["summary"][0]
        row["steps"] = 9
        f["summary"][0] = row
    assert summary.read(path) is None
    with h5py.File(path, "r+") as f:  # a file of format 1: no /summary
        del f["summary"]
        f.attrs["format_version"] = 1
    assert summary.read(path) is None
    with store.load(path) as run:
        assert ranks.outline(run)["first_bad"] == 4


def test_a_summary_that_fails_never_stops_the_writer(tmp_path, monkeypatch):
    path = str(tmp_path / "run.h5")

    def broken(*a, **k):
        raise RuntimeError("bug in the tally")

    monkeypatch.setattr(summary.Tally, "add", broken)
    write(Synth(10), path)
    with store.load(path) as run:
        assert len(run.steps) == 10 and run.status == "finished"
    assert summary.read(path) is None  # readers fall back to the tables


def test_the_kind_order_is_the_one_the_sampled_reduction_uses():
    from ampdoctor.diagnosis.streamed import _PHASE_ORDER

    assert {int(k): o for k, o in schema.KIND_ORDER.items()} == \
        {k: order for k, (order, _) in _PHASE_ORDER.items()}


# ---------------------------------------------------------------------------------------------
# The fast path gives the full read's answer


def test_fast_path_agrees_when_the_first_bad_rank_is_a_late_one(tmp_path):
    runs = {r: received() for r in range(6)}
    runs[4] = Synth(60).skip([40], loss_nan=True)  # born on rank 4, late, at step 40
    runs[4].snapshot(40, "forward", "blocks.3.mlp", "MLP", fp32_finite=1)
    runs[2] = Synth(60).skip([40]).skip([52], loss_nan=True)  # rank 2's own NaN, later
    fast, full = both(job_files(tmp_path, runs))
    assert_same(fast, full)
    assert fast.first_bad["rank"] == 4 and fast.first_bad["step"] == 40
    assert fast.rank_view["read_in_full"][0] == 4
    origins = fast.rank_view["origins"]
    assert [(o["rank"], o["steps"], o["first"]) for o in origins] == [(4, 1, 40), (2, 1, 52)]
    assert origins[0]["module"] == "blocks.3.mlp"


def test_a_module_output_the_sampled_tier_saw_non_finite_was_born_on_its_rank(tmp_path):
    """Module outputs are a rank's own (only gradients are all-reduced): a non-finite output
    on a sampled step makes that rank the origin, even with a finite loss."""
    runs = {0: received(at=20), 2: received(at=20)}
    runs[1] = Synth(60).skip([20])
    runs[1].sampled([10, 20], Kind.OUTPUT, "blocks.2.ffn", nonfinite=lambda i: 2 * (i == 20))
    fast, full = both(job_files(tmp_path, runs))
    assert_same(fast, full)
    assert fast.run["origin_rank"] == 1
    first = next(o for o in fast.run["ranks"] if o["rank"] == 1)
    assert first["local"] and first["module"] == "blocks.2.ffn" and first["phase"] == "forward"
    assert "ranks 0, 2 only received it" in fast.evidence[0].text


def _own(s: Synth, *steps: int) -> Synth:
    """ShardedGradScaler's rank: its own found_inf was set on ``steps``."""
    s.meta["scaler"] = dict(s.meta["scaler"], own_found_inf=True)
    for i in steps:
        s.steps["flags"][i] |= ranks.OWN
    return s


def test_own_found_inf_names_the_rank_whose_shard_went_non_finite(tmp_path):
    """Every rank skipped step 20 (ShardedGradScaler all-reduces found_inf) and no loss went
    non-finite: the rank whose own flag was set is the origin, not the lowest rank."""
    runs = {r: _own(received(at=20)) for r in range(4)}
    runs[2] = _own(received(at=20), 20)
    runs[3] = _own(received(at=20), 30)  # its own shard later: not the first
    files = job_files(tmp_path, runs)
    fast, full = both(files)
    assert_same(fast, full)
    assert fast.run["origin_rank"] == 2  # (one skip alone is healthy: no first_bad)
    assert fast.evidence[0].text == (
        "rank 2 went non-finite first, at step 20: non-finite gradients in its own shard, "
        "before the scaler combined the ranks' found_inf; ranks 0, 1, 3: own gradients "
        "finite, skipped only because the ranks' found_inf is combined")
    assert fast.rank_view["first"]["own_grads"] and not fast.rank_view["first"]["local"]
    assert "found_inf" in "\n".join(rankview_lines(fast))
    # Without the flags (a plain GradScaler's ranks) the tie goes to the lowest rank, as before
    (tmp_path / "plain").mkdir()
    plain = job_files(tmp_path / "plain", {r: received(at=20) for r in range(3)})
    assert engine.diagnose_files(plain).run["origin_rank"] == 0


def rankview_lines(d):
    from ampdoctor.diagnosis import rankview

    return rankview.lines(d.rank_view)


def test_a_non_finite_loss_outranks_an_own_found_inf(tmp_path):
    """A NaN in one rank's batch reaches every rank's shard through the reduce-scatter: all own
    flags are set, and the rank whose loss went non-finite is still the origin."""
    runs = {r: _own(received(at=20), 20) for r in range(3)}
    runs[1] = _own(Synth(60).skip([20], loss_nan=True), 20)
    fast, full = both(job_files(tmp_path, runs))
    assert_same(fast, full)
    assert fast.first_bad["rank"] == fast.run["origin_rank"] == 1
    assert "a non-finite loss" in fast.evidence[0].text
    assert not fast.rank_view["first"]["own_grads"]


def test_fast_path_agrees_when_the_ranks_disagree_on_the_scale(tmp_path):
    n = 200  # GradScaler probing every third step: more change points than a summary holds
    runs = {r: Synth(n, growth_interval=2).skip(range(1, n, 3)) for r in range(5)}
    runs[3] = Synth(n, growth_interval=2).skip(range(1, n, 3)).skip([102])  # its own skip
    files = job_files(tmp_path, runs)
    assert summary.read(files[0]).scale_points is None  # the history is read from /steps
    fast, full = both(files)
    assert_same(fast, full)
    div = next(e for e in fast.evidence if e.key == "scale_divergence")
    assert div.step == 103 and "rank 3:" in div.text
    assert fast.rank_view["scale"]["differ"][0]["ranks"] == [3]
    assert fast.rank_view["skips"]["differ"] == [{"rank": 3, "skipped": 68}]
    assert 3 in fast.rank_view["read_in_full"]  # a rank that disagrees is read for its notes


def test_fast_path_agrees_when_a_rank_file_was_truncated_by_a_kill(tmp_path):
    files = job_files(tmp_path, {r: received() for r in (0, 1, 3)}, world=4)
    killed = paths.rank_path(str(tmp_path / "run.h5"), 2)
    code = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {SUPPORT!r})
        from synthetic import Synth, write
        s = Synth(60).skip([40])
        s.nan_loss([12])
        write(s, {killed!r}, rank=2, world_size=4, flush_steps=10, stop_after=35)
        os.kill(os.getpid(), signal.SIGKILL)   # mid-run: steps 30-39 never flushed
    """)
    proc = subprocess.run([PYTHON, "-c", code], env=python_env(), capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    found = summary.read(killed)
    assert found is not None and found.steps == 30 and found.status == "interrupted"
    fast, full = both(sorted(files + [killed]))
    assert_same(fast, full)
    assert fast.first_bad["rank"] == 2 and fast.first_bad["step"] == 12
    assert fast.rank_view["short"] == [{"rank": 2, "last_step": 29}]


def test_fast_path_takes_a_file_of_format_1_among_the_others(tmp_path):
    import h5py

    runs = {r: received() for r in range(3)}
    runs[1] = Synth(60).skip([40], loss_nan=True)
    files = job_files(tmp_path, runs)
    with h5py.File(files[2], "r+") as f:
        del f["summary"]
        f.attrs["format_version"] = 1
    fast, full = both(files)
    assert_same(fast, full)
    assert fast.first_bad["rank"] == 1


def test_fast_path_reads_one_rank_at_a_time(tmp_path, monkeypatch):
    runs = {r: received() for r in range(8)}
    runs[5] = Synth(60).skip([40], loss_nan=True)
    files = job_files(tmp_path, runs)
    real = store.load
    open_now, most, loads = [0], [0], []

    class Counted:
        def __init__(self, path, *columns, **kw):
            self.run = real(path, *columns, **kw)
            loads.append(os.path.basename(path))

        def __enter__(self):
            open_now[0] += 1
            most[0] = max(most[0], open_now[0])
            return self.run

        def __exit__(self, *exc):
            open_now[0] -= 1
            self.run.close()

    monkeypatch.setattr(store, "load", Counted)
    d = engine.diagnose_files(files)
    assert most[0] == 1 and loads == ["run.rank5.h5"]  # only the origin, the others agree
    assert d.first_bad["rank"] == 5
    assert any("the other 7 rank files were read from their summaries" in n for n in d.notes)


# ---------------------------------------------------------------------------------------------
# The rank view, and one rank's own diagnosis


# ---------------------------------------------------------------------------------------------
# Node summaries: one small file per node read in place of its ranks' own summaries


def node_job(tmp_path, n=20, bad=13):
    """A job of ``n`` ranks whose NaN is born on rank ``bad`` at step 40, the others only
    receiving it; its node summaries written by ``ampdoctor index``'s call."""
    runs = {r: received() for r in range(n)}
    runs[bad] = Synth(60).skip([40], loss_nan=True)
    runs[bad].snapshot(40, "forward", "blocks.3.mlp", "MLP", fp32_finite=1)
    runs[3] = Synth(60).skip([40]).skip([52])  # a rank whose skips disagree: read in full
    files = job_files(tmp_path, runs)
    assert len(nodes.index(str(tmp_path / "run.h5")).written) == (n + 7) // 8
    return files


def counted_reads(monkeypatch):
    """The rank files whose own /summary was read."""
    real, read = summary.read, []

    def counting(path):
        read.append(engine.paths_rank(path))
        return real(path)
    monkeypatch.setattr(summary, "read", counting)
    return read


def test_node_summaries_give_the_full_reads_answer_reading_no_rank_summary(tmp_path,
                                                                          monkeypatch):
    files = node_job(tmp_path)
    full = engine.diagnose_files(files, full=True)
    read = counted_reads(monkeypatch)
    fast = engine.diagnose_files(files)
    assert_same(fast, full)
    assert read == [] and fast.first_bad["rank"] == 13 and fast.first_bad["step"] == 40
    assert fast.rank_view["read_in_full"][:2] == [13, 3]
    alone = engine.diagnose_files(files, nodes=False)  # each rank's own summary: the same
    assert_same(alone, full)
    assert not any("node summar" in n for n in fast.notes)


def test_a_missing_node_summary_is_read_from_its_ranks_and_named(tmp_path, monkeypatch):
    files = node_job(tmp_path)
    os.unlink(str(tmp_path / "run.node8.json"))  # a node that died before writing its own
    full = engine.diagnose_files(files, full=True)
    read = counted_reads(monkeypatch)
    fast = ampdoctor.diagnose(str(tmp_path / "run.h5"))
    assert_same(fast, full)
    assert sorted(read) == list(range(8, 16))
    assert "8 rank files have no node summary (a node that stopped before writing one): read " \
           "from their own files; `ampdoctor index RUN` writes one." in fast.notes


def test_a_stale_node_summary_is_passed_over_for_the_rank_that_changed(tmp_path, monkeypatch):
    files = node_job(tmp_path)
    # rank 17 written again after its node summary, now with a NaN of its own, earlier
    s = Synth(60).skip([30], loss_nan=True).skip([40])
    write(s, files[17], rank=17, world_size=20)
    full = engine.diagnose_files(files, full=True)
    read = counted_reads(monkeypatch)
    fast = engine.diagnose_files(files)
    assert_same(fast, full)
    assert fast.first_bad["rank"] == 17 and fast.first_bad["step"] == 30
    assert read == [17]
    assert "The files of rank 17 changed after their node summary was written: read on their " \
           "own." in fast.notes


def test_a_rank_cut_short_is_left_out_and_named_and_the_others_diagnosed(tmp_path):
    files = node_job(tmp_path)
    with open(files[6], "r+b") as fh:  # a copy cut short, a disk that filled
        fh.truncate(os.path.getsize(files[6]) // 2)
    d = engine.diagnose_files(files)
    assert d.first_bad["rank"] == 13 and d.first_bad["step"] == 40
    assert [o["rank"] for o in d.run["ranks"]] == [r for r in range(20) if r != 6]
    left = next(n for n in d.notes if n.startswith("Left out, could not be read: "))
    assert "run.rank6.h5" in left and "The other 19 rank files were diagnosed" in left
    assert d.rank_view["missing"] == [6]
    with pytest.raises(ampdoctor.RunFileError, match="run.rank6.h5"):
        engine.diagnose_files(files[6:7] * 2)  # nothing left to diagnose: its own sentence


def test_a_node_summary_naming_a_rank_file_that_is_gone_says_so(tmp_path):
    files = node_job(tmp_path)
    os.unlink(files[18])
    d = ampdoctor.diagnose(str(tmp_path / "run.h5"))
    assert "run.node16.json names run.rank18.h5, which is missing." in d.notes
    assert d.first_bad["rank"] == 13


def test_a_node_summary_for_a_file_of_format_1_is_never_written(tmp_path):
    import h5py

    runs = {r: received() for r in range(3)}
    runs[1] = Synth(60).skip([40], loss_nan=True)
    files = job_files(tmp_path, runs)
    with h5py.File(files[2], "r+") as f:
        del f["summary"]
        f.attrs["format_version"] = 1
    done = nodes.index(str(tmp_path / "run.h5"))
    assert done.entries == 2 and done.unreadable == 1
    assert_same(engine.diagnose_files(files), engine.diagnose_files(files, full=True))


def test_rank_view_text_json_and_markdown(tmp_path):
    runs = {r: received() for r in range(12)}
    runs[7] = Synth(60).skip([40, 45, 50], loss_nan=True)
    runs[3] = Synth(60).skip([40]).skip([45], loss_nan=True)
    files = job_files(tmp_path, runs, world=16)
    d = engine.diagnose_files(files)
    text = str(d)
    block = text[text.index("ranks:"):text.index("around the first bad step")]
    assert "went non-finite first: rank 7 at step 40" in block
    assert "rank 7 on 3 steps (first 40)" in block and "rank 3 on 1 step (first 45)" in block
    assert "no file: ranks 12-15" in block
    assert "run.rank{0-11}.h5" in d.notes[0]
    data = json.loads(cli_out(["diagnose", str(tmp_path / "run.h5"), "--format", "json"]))
    assert data["rank_view"]["origins"][0] == {"rank": 7, "steps": 3, "first": 40}
    assert data["rank_view"]["missing"] == [12, 13, 14, 15]
    assert "### Ranks" in cli_out(["diagnose", str(tmp_path / "run.h5"), "--format",
                                   "markdown"])


def cli_out(args):
    proc = subprocess.run([PYTHON, "-m", "ampdoctor", *args], env=python_env(),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_diagnose_one_rank(tmp_path, capsys):
    runs = {r: received() for r in range(3)}
    runs[1] = Synth(60).skip([40], loss_nan=True)
    job_files(tmp_path, runs)
    base = str(tmp_path / "run.h5")
    d = ampdoctor.diagnose(base, rank=2)
    assert d.rank_view is None and d.run["rank"] == 2 and "rank" not in (d.first_bad or {})
    assert cli.main(["diagnose", base, "--rank", "1", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["run"]["rank"] == 1 and data["rank_view"] is None
    assert cli.main(["diagnose", base, "--rank", "5"]) == 2
    err = capsys.readouterr().err
    assert "has no file for rank 5 (ranks 0-2 found)" in err and "Traceback" not in err
    assert cli.main(["diagnose", paths.rank_path(base, 1), "--rank", "2"]) == 2
    assert "is rank 1's file, not rank 2's" in capsys.readouterr().err


def test_many_ranks_in_few_words():
    assert ranks.ranks_text([0, 2]) == "ranks 0, 2"
    assert ranks.ranks_text(list(range(512)) + list(range(513, 1024))) == "ranks 0-511, 513-1023"
    assert ranks.ranks_text(list(range(0, 40, 2)), 3) == "ranks 0, 2, 4 and 17 more"
    many = {r: (32768.0 if r == 512 else 65536.0) for r in range(1024)}
    assert ranks.scales_text(many) == "ranks 0-511, 513-1023: 65536; rank 512: 32768"
    assert ranks.files_text([f"d/run.rank{r}.h5" for r in range(20)]) == "run.rank{0-19}.h5"


# ---------------------------------------------------------------------------------------------
# top over many rank files: one rank followed in full, the others from their summaries


def test_top_over_many_rank_files_follows_one_in_full(tmp_path):
    import io

    from ampdoctor.live import follow, top

    runs = {r: received() for r in range(12)}
    runs[9] = Synth(60).skip([40], loss_nan=True)
    job_files(tmp_path, runs)
    base = str(tmp_path / "run.h5")
    with follow.Follower(base, full_ranks=follow.FULL_RANKS) as f:
        f.poll()
        assert [s.rank for s in f.states] == [9]  # the origin, alone in full
        assert len(f.summaries.known) == 12 and f.final
    out = io.StringIO()
    top.top(base, once=True, out=out)
    frame = out.getvalue()
    assert "rank 9 of 12" in frame
    assert "ranks     12 of 12: 12 finished at step 59" in frame
    assert "non-finite from step 40 on ranks 0-11" in frame


def test_tops_first_poll_reads_the_node_summaries_not_every_rank_file(tmp_path, monkeypatch):
    from ampdoctor.live import follow

    runs = {r: received() for r in range(12)}
    runs[9] = Synth(60).skip([40], loss_nan=True)
    files = job_files(tmp_path, runs)
    base = str(tmp_path / "run.h5")
    nodes.write(paths.node_path(base, 0), files[:8])
    nodes.write(paths.node_path(base, 8), files[8:])
    later = os.stat(files[5]).st_mtime_ns + 10**9  # rank 5 written since its node's last write
    os.utime(files[5], ns=(later, later))
    read = []
    outline = follow._outline
    monkeypatch.setattr(follow, "_outline", lambda p: read.append(p) or outline(p))
    shown = follow.Summaries(budget=0.0)  # no time to read: what the node summaries say
    shown.poll(files)
    assert read == [] and len(shown.known) == 12
    assert shown.known[files[5]].stamp == follow.PROVISIONAL
    assert [o["rank"] for o in shown.outlines] == list(range(12))
    assert shown.known[files[9]].outline["first_bad"] == 40
    shown.budget = 1.0
    shown.poll(files)  # the stale one is due, and read first
    assert read == [files[5]] and shown.known[files[5]].stamp != follow.PROVISIONAL
    shown.poll(files)
    assert read == [files[5]]  # nothing changed since


# ---------------------------------------------------------------------------------------------
# Each node says what it knows


def test_the_closing_line_reads_only_this_nodes_files(tmp_path):
    runs = {r: received() for r in range(4)}
    runs[3] = Synth(60).skip([40], loss_nan=True)
    files = job_files(tmp_path, runs)
    for other in files[:2]:  # the other node's files: still being written, here unreadable
        with open(other, "wb") as fh:
            fh.write(b"not finished")
    marker = written.create()
    try:
        for path in files[2:]:
            written.note(marker, path)
        line = launch.summary(launch.Settings(output=str(tmp_path / "run.h5"), shown="run.h5",
                                              session=marker))
    finally:
        written.remove(marker)
    assert "recorded 60 steps each on ranks 2, 3 of 4 into run.rank{2,3}.h5" in line
    assert "this node's ranks: " in line and "on rank 3" in line
    assert "the job's verdict is ampdoctor diagnose run.h5 over all 4 ranks' files" in line
    assert "not finished" not in line and "could not" not in line
    assert not os.path.exists(marker)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_on_localhost_each_say_what_they_know(tmp_path):
    """Two ``record`` processes, each around ``torchrun --nnodes=2 --node_rank=K`` into one
    directory; a NaN batch on rank 3 (the second node): each node's closing line speaks of
    its own ranks, and ``diagnose`` over the directory names rank 3."""
    port = free_port()
    script = os.path.join(ROOT, "fixtures", "examples", "train_ddp.py")
    env = dict(python_env(), OMP_NUM_THREADS="1")
    procs = []
    for node in (0, 1):
        cmd = [PYTHON, "-m", "ampdoctor", "record", "-o", "run.h5", "--", PYTHON, "-m",
               "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
               "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}",
               script, "--bad-rank", "3", "--bad-step", "3"]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    lines = [[x for x in err.splitlines() if x.startswith("ampdoctor: recorded")][-1]
             for _, err in outs]
    assert "on ranks 0, 1 of 4 into run.rank{0,1}.h5" in lines[0]
    assert "this node's ranks: non-finite gradients from step 3, none born here" in lines[0]
    assert "on ranks 2, 3 of 4 into run.rank{2,3}.h5" in lines[1]
    assert "this node's ranks: bad_input, first bad at step 3 on rank 3" in lines[1]
    assert all("the job's verdict is ampdoctor diagnose run.h5" in x for x in lines)
    base = str(tmp_path / "run.h5")  # each node left its node summary, read in their place
    assert paths.node_files(base) == [paths.node_path(base, 0), paths.node_path(base, 2)]
    assert len(nodes.lookup(paths.rank_files(base)).summaries) == 4
    d = ampdoctor.diagnose(base)
    assert d.first_bad["rank"] == 3 and d.first_bad["step"] == 3
    assert [o["rank"] for o in d.run["ranks"]] == [0, 1, 2, 3]
    assert d.rank_view["origins"][0]["rank"] == 3


COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "broadcast", "broadcast_object_list", "barrier", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "gather", "scatter", "send", "recv",
               "isend", "irecv", "monitored_barrier", "new_group"}


def test_ampdoctor_starts_no_collective_of_its_own():
    """No torch.distributed collective is called anywhere in ampdoctor (a rank that starts
    one alone hangs the job): a call ``dist.X(...)`` or ``torch.distributed.X(...)``."""
    found = []
    for folder, _, names in os.walk(os.path.join(ROOT, "ampdoctor")):
        for name in (n for n in names if n.endswith(".py")):
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                        node.func.attr in COLLECTIVES and _distributed(node.func.value):
                    found.append(f"{path}:{node.lineno}")
    assert found == []


def _distributed(value):
    if isinstance(value, ast.Name):
        return value.id in ("dist", "distributed", "c10d")
    return getattr(value, "attr", None) in ("distributed", "c10d")


def test_merged_diagnosis_names_the_origin_rank_and_scale_divergence(tmp_path):
    base = str(tmp_path / "run.h5")
    # Rank 1's loss went NaN at step 2; ranks 0 and 2 only received NaN gradients there.
    # Rank 2's scaler then disagreed (it did not back off): the scales diverge at step 3.
    write_rank(paths.rank_path(base, 0), 0, 3, [8.0, 8.0, 8.0, 4.0], bad_grad={2}, skipped={2})
    write_rank(paths.rank_path(base, 1), 1, 3, [8.0, 8.0, 8.0, 4.0], bad_loss={2},
               bad_grad={2}, skipped={2})
    write_rank(paths.rank_path(base, 2), 2, 3, [8.0, 8.0, 8.0, 8.0], bad_grad={2})
    d = ampdoctor.diagnose(base)
    assert d.first_bad["rank"] == 1 and d.first_bad["step"] == 2
    assert d.run["path"] == base and d.run["world_size"] == 3
    assert [o["rank"] for o in d.run["ranks"]] == [0, 1, 2]
    texts = [e.text for e in d.evidence]
    assert texts[0].startswith("rank 1 went non-finite first, at step 2: a non-finite loss")
    assert "ranks 0, 2 only received it" in texts[0]
    assert "loss scale diverged across ranks at step 3 (rank 0: 4, rank 1: 4, rank 2: 8)" in \
        texts[1]
    assert any("weights no longer match" in n for n in d.notes)


def test_merge_reports_missing_ranks_and_healthy_ranks(tmp_path):
    base = str(tmp_path / "run.h5")
    write_rank(paths.rank_path(base, 0), 0, 4, [8.0, 8.0])
    write_rank(paths.rank_path(base, 1), 1, 4, [8.0, 8.0])
    d = ampdoctor.diagnose(base)
    assert d.verdict == "healthy" and d.first_bad is None
    assert any("Only 2 of 4 rank files" in n for n in d.notes)
    assert any("identical on every rank" in e.text for e in d.evidence)


def test_scale_divergence_is_none_when_scales_agree():
    assert ranks.scale_divergence({0: {0: 2.0, 1: 1.0}, 1: {0: 2.0, 1: 1.0}}) is None
    assert ranks.scale_divergence({0: {0: 2.0}}) is None
    assert ranks.scale_divergence({0: {}, 1: {}}) is None
