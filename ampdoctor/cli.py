"""The ``ampdoctor`` command: each command validates, makes one library call, renders.

Exit codes: 0 success (whatever the verdict); 1 ``diagnose --fail-on`` matched; 2 the input
could not be used (missing, unreadable or damaged run file, a run with no step to diagnose, bad
option, output not writable).
``record`` exits with the training command's own exit code (and dies by the same signal when
the command was killed by one).
"""

from __future__ import annotations

import sys
from typing import Optional

import click

from .errors import AmpDoctorError, EmptyRunError

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(context_settings=CONTEXT_SETTINGS)
@click.version_option(package_name="ampdoctor", prog_name="ampdoctor")
def cli() -> None:
    """Debugger for numeric failures in PyTorch mixed-precision (fp16/bf16) training.

    \b
        ampdoctor record -o run.h5 -- python train.py
        ampdoctor diagnose run.h5
    """


@cli.command(context_settings={"ignore_unknown_options": True,
                                "allow_interspersed_args": False})
@click.option("-o", "--output", default="run.h5", show_default=True, envvar="AMPDOCTOR_OUTPUT",
              show_envvar=True, help="Run file to write; under torchrun each rank writes "
                                     "RUN.rank{R}.h5 beside it.")
@click.option("--every", type=click.IntRange(min=0), default=None, envvar="AMPDOCTOR_EVERY",
              show_envvar=True, metavar="N",
              help="Per-layer statistics every N steps (0: never).  [default: 100]")
@click.option("--force", is_flag=True, envvar="AMPDOCTOR_FORCE", show_envvar=True,
              help="Replace an existing run file (and its rank files).")
@click.option("-q", "--quiet", is_flag=True, envvar="AMPDOCTOR_QUIET", show_envvar=True,
              help="Print nothing (no start line, no summary).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def record(output: str, every: Optional[int], force: bool, quiet: bool,
           command: tuple[str, ...]) -> None:
    """Run a training command and record it, with no change to its code.

    Everything after -- is the command, passed through untouched. Its exit code is this
    command's exit code; SIGINT and SIGTERM are forwarded to it.

    \b
        ampdoctor record -o run.h5 -- python train.py --lr 3e-4
        ampdoctor record -o run.h5 -- python -m mypkg.train
        ampdoctor record -o run.h5 -- torchrun --standalone --nproc_per_node=2 train.py
    """
    from . import launch

    code = launch.record(list(command), output, every=every, force=force, quiet=quiet)
    sys.exit(launch.exit_like(code))


@cli.command()
@click.argument("run", type=click.Path(dir_okay=True))
@click.option("--format", "fmt", type=click.Choice(["text", "json", "markdown"]),
              default="text", show_default=True, help="Output format.")
@click.option("--fail-on", type=click.Choice(["unhealthy", "never"]), default="never",
              show_default=True, help="Exit 1 when the verdict is not healthy (for CI).")
def diagnose(run: str, fmt: str, fail_on: str) -> None:
    """Say what went wrong in a recorded run, where, and what to change.

    \b
        ampdoctor diagnose run.h5
        ampdoctor diagnose run.h5 --format json
    """
    from . import analyze, report

    d = analyze.diagnose(run)
    click.echo(report.render(d, fmt), nl=False)
    if d.verdict == "no_training":  # nothing to diagnose: unusable input, exit 2
        reason = d.summary.rstrip(".")
        raise EmptyRunError(f"{run} holds no optimizer step to diagnose "
                            f"({reason[:1].lower() + reason[1:]})")
    if fail_on == "unhealthy" and not d.healthy:
        sys.exit(1)


@cli.command()
@click.argument("run", type=click.Path(dir_okay=True))
def dump(run: str) -> None:
    """Show what a run file holds: attributes, configuration, tables and row counts.

    RUN may name the rank files of a torchrun recording (run.h5 for run.rank{R}.h5):
    each of them is shown.

    \b
        ampdoctor dump run.h5
    """
    from . import ranks, report, store

    for path in ranks.resolve(run):
        click.echo(report.render_dump(store.inspect(path)), nl=False)


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
    except AmpDoctorError as exc:
        click.echo(f"ampdoctor: {exc}", err=True)
        return exc.exit_code
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
