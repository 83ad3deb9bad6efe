"""The reproduction rules (``diagnosis/rules/reproduced.py``) on runs built in memory (no
torch): a failure the replay does not reproduce is the machine, not the numbers; targets that
make the loss non-finite in fp32 too are bad input."""



import pytest
from synthetic import Synth

from ampdoctor.diagnosis import fixes
from ampdoctor.diagnosis.engine import diagnose


def verdict(s: Synth):
    return diagnose(s.run())


def fix_ids(d):
    return [fx.id for fx in d.fixes]


# the numbers or the machine (issue 20), targets that are NaN in fp32 too (issue 23)

UNREPRODUCED = {"reproduced": False, "loss_recomputed": True,
                "recorded": {"loss_nonfinite": True, "output_nonfinite": True},
                "rerun": {"finite": True, "loss": 1.25, "loss_finite": True,
                          "loss_fns": ["cross_entropy"], "grads": "finite"}}


def test_a_failure_the_replay_does_not_reproduce_is_the_machine():
    s = Synth(60)
    for step in (12, 30, 48):
        s.skip([step], loss_nan=True)
        s.snapshot(step, "none", **UNREPRODUCED)
    d = verdict(s)
    assert d.verdict == "not_reproducible" and d.first_bad["step"] == 12
    assert fix_ids(d) == ["test_device", "rerun_elsewhere", "deterministic_algorithms"]
    texts = " | ".join(e.text for e in d.evidence)
    assert "3 of the 3 replayed non-finite steps did not reproduce (steps 12, 30, 48)" in texts
    assert "the loss recomputed by cross_entropy is 1.25" in texts
    assert "batch held" not in texts + d.summary  # no batch is blamed: the replay found it finite


def _compiled(aot_eager: bool, inductor: bool) -> dict:
    rungs = [{"backend": "aot_eager", "finite": aot_eager, "outcome": {"loss": 1.25}},
             {"backend": "decomposed", "finite": aot_eager, "outcome": {"first": "forward"}},
             {"backend": "inductor", "finite": inductor, "outcome": {"first": "forward"}}]
    failed = [r["backend"] for r in rungs if not r["finite"]]
    out = {"regions": ["Net"], "reproduced": bool(failed), "rungs": rungs}
    if failed:
        out.update(backend=failed[0], region="Net",
                   op={"graph": "forward", "op": "aten.cosh", "module": "act",
                       "decomposed_from": "fxops.logcosh"})
    return out


def test_a_failure_only_the_compiled_model_makes_is_the_compiler_never_the_machine():
    s = Synth(60, dtype="bfloat16", scaler=False)
    s.skip([12], loss_nan=True)
    trials = {"compiler_disable": {"tried": True, "finite": True, "loss": 1.25, "step": 12}}
    s.snapshot(12, "none", **UNREPRODUCED, compiled=_compiled(True, False), trials=trials)
    d = verdict(s)
    assert d.verdict == "compiler" and d.first_bad["module"] == "Net", str(d)
    assert "not_reproducible" not in {c["verdict"] for c in d.causes}
    assert fix_ids(d)[0] == "compiler_disable" and d.fixes[0].tried
    assert "act.forward = torch.compiler.disable" in d.fixes[0].snippet
    assert {"compile_backend", "report_compiler_bug"} <= set(fix_ids(d))
    texts = " | ".join(e.text for e in d.evidence)
    assert "aten.cosh, decomposed from fxops.logcosh, in act" in texts
    assert "with inductor (the default backend): non-finite in the forward" in texts
    assert "eager PyTorch computes this step finite" in texts


def test_a_compiled_step_finite_compiled_again_too_stays_not_reproducible():
    s = Synth(60)
    for step in (12, 30):
        s.skip([step], loss_nan=True)
        s.snapshot(step, "none", **UNREPRODUCED, compiled=_compiled(True, True))
    d = verdict(s)
    assert d.verdict == "not_reproducible", str(d)
    assert any(e.key == "compiled_finite" and "not the compiler" in e.text for e in d.evidence)


