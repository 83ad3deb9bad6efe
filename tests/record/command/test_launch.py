"""``ampdoctor record``'s launcher: its settings, the child's environment, the bootstrap, and
that the command dies with it (a SIGKILL to ``record``; the one test here that starts one)."""

import os
import signal
import subprocess
import sys
import time

import pytest
from recording import descendants

from ampdoctor.record.command import launch


def test_bootstrap_and_launcher_agree():
    from ampdoctor import cli
    from ampdoctor.record import recorder

    text = open(os.path.join(launch.BOOTSTRAP_DIR, "sitecustomize.py")).read()
    assert f'_ACTIVE = "{launch.ENV_ACTIVE}"' in text
    assert launch.DEFAULT_EVERY == recorder.DEFAULT_EVERY
    envvars = {p.name: p.envvar for p in cli.cli.commands["record"].params}
    assert envvars == {"output": launch.ENV_OUTPUT, "every": launch.ENV_EVERY,
                       "fp8_trial": launch.ENV_FP8_TRIAL, "force": launch.ENV_FORCE,
                       "quiet": launch.ENV_QUIET, "apply": None, "command": None}


def test_settings_round_trip_through_the_environment():
    from ampdoctor.record.apply import prescription

    fixes = tuple(prescription.parse_all(["use_bf16", "lr_factor=0.1"]))
    s = launch.Settings(output="/tmp/x/run.h5", every=7, quiet=True, shown="run.h5",
                        apply=fixes)
    back = launch.Settings.from_env(s.to_env())
    assert (back.output, back.every, back.apply) == ("/tmp/x/run.h5", 7, fixes)
    assert back.fp8_trial is None and launch.ENV_FP8_TRIAL not in s.to_env()
    for budget in (0.0, 2.5):
        budgeted = launch.Settings(output="r.h5", fp8_trial=budget)
        assert launch.Settings.from_env(budgeted.to_env()).fp8_trial == budget
    # a hand-set variable that is no budget: the recorder's default, no failure
    env = dict(launch.Settings(output="r.h5").to_env(), **{launch.ENV_FP8_TRIAL: "soon"})
    assert launch.Settings.from_env(env).fp8_trial is None
    assert launch.start_line(s).endswith(", treated with --apply use_bf16 --apply lr_factor=0.1")
    assert launch.Settings.from_env(launch.Settings(output="r.h5").to_env()).apply == ()
    # a variable left in the user's environment is not this recording's --apply
    assert launch.ENV_APPLY not in launch.child_env(launch.Settings(output="r.h5"),
                                                    {launch.ENV_APPLY: '["use_bf16"]'})
    assert launch.Settings.from_env({"AMPDOCTOR_OUTPUT": "run.h5"}) is None  # not recording
    env = launch.child_env(s, {"PYTHONPATH": "/mine", "HOME": "/home/me"})
    assert env["PYTHONPATH"] == launch.BOOTSTRAP_DIR + os.pathsep + "/mine"
    assert env["HOME"] == "/home/me" and env[launch.ENV_TOP] == "1"
    assert launch.child_env(s, {})["PYTHONPATH"] == launch.BOOTSTRAP_DIR


@pytest.mark.parametrize("command, several", [
    (["torchrun", "--nnodes=2", "--node_rank=1", "train.py"], True),
    (["torchrun", "--nnodes", "2", "train.py"], True),
    (["torchrun", "--nnodes=1:4", "train.py"], True),
    (["accelerate", "launch", "--machine_rank", "1", "train.py"], True),
    (["torchrun", "--nnodes=1", "--nproc_per_node=2", "train.py"], False),
    (["python", "train.py", "--nodes", "2"], False),
])
def test_the_nodes_of_one_job_take_no_output_lock(command, several):
    """Each node of a multi-node job records into the same -o on a shared filesystem (its
    ranks into their own files): the lock that keeps two runs apart must not stop them."""
    assert launch.one_node_of_several(command) == several


