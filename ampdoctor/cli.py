"""The ``ampdoctor`` command: each command validates, makes one library call, renders.

Exit codes: 0 success (whatever the verdict); 1 ``diagnose --fail-on`` or ``compare
--fail-on`` matched; 2 the input could not be used (missing, unreadable or damaged run file, a
run with no step to diagnose, bad option, output not writable).
``record`` exits with the training command's own exit code (and dies by the same signal when
the command was killed by one).
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import click

from . import safe
from .errors import AmpDoctorError, EmptyRunError
from .record.apply import prescription  # torch-free: the --apply forms

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

# The README's command table, a row per command (``python docs/doctables.py`` writes it from
# here, and stops on a command without its row): how it is called, what it does, where the docs
# say more. The last row is the testing API's.
COMMAND_TABLE = (
    ("`ampdoctor record -o run.h5 -- CMD`",
     "records any training command (torchrun, accelerate, Lightning included), no code change; "
     "`--apply FIX` treats it with a fix, still no code change; `--fp8-trial SECONDS` bounds the "
     "[fp8 trial](docs/fp8.md#which-layers-to-keep-the-fp8-trial) at close",
     "[commands](docs/commands.md#ampdoctor-record-any-training-script-no-code-change), "
     "[stacks](docs/stacks.md)"),
    ("`ampdoctor diagnose run.h5`",
     "verdict, evidence and fixes; text, JSON or Markdown",
     "[commands](docs/commands.md#ampdoctor-diagnose-what-went-wrong), "
     "[verdicts](docs/verdicts.md)"),
    ("`ampdoctor report run.h5`",
     "one self-contained HTML page of release material (Markdown, JSON)",
     "[reports](docs/reports.md#ampdoctor-report-one-self-contained-html-file)"),
    ("`ampdoctor compare fp32.h5 amp.h5`",
     "fp32 parity of a mixed-precision run: `match`, `drift` or `diverged`; a run against its "
     "fix: `fixed`, `not_trained`, `still_failing`, `worse`",
     "[reports](docs/reports.md#ampdoctor-compare-fp32-parity)"),
    ("`ampdoctor parity check.py:make`",
     "before a run: which modules lose precision in bf16 or fp16",
     "[before a long run](docs/before-a-long-run.md#ampdoctor-parity-which-layers-lose-precision)"),
    ("`ampdoctor top run.h5`",
     "watches a run while it trains (a line per Linear at risk in fp8, while some are); the "
     "diagnosis when it ends",
     "[commands](docs/commands.md#ampdoctor-top-watch-a-run-while-it-trains)"),
    ("`ampdoctor export run.h5 --tensorboard DIR`",
     "the recorded curves as TensorBoard events, beside yours",
     "[commands](docs/commands.md#ampdoctor-export---tensorboard-the-curves-beside-yours)"),
    ("`ampdoctor dump run.h5`",
     "what a run file holds, table by table",
     "[commands](docs/commands.md#ampdoctor-dump-what-a-run-file-holds)"),
    ("`ampdoctor index run.h5`",
     "node summaries for a job's rank files that have none (a node that died first, an older "
     "ampdoctor), so `diagnose` reads thousands of ranks in seconds",
     "[commands](docs/commands.md#ampdoctor-index-node-summaries-for-a-fast-diagnose)"),
    ("`check_amp_step`, `amp_contract`",
     "in your tests: the training step keeps GradScaler's contract; each broken rule names its "
     "fix (`clip_order`'s, `add_grad_scaler`, `loss_in_fp32`, and `scheduler_after_real_step` for "
     "an LR scheduler stepped on a skipped step)",
     "[before a long run](docs/before-a-long-run.md#keep-the-amp-contract-in-ci)"),
)


@click.group(context_settings=CONTEXT_SETTINGS)
@click.version_option(package_name="ampdoctor", prog_name="ampdoctor")
def cli() -> None:
    """Debugger for numeric failures in PyTorch mixed-precision (fp16/bf16) training.

    \b
        ampdoctor record -o run.h5 -- python train.py
        ampdoctor diagnose run.h5
        ampdoctor report run.h5 --baseline fp32.h5 -o report.html
        ampdoctor compare fp32.h5 run.h5
        ampdoctor parity check.py:make --dtype float16
    """


@cli.command(context_settings={"ignore_unknown_options": True,
                                "allow_interspersed_args": False})
@click.option("-o", "--output", default="run.h5", show_default=True, envvar="AMPDOCTOR_OUTPUT",
              show_envvar=True, help="Run file to write; under torchrun each rank writes "
                                     "RUN.rank{R}.h5 beside it.")
@click.option("--every", type=click.IntRange(min=0), default=None, envvar="AMPDOCTOR_EVERY",
              show_envvar=True, metavar="N",
              help="Per-layer statistics every N steps (0: never).  [default: 100]")
@click.option("--fp8-trial", type=click.FloatRange(min=0, max=86400), default=None,
              envvar="AMPDOCTOR_FP8_TRIAL", show_envvar=True, metavar="SECONDS",
              help="Budget of the fp8 trial at close: the last sampled step re-run with each "
                   "Linear in emulated fp8, to say which to keep in bf16 (0: off).  "
                   "[default: 30]")
@click.option("--force", is_flag=True, envvar="AMPDOCTOR_FORCE", show_envvar=True,
              help="Replace an existing run file (and its rank files).")
@click.option("-q", "--quiet", is_flag=True, envvar="AMPDOCTOR_QUIET", show_envvar=True,
              help="Print nothing (no start line, no summary).")
@click.option("--apply", "apply", multiple=True, metavar="FIX[=VALUE]",
              help=prescription.help_text())
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def record(output: str, every: Optional[int], fp8_trial: Optional[float], force: bool,
           quiet: bool, apply: tuple[str, ...], command: tuple[str, ...]) -> None:
    """Run a training command and record it, with no change to its code.

    Everything after -- is the command, passed through untouched. Its exit code is this
    command's exit code; SIGINT and SIGTERM are forwarded to it. With --apply, the command
    runs treated with that fix (the `--apply` that `diagnose` prints with each fix).

    \b
        ampdoctor record -o run.h5 -- python train.py --lr 3e-4
        ampdoctor record -o run.h5 -- python -m mypkg.train
        ampdoctor record -o run.h5 -- torchrun --standalone --nproc_per_node=2 train.py
        ampdoctor record --apply lr_factor=0.1 -o fixed.h5 -- python train.py --lr 3e-4
        ampdoctor record --fp8-trial 120 -o bf16.h5 -- python train.py
    """
    from .record.command import launch

    code = launch.record(list(command), output, every=every, force=force, quiet=quiet,
                         apply=apply, fp8_trial=fp8_trial)
    sys.exit(launch.exit_like(code))


@cli.command()
@click.argument("run", type=click.Path(dir_okay=True))
@click.option("--format", "fmt", type=click.Choice(["text", "json", "markdown"]),
              default="text", show_default=True, help="Output format.")
@click.option("--fail-on", type=click.Choice(["unhealthy", "never"]), default="never",
              show_default=True, help="Exit 1 when the verdict is not healthy (for CI).")
@click.option("--rank", type=click.IntRange(min=0), default=None, metavar="R",
              help="Of a torchrun job's rank files, diagnose rank R's alone.")
@click.option("--baseline", type=click.Path(dir_okay=False), default=None, metavar="BASE",
              help="The same training in bf16 (or fp32): a run in fp8 is measured against it "
                   "(fp8_drift).")
def diagnose(run: str, fmt: str, fail_on: str, rank: Optional[int],
             baseline: Optional[str]) -> None:
    """Say what went wrong in a recorded run, where, and what to change.

    The rank files of a torchrun job (run.rank{R}.h5) are diagnosed together: which rank went
    non-finite first, and how often, and the ranks whose loss scale or skips disagree.

    \b
        ampdoctor diagnose run.h5
        ampdoctor diagnose run.h5 --format json
        ampdoctor diagnose run.h5 --rank 3       # one rank's own diagnosis
        ampdoctor diagnose fp8.h5 --baseline bf16.h5
    """
    from .diagnosis import engine
    from .render.diagnosis import render

    d = engine.diagnose(run, rank=rank, baseline=baseline)
    click.echo(render(d, fmt), nl=False)
    if d.verdict in engine.EMPTY:  # nothing to diagnose: unusable input, exit 2
        reason = d.summary.rstrip(".")
        raise EmptyRunError(f"{run} holds no optimizer step to diagnose "
                            f"({reason[:1].lower() + reason[1:]})")
    if fail_on == "unhealthy" and not d.healthy:
        sys.exit(1)


@cli.command()
@click.argument("run", type=click.Path(dir_okay=True))
def dump(run: str) -> None:
    """Show what a run file holds: attributes, configuration, tables and row counts.

    A file whose values break the format's contract (a step number that goes back, a tensor
    id naming no tensor) is still shown as it is; then one sentence says what breaks it, and
    the exit status is 2.

    RUN may name the rank files of a torchrun recording (run.h5 for run.rank{R}.h5):
    each of them is shown.

    \b
        ampdoctor dump run.h5
    """
    from .render.diagnosis import render_dump
    from .runfile import paths, store

    for path in paths.resolve(run):
        click.echo(render_dump(store.inspect(path)), nl=False)
        store.validate(path)  # shown as it is; a value outside the contract is then said, exit 2


@cli.command()
@click.argument("run", type=click.Path(dir_okay=True))
def index(run: str) -> None:
    """Write node summaries for a job's rank files that have none, so diagnose reads them fast.

    Each node's `ampdoctor record` writes one node summary (run.node{R}.json: its ranks'
    summaries) as its ranks flush and at exit. A node that stopped first, or files recorded by
    an older ampdoctor, leave none: then `diagnose` reads every rank file's own summary, a few
    milliseconds each. This writes them, 8 ranks a file. Running it again writes nothing new.

    \b
        ampdoctor index run.h5          # run.rank{R}.h5 beside it
    """
    from .render.nodes import render_indexed
    from .runfile import nodes

    click.echo(render_indexed(nodes.index(run)))


@cli.command()
@click.argument("run", type=click.Path(dir_okay=True))
@click.option("--baseline", type=click.Path(dir_okay=True), default=None,
              help="An fp32 (or bf16) run of the same training: adds the fp32 parity section.")
@click.option("-o", "--output", default=None, metavar="FILE",
              help="Where to write ('-': stdout).  [default: report.html; stdout for "
                   "markdown and json]")
@click.option("--format", "fmt", type=click.Choice(["html", "markdown", "json"]),
              default="html", show_default=True, help="Output format.")
@click.option("--plots-dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="With --format markdown: write the figures there as PNG files and link "
                   "them.")
@click.option("--parity", "parity_file", type=click.Path(dir_okay=False), default=None,
              metavar="FILE", help="A layer parity result (`ampdoctor parity ... --format json "
                                   "-o FILE`): adds the layer parity section.")
@click.option("--force", is_flag=True, help="Replace a report (and figures) ampdoctor wrote "
                                            "earlier; never any other file.")
def report(run: str, baseline: Optional[str], output: Optional[str], fmt: str,
           plots_dir: Optional[str], parity_file: Optional[str], force: bool) -> None:
    """Write a release report: one self-contained HTML page (or Markdown for a PR).

    It holds the diagnosis (verdict, evidence, fixes), the loss, loss-scale, grad-norm and LR
    curves, per-layer ranges against fp16's limits, the summary figures (skipped and
    non-finite steps, peak grad norm, loss scale, memory, step time), the precision decision
    for the run's hardware, fp16 readiness, with --baseline, fp32 parity and, with --parity,
    the layer parity of `ampdoctor parity`.

    \b
        ampdoctor report run.h5 -o report.html
        ampdoctor report amp.h5 --baseline fp32.h5 -o report.html
        ampdoctor report amp.h5 --parity parity.json -o report.html
        ampdoctor report amp.h5 --format markdown --plots-dir plots -o report.md
        ampdoctor report run.h5 -o report.html --force    # replace the last report
    """
    from .render.files import write_report

    if plots_dir is not None and fmt != "markdown":
        raise click.UsageError("--plots-dir goes with --format markdown (an HTML report "
                               "embeds its figures)")
    target = output or ("report.html" if fmt == "html" else "-")
    r = write_report(run, target, baseline=baseline, parity=parity_file, fmt=fmt,
                     plots_dir=plots_dir, force=force)
    if target != "-":
        click.echo(f"ampdoctor: wrote {target} ({r.diagnosis.verdict}"
                   + (f"; fp32 parity: {r.comparison.verdict}" if r.comparison else "")
                   + ")", err=True)


@cli.command()
@click.argument("base", type=click.Path(dir_okay=True))
@click.argument("amp", type=click.Path(dir_okay=True))
@click.option("--format", "fmt", type=click.Choice(["text", "json", "markdown"]),
              default="text", show_default=True, help="Output format.")
@click.option("--rtol", type=click.FloatRange(min=0, min_open=True), default=0.02,
              show_default=True, help="Loss difference (relative) within which the runs match.")
@click.option("--diverge", type=click.FloatRange(min=0, min_open=True), default=0.10,
              show_default=True,
              help="Loss difference (relative) that, never back within --rtol, is a "
                   "divergence.")
@click.option("--window", type=click.IntRange(min=1), default=None, metavar="N",
              help="Steps in the trailing mean the verdict reads.  [default: a tenth of the "
                   "steps, 1 to 100]")
@click.option("--fail-on", type=click.Choice(["diverged", "drift", "never"]), default="never",
              show_default=True, help="Exit 1 on this verdict or a worse one (for CI).")
def compare(base: str, amp: str, fmt: str, rtol: float, diverge: float, window: Optional[int],
            fail_on: str) -> None:
    """Compare a baseline (fp32 or bf16) run with a mixed-precision run of the same training.

    Loss curves lined up by step (match, drift or diverged, with the step), per-layer
    statistics on the steps both sampled, layers near fp16's limits in the mixed-precision
    run, and its throughput and memory gain.

    \b
        ampdoctor compare fp32.h5 amp.h5
        ampdoctor compare fp32.h5 amp.h5 --format markdown
        ampdoctor compare fp32.h5 amp.h5 --fail-on diverged     # exit 1 if it diverged
    """
    from .release import comparison
    from .render.release import render_comparison

    c = comparison.compare(base, amp, rtol=rtol, diverge=diverge, window=window)
    click.echo(render_comparison(c, fmt), nl=False)
    if (fail_on == "diverged" and c.verdict == "diverged") or (
            fail_on == "drift" and c.verdict in ("drift", "diverged")):
        sys.exit(1)


@cli.command()
@click.argument("target", metavar="SCRIPT[:FUNCTION]")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16"]), default="bfloat16",
              show_default=True, help="The autocast dtype to compare with fp32.")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "markdown"]),
              default="text", show_default=True, help="Output format (json: for `report "
                                                      "--parity`).")
@click.option("-o", "--output", default="-", show_default=True, metavar="FILE",
              help="Where to write ('-': stdout).")
@click.option("--fail-on", type=click.Choice(["lossy", "overflows", "never"]), default="never",
              show_default=True, help="Exit 1 if a module is this bad or worse (for CI).")
@click.option("--force", is_flag=True, help="Replace a parity result ampdoctor wrote earlier; "
                                            "never any other file.")
def parity(target: str, dtype: str, fmt: str, output: str, fail_on: str, force: bool) -> None:
    """Which modules of a model lose precision in bf16 or fp16: one batch in fp32 and under
    autocast, each module judged alone on its fp32 inputs, ranked worst first.

    SCRIPT is a Python file or module and FUNCTION (default: make) a function in it that
    returns (model, batch) or (model, batch, loss_fn): the model is called as model(batch)
    (model(*batch) for a tuple, model(**batch) for a dict), and loss_fn(output) adds the
    gradients to the comparison.

    \b
        ampdoctor parity check.py:make
        ampdoctor parity check.py:make --dtype float16 --fail-on overflows
        ampdoctor parity check.py:make --format json -o parity.json
    """
    from . import outputs
    from .preflight import parity_result
    from .preflight import target as targets
    from .render import files

    script = target.rsplit(":", 1)[0]
    if output != "-" and os.path.exists(output) and os.path.exists(script) and \
            os.path.samefile(output, script):
        raise AmpDoctorError(f"{output} is the script being checked: write the result to "
                             "another file")
    rules = outputs.Rules(ours=parity_result.is_parity_output, force=force,
                          kind="a parity result ampdoctor wrote")
    files.check_target(output, rules=rules)
    model, batch, loss_fn = targets.load(target)
    from .preflight.layer_parity import parity as run_parity

    r = targets.run_checked(f"{target}'s model", run_parity, model, batch, dtype, loss_fn)
    files.write(output, parity_result.render(r, fmt), rules)
    worst = parity_result.VERDICTS.index(r.verdict)
    if fail_on != "never" and worst <= parity_result.VERDICTS.index(fail_on):
        sys.exit(1)


@cli.command()
@click.argument("run", type=click.Path(dir_okay=True))
@click.option("--once", is_flag=True, help="Print one frame as plain text and exit.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              metavar="SECONDS", help="Seconds between refreshes.")
@click.option("--wait", type=click.FloatRange(min=0), default=60.0, show_default=True,
              metavar="SECONDS", help="How long to wait for a run file that does not exist "
                                      "yet.")
@click.option("--stale", type=click.FloatRange(min=1), default=600.0, show_default=True,
              metavar="SECONDS",
              help="A file written on another host that has not changed for this long is "
                   "taken as abandoned (on this host the writer's process is checked).")
@click.option("--rank", type=click.IntRange(min=0), default=None,
              help="The rank to show (default: the first to go non-finite, else rank 0).")
@click.option("--ascii", "ascii_only", is_flag=True, help="Draw curves with ASCII only.")
def top(run: str, once: bool, interval: float, wait: float, stale: float,
        rank: Optional[int], ascii_only: bool) -> None:
    """Watch a run while it is recorded: a view that refreshes every second.

    Step, steps per second, loss and loss-scale curves, skipped steps beside GradScaler's
    probing allowance, grad norm, LR, the layers closest to fp16's limits, the Linears at risk
    in fp8 (only while some are) and the latest forensic replay; rank files of a torchrun job
    too. It ends by itself when the run does
    (or its writer is gone) and prints the diagnosis. q or Ctrl-C quits.

    \b
        ampdoctor top run.h5
        ampdoctor top run.h5 --once          # one frame, for scripts
    """
    from .diagnosis import engine
    from .live import top as live_top
    from .render.diagnosis import render

    opts = live_top.Options(interval=interval, wait=wait, stale=stale, rank=rank,
                            unicode=False if ascii_only else None)
    outcome = live_top.top(run, once=once, options=opts)
    if outcome.ended == "interrupt":
        sys.exit(130)
    if outcome.ended == "final" and outcome.paths:
        paths = outcome.paths
        d = engine.diagnose(paths if len(paths) > 1 else paths[0])
        click.echo("")
        click.echo(render(d, "text"), nl=False)


@cli.command()
@click.argument("run", type=click.Path(dir_okay=True))
@click.option("--tensorboard", "logdir", required=True, type=click.Path(file_okay=False),
              metavar="DIR", help="TensorBoard log directory to write into (your run's own, "
                                  "to see ampdoctor's curves beside yours).")
@click.option("--follow", is_flag=True,
              help="Keep writing while the run is recorded, until it ends.")
@click.option("--wait", type=click.FloatRange(min=0), default=60.0, show_default=True,
              metavar="SECONDS", help="With --follow: how long to wait for a run file that "
                                      "does not exist yet.")
@click.option("--force", is_flag=True, help="Replace an earlier export's event files in DIR "
                                            "(ampdoctor's own, ending .ampdoctor); nothing "
                                            "else there.")
def export(run: str, logdir: str, follow: bool, wait: float, force: bool) -> None:
    """Write a run's curves into TensorBoard: loss, loss scale, skips, grad norm, LR per
    group, per-layer abs max and underflow shares, forensic replays and the diagnosis.

    Needs the tensorboard package: pip install 'ampdoctor[tensorboard]'. Rank files of a
    torchrun job become runs rank0, rank1... under DIR. A run of more than 20 000 steps is
    thinned: each curve keeps each bin's smallest and largest value (about 4 000 points a
    curve, so a one-step spike survives) and every skipped or non-finite step; TensorBoard
    draws 1 000 points of a curve by default.

    \b
        ampdoctor export run.h5 --tensorboard runs/exp1
        ampdoctor export run.h5 --tensorboard runs/exp1 --follow     # while it trains
    """
    from .live import tensorboard

    done = tensorboard.export(run, logdir, follow=follow, wait=wait if follow else 0.0,
                              force=force)
    click.echo(f"ampdoctor: wrote {done.scalars} scalars and {done.texts} texts "
               f"({done.steps} steps) into {logdir}; view with: tensorboard --logdir "
               f"{logdir}" + (f" (a long run: each curve keeps each bin's smallest and largest "
                              f"value and every skipped or non-finite step, {done.thinned} "
                              "steps left out)" if done.thinned else ""), err=True)
    if done.interrupted:
        sys.exit(130)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point: maps ampdoctor's errors to one sentence and an exit code."""
    try:
        cli.main(args=argv, prog_name="ampdoctor", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        return 130
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except AmpDoctorError as exc:  # its sentence may quote the file: shown, never obeyed
        click.echo(safe.one_line(f"ampdoctor: {exc}"), err=True)
        return exc.exit_code
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