@pytest.mark.parametrize("hooks", [0, 2])
def test_a_replay_run_without_the_users_hooks_says_so_where_it_found_nothing(hooks):
    """The replay sets the user's hooks aside (record/forensic/isolated.py): where it did not
    repeat the failure, a hook that changes values may be why, and the notes say so."""
    s = Synth(60)
    isolation = {"hooks_set_aside": hooks, "hooks_not_installed": 0, "output_held_back": 0}
    for step in (12, 30, 48):
        s.skip([step], loss_nan=True)
        s.snapshot(step, "none", **UNREPRODUCED, isolation=isolation)
    d = verdict(s)
    said = [n for n in d.notes if "ran without the user's" in n]
    assert len(said) == (1 if hooks else 0)
    if hooks:
        assert "step 12 ran without the user's 2 hooks" in said[0]


def test_a_replay_refused_for_a_write_outside_the_run_says_so():
    s = Synth(60)
    s.skip([12], loss_nan=True)
    s.snapshot(12, "unknown", replay_error="SideEffect: the model's code tried to open "
               "'model.log' for writing while ampdoctor replayed its step; a replay never "
               "changes anything outside the run, so this step was not replayed")
    d = verdict(s)
    said = [n for n in d.notes if n.startswith("Step 12 was not replayed")]
    assert said and "'model.log' for writing" in said[0] and "Move that write" in said[0]


def test_the_machine_fixes_name_the_recorded_command_and_the_device_kind():
    ctx = fixes.Context(device="cuda", rank=3, step=12, argv=["pretrain.py", "--lr", "3e-4"],
                        world_size=8)
    device, rerun = fixes.make(["test_device", "rerun_elsewhere"], ctx)
    assert "nvidia-smi" in device.snippet and "rank 3" in device.snippet
    assert '"python", "pretrain.py", "--lr", "3e-4"]' in rerun.snippet
    assert "CUDA_VISIBLE_DEVICES" in rerun.snippet and "one rank of 8" in rerun.snippet
    cpu = fixes.make(["rerun_elsewhere"], fixes.Context(device="cpu", argv=["t.py"]))[0]
    assert "CUDA_VISIBLE_DEVICES" not in cpu.snippet and "another host" in cpu.snippet
    assert "one rank of" not in cpu.snippet


def test_one_unreproduced_skip_in_a_healthy_run_is_a_note_not_a_verdict():
    s = Synth(60)
    s.skip([20], loss_nan=True)
    s.snapshot(20, "none", **UNREPRODUCED)
    d = verdict(s)
    assert d.verdict == "healthy", str(d)
    assert any("did not reproduce" in n and "test_device" in n for n in d.notes)
    assert not any("more often than probing explains" in n for n in d.notes)


def test_unreproduced_without_a_scaler_explains_the_poisoned_steps_after_it():
    s = Synth(40, dtype="bfloat16", scaler=False)
    s.nan_loss(range(10, 40))
    s.nan_grad(range(10, 40))
    s.snapshot(10, "none", **UNREPRODUCED)
    s.snapshot(11, "forward", "body.0", "Linear", fp32_finite=0, weights_nonfinite=["weight"])
    d = verdict(s)
    assert d.verdict == "not_reproducible" and d.first_bad["step"] == 10
    assert not [c for c in d.causes if c["role"] == "also"], str(d)
    poisoned = next(e for e in d.evidence if e.key == "weights_poisoned")
    assert "30 non-finite steps followed" not in poisoned.text  # 29 after step 10
    assert "29 non-finite steps followed (the replays of steps 11 find" in poisoned.text


@pytest.mark.parametrize("phase,detail", [
    ("none", {}),  # a file written before the comparison: every micro-batch stayed finite
    ("none", UNREPRODUCED),
])
def test_nonfinite_is_never_the_verdict_where_the_replay_was_finite(phase, detail):
    for bad in ([20], [20, 21, 40]):
        s = Synth(60, dtype="bfloat16", scaler=False)
        s.nan_loss(bad)
        for step in bad:
            s.snapshot(step, phase, **detail)
        d = verdict(s)
        assert d.verdict == "not_reproducible", str(d)