def test_the_node_summary_is_kept_on_each_flush_seen_and_at_exit(tmp_path):
    """The keeper rewrites ``run.node{R}.json`` when one of this node's rank files changed,
    not otherwise, and once more at exit; another node's files are never in it."""
    from synthetic import Synth, write

    from ampdoctor.record.command import keeper, written
    from ampdoctor.runfile import nodes, paths

    base = str(tmp_path / "run.h5")
    marker = written.create()
    try:
        mine = [paths.rank_path(base, r) for r in (3, 2)]
        writers = [write(Synth(30), p, rank=r, world_size=4, flush_steps=10, stop_after=15)
                   for p, r in zip(mine, (3, 2))]
        write(Synth(30), paths.rank_path(base, 0), rank=0, world_size=4)  # another node's
        for p in mine:
            written.note(marker, p)
        settings = launch.Settings(output=base, session=marker)
        with keeper.Keeper(settings, interval=3600) as k:  # the thread waits: looks by hand
            k.start()  # (after the command's fork: record's preexec_fn wants no thread then)
            node = k.update()
            assert node == paths.node_path(base, 2) and k.update() is None  # nothing changed
            assert {s.status for s in nodes.lookup(mine).summaries.values()} == {"running"}
            for w in writers:
                w.close("finished")
        found = nodes.lookup(mine + [paths.rank_path(base, 0)])
        assert set(found.summaries) == set(mine) and paths.node_files(base) == [node]
        assert {s.status for s in found.summaries.values()} == {"finished"}
        assert {s.steps for s in found.summaries.values()} == {20}  # all it was given
    finally:
        written.remove(marker)


def test_force_removes_the_node_summaries_of_that_name_and_nothing_else(tmp_path):
    from synthetic import Synth, write

    from ampdoctor.runfile import nodes, paths

    base = str(tmp_path / "run.h5")
    write(Synth(10), paths.rank_path(base, 0))
    nodes.index(base)
    (tmp_path / "run.node9.json").write_text('{"mine": 1}')  # the user's, by chance
    launch.clear_output(base)
    assert sorted(os.listdir(tmp_path)) == ["run.node9.json"]


# ---------------------------------------------------------------------------------------------
# The training dies with its launcher (lifeline.py)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal and "
                    "pidfds are Linux's; elsewhere nothing is set")
@pytest.mark.parametrize("wrapped", [False, True], ids=["the-command", "below-a-wrapper"])
def test_a_sigkill_to_record_stops_the_training_and_the_file_says_terminated(tmp_path, wrapped):
    """A scheduler's SIGKILL to record's pid, or timeout -s KILL: the training must not go on
    unattended with its file saying "running". The command gets the parent-death signal; a
    torch process below a wrapper (which never imports torch) watches record's pid."""
    from conftest import PYTHON, ROOT, python_env

    import ampdoctor

    train = [PYTHON, os.path.join(ROOT, "fixtures", "examples", "train.py"), "--steps", "-1",
             "--sleep", "0.05"]
    command = [PYTHON, "-c", f"import subprocess; subprocess.run({train!r})"] if wrapped \
        else train
    proc = subprocess.Popen([PYTHON, "-m", "ampdoctor", "record", "-o", "run.h5", "--",
                             *command], cwd=tmp_path, env=python_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    training = []
    try:
        for line in proc.stdout:
            if line.startswith("step 3 "):
                break
        training = descendants(proc.pid)
        assert len(training) == (2 if wrapped else 1), training
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in training) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in training), "the training outlived its launcher"
    finally:  # whatever failed, leave nothing running
        for p in [proc.pid, *training]:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
    with ampdoctor.load(tmp_path / "run.h5") as run:  # closed by the SIGTERM it was sent
        assert run.status == "signal:SIGTERM"
        assert len(run.steps) >= 4 and list(run.steps["step"][:4]) == [0, 1, 2, 3]