def test_a_replayed_loss_with_a_hand_written_formula_claims_no_batch():
    """In fp32 (no low precision to blame): in fp16 or bf16 the same replay is fp16_loss
    (test_located's hand-written losses)."""
    s = Synth(40, dtype=None, scaler=False)
    s.nan_loss([15])
    s.snapshot(15, "loss", loss_nonfinite=True, loss_recomputed=False,
               loss_not_recomputed="no torch loss function was called after the model",
               recorded={"loss_nonfinite": True, "output_nonfinite": False})
    d = verdict(s)
    assert d.verdict == "nonfinite"
    text = next(e.text for e in d.evidence if e.key == "replay_loss_phase")
    assert "finite (in the real step too)" in text and "not recomputed" in text
    assert "had one" not in d.fixes[0].snippet and "As a guard" in d.fixes[0].text


def test_targets_all_ignore_index_are_bad_input_not_precision():
    s = Synth(40)
    s.nan_loss([25])
    target = {"fn": "cross_entropy", "numel": 64, "ignore_index": -100, "ignored": 64,
              "all_ignored": True, "reduction": "mean",
              "problem": "every one of the 64 targets is ignore_index (-100): the mean over "
                         "no targets is 0/0 = NaN"}
    s.snapshot(25, "loss", fp32_finite=0, reproduced=True, loss_nonfinite=True,
               loss_fp32={"loss_finite": False, "loss": "nan", "grads": "zero"},
               targets=[target])
    d = verdict(s)
    assert (d.verdict, d.causes[0]["kind"]) == ("bad_input", "targets")
    assert d.first_bad == {"step": 25, "module": None, "phase": "loss"}
    assert "in fp32 as well" in d.summary and "every gradient exactly zero" in d.summary
    fix = d.fixes[0]
    assert fix.id == "check_data" and "(y != -100).sum() == 0" in fix.snippet
    assert "AMP is not the cause" in fix.text


def test_check_data_names_the_step_its_check_measured():
    s = Synth(64)
    s.skip(range(15, 18), loss_nan=True)
    s.snapshot(17, "input", "Regressor", "Regressor",
               bad_inputs=[{"label": "args.0", "nan": 3}])
    d = verdict(s)
    assert d.verdict == "bad_input" and d.first_bad["step"] == 15  # the run of bad steps
    snippet = d.fixes[0].snippet
    assert "step 17's batch held NaN/inf (args.0)" in snippet and "step 15" not in snippet
    assert "GradScaler skipped those steps" in d.summary
    s = Synth(64, dtype="bfloat16", scaler=False)
    s.nan_loss([15])
    s.snapshot(15, "input", "Regressor", "Regressor")
    assert "No GradScaler skipped those steps" in verdict(s).summary


def test_merged_ranks_count_the_unreproduced_steps_of_each_rank():
    from ampdoctor.diagnosis import ranks

    runs = []
    for rank in (0, 1):
        s = Synth(40)
        s.skip([7, 21], loss_nan=rank == 1)
        detail = UNREPRODUCED if rank == 1 else dict(UNREPRODUCED, recorded={
            "loss_nonfinite": False, "output_nonfinite": False})
        for step in (7, 21):
            s.snapshot(step, "none", **detail)
        run = s.run()
        run.attrs.update(rank=rank, world_size=2)
        runs.append(run)
    d = ranks.merge([(ranks.outline(r), diagnose(r), ranks.scales(r)) for r in runs])
    assert d.verdict == "not_reproducible" and d.first_bad["rank"] == 1
    count = next(e for e in d.evidence if e.key == "unreproduced_by_rank")
    assert count.text == ("rank 1: 2 of the run's 2 non-finite steps began there and did not "
                          "reproduce when replayed (steps 7, 21); rank 0: 0")
    assert "rank 1" in d.summary and "rank 1" in d.fixes[0].text
