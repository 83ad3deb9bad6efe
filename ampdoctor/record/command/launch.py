"""``ampdoctor record -- <command>``: the parent side, and the settings both sides share.

How a command records itself without a code change (coverage.py's subprocess pattern, minus
the file it writes into site-packages)::

    ampdoctor record -o run.h5 -- torchrun --nproc_per_node=2 train.py

1. ``record`` checks the output before anything runs: its directory must exist and accept a
   new file, and an existing run (``run.h5`` or ``run.rank{R}.h5``) is replaced only with
   ``--force``. Then it starts the command unchanged, with
   - ``ampdoctor/record/command/_bootstrap`` prepended to ``PYTHONPATH``: its
     ``sitecustomize`` runs in every Python interpreter the command starts, after chaining to
     any ``sitecustomize`` the user already had;
   - the settings in ``AMPDOCTOR_*`` variables, which launchers that re-exec their workers
     (torchrun, accelerate) pass on with the rest of the environment.
2. Inside each of those interpreters nothing happens until torch is imported (a script that
   never imports torch records nothing); then ``ampdoctor.record.command.child`` starts a
   recorder that finds the model, optimizer and scaler itself, and creates its file at the
   first sign of training.
3. ``record`` forwards SIGINT and SIGTERM, waits, prints what was recorded on stderr, and exits
   with the command's own exit code. stdin, stdout and stderr are the command's. A SIGKILL to
   ``record`` stops the command too (``lifeline.py``).

The same settings can come from the environment, for a launcher that runs ``ampdoctor record``
itself: ``AMPDOCTOR_OUTPUT``, ``AMPDOCTOR_EVERY``, ``AMPDOCTOR_FP8_TRIAL``, ``AMPDOCTOR_FORCE``,
``AMPDOCTOR_QUIET``.

``--apply FIX[=VALUE]`` (repeatable) treats the command as well: the fixes, checked here before
anything starts (``record/apply/prescription.py``), travel to the children in
``AMPDOCTOR_APPLY``, where ``record/apply/treatment.py`` applies them from the bootstrap, before
the recorder starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import shlex
import shutil
import signal
import subprocess
import sys
from typing import Callable, Mapping, Optional, Sequence

from ... import outputs, safe
from ...diagnosis import ranks
from ...errors import OutputError, RecordError, RunFileError
from ...runfile import nodes, paths, store
from ..apply import prescription
from . import keeper, lifeline, written
from .settings import (  # noqa: F401 (launch.ENV_*)
    ENV_ACTIVE,
    ENV_APPLY,
    ENV_EVERY,
    ENV_FORCE,
    ENV_FP8_TRIAL,
    ENV_LAUNCHER,
    ENV_OUTPUT,
    ENV_QUIET,
    ENV_SESSION,
    ENV_TOP,
    Settings,
)

# The recorder's default sampled-tier interval, repeated so that the parent never imports torch
# (tests/record/command/test_launch.py checks that the two agree).
DEFAULT_EVERY = 100

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")


# ---------------------------------------------------------------------------------------------
# Before the command starts


def check_output(path: str, force: bool) -> str:
    """The absolute output path, or ``RecordError`` saying in one sentence why it cannot be
    written. Nothing is changed on disk."""
    shown = path
    path = os.path.abspath(os.path.expanduser(path))
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        raise RecordError(f"cannot record into {shown}: it is a directory; give a file name "
                          "such as run.h5")
    if not os.path.exists(folder):
        raise RecordError(f"cannot record into {shown}: directory {folder} does not exist")
    if not os.path.isdir(folder):
        raise RecordError(f"cannot record into {shown}: {folder} is not a directory")
    _name_fits(path, folder, shown)
    rules = outputs.Rules(ours=store.is_run_file, kind="an ampdoctor run file", force=True,
                          prefix=f"cannot record into {shown}: ", fix="choose another file with -o")
    existing = paths.related_files(path)
    try:
        for old in existing:  # what even --force never replaces, said first
            outputs.check(old, rules)
        if existing and not force:
            outputs.check(existing[0], dataclasses.replace(rules, force=False))
        outputs.check_folder(path, rules, shown)
    except OutputError as exc:
        raise RecordError(str(exc)) from None
    return path


def _name_fits(path: str, folder: str, shown: str) -> None:
    """The names derived from the output (``paths.DERIVED_BYTES`` more) fit NAME_MAX."""
    size, limit = len(os.fsencode(os.path.basename(path))), paths.name_max(folder)
    if size + paths.DERIVED_BYTES > limit:
        raise RecordError(f"cannot record into {shown}: its name is {size} bytes long, and the "
                          f"files a recording writes beside it add {paths.DERIVED_BYTES} bytes "
                          f"(run.pid4242.h5, .run.h5.lock), past the {limit} a name may have in "
                          f"{folder}: choose a name of at most {limit - paths.DERIVED_BYTES} bytes")


def check_command(command: Sequence[str], environ: Mapping[str, str]) -> None:
    """``RecordError`` unless ``command[0]`` is a program that can be started."""
    if not command:
        raise RecordError("no command to record: put it after --, as in "
                          "ampdoctor record -o run.h5 -- python train.py")
    if shutil.which(command[0], path=environ.get("PATH")) is None:
        raise RecordError(f"cannot run {command[0]}: no such command"
                          + ("" if os.sep in command[0] else " on PATH"))


def clear_output(path: str) -> None:
    """``--force``: remove the runs a previous recording left under this name, and its node
    summaries (named so that nothing else is: ``run.node{R}.json``)."""
    ours = [p for p in paths.node_files(path) if nodes.is_node_summary(p)]
    for old in paths.related_files(path) + ours:
        try:
            os.unlink(old)
        except OSError as exc:
            raise RecordError(f"cannot replace {old}: {exc.strerror or exc}") from None


def child_env(settings: Settings, environ: Mapping[str, str]) -> dict[str, str]:
    """The command's environment: the user's, the bootstrap first on PYTHONPATH, the settings."""
    env = dict(environ)
    env.pop(ENV_APPLY, None)  # only this recording's --apply
    env.update(settings.to_env())
    env[ENV_TOP] = "1"
    env[ENV_LAUNCHER] = str(os.getpid())
    rest = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = BOOTSTRAP_DIR + (os.pathsep + rest if rest else "")
    return env


# ---------------------------------------------------------------------------------------------
# Running it


def record(command: Sequence[str], output: str = "run.h5", *, every: Optional[int] = None,
           force: bool = False, quiet: bool = False, apply: Sequence[str] = (),
           environ: Optional[Mapping[str, str]] = None, fp8_trial: Optional[float] = None
           ) -> int:
    """Run ``command`` so that it records into ``output``; return its exit code.

    ``apply``: ``--apply`` arguments (``"use_bf16"``, ``"lr_factor=0.1"``): the command runs
    with those fixes applied (``treatment.py``). ``fp8_trial``: ``watch(fp8_trial=)``.

    A command killed by a signal returns the negative signal number (as ``subprocess`` does).
    Raises ``RecordError`` before starting anything when the output, the command or a fix to
    apply cannot be used.

    Example::

        code = launch.record(["python", "train.py", "--lr", "3e-4"], "run.h5", every=50)
        code = launch.record(["python", "train.py"], "fixed.h5", apply=["lr_factor=0.1"])
    """
    environ = os.environ if environ is None else environ
    if every is not None and every < 0:
        raise RecordError(f"--every must be 0 (never) or a positive step count, not {every}")
    fixes = tuple(prescription.parse_all(apply))
    path = check_output(output, force)
    check_command(command, environ)
    with OutputLock(path, output) if not one_node_of_several(command) else \
            contextlib.nullcontext():
        if force:
            clear_output(path)
        settings = Settings(output=path, every=every, quiet=quiet, shown=output, apply=fixes,
                            session=written.create(), fp8_trial=fp8_trial)
        try:
            if not quiet:
                _say(start_line(settings))
            with keeper.Keeper(settings) as node:  # this node's summary, for diagnose
                code = run_command(command, child_env(settings, environ), started=node.start)
            if not quiet:
                _say(summary(settings))
        finally:
            written.remove(settings.session)
    return code


def one_node_of_several(command: Sequence[str]) -> bool:
    """Is ``command`` one node of a job launched on several (torchrun's ``--nnodes`` above 1,
    or a ``--node_rank``)? Each node runs its own ``record`` into the same ``-o`` on a shared
    filesystem, its ranks into their own files: no lock between them."""
    args = list(command)
    for i, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name in ("--nnodes", "--nnodes_per_job") and not value and i + 1 < len(args):
            value = args[i + 1]
        if name in ("--nnodes", "--nnodes_per_job") and value.split(":")[-1] not in ("", "1"):
            return True
        if name in ("--node_rank", "--node-rank", "--machine_rank"):
            return True
    return False


class OutputLock:
    """One ``record`` at a time into an output: an exclusive lock on ``.<name>.lock`` beside
    it, held while the command runs. A second ``record`` into the same ``-o`` refuses before
    it clears or starts anything, so that neither run is lost. The kernel drops the lock
    when its holder dies, so a killed ``record`` leaves nothing that blocks the next.

    Example::

        with OutputLock("/data/run.h5", "run.h5"):
            ...   # RecordError in another process doing the same
    """

    def __init__(self, path: str, shown: str):
        folder, name = os.path.split(path)
        self.lock = os.path.join(folder, f".{name}.lock")
        self.shown = shown
        self.fd: Optional[int] = None

    def __enter__(self) -> "OutputLock":
        while self.fd is None:
            try:  # never through a link planted at the lock's name, never into a device
                fd = outputs.open_own(self.lock, os.path.basename(self.lock),
                                      prefix=f"cannot record into {self.shown}: its lock ")
            except OutputError as exc:
                raise RecordError(str(exc)) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
                os.close(fd)
                raise RecordError(
                    f"cannot record into {self.shown}: another ampdoctor record is recording "
                    f"into it{f' (pid {holder})' if holder.isdigit() else ''}; wait for it to "
                    "end, or choose another file with -o") from None
            if _same_file(fd, self.lock):  # not one its last holder removed meanwhile
                os.ftruncate(fd, 0)
                os.pwrite(fd, str(os.getpid()).encode(), 0)
                self.fd = fd
            else:
                os.close(fd)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            try:
                os.unlink(self.lock)  # while still held: a waiting opener sees a new file
            except OSError:
                pass
            os.close(self.fd)
            self.fd = None


def _same_file(fd: int, path: str) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def run_command(command: Sequence[str], env: Mapping[str, str],
                started: Optional[Callable[[], None]] = None) -> int:
    """Start ``command``, forward SIGINT/SIGTERM to it while it runs, return its exit code.
    The command dies with ``record`` (``lifeline.py``): a SIGKILL here leaves no training
    running unattended. ``started`` is called once the command runs (the keeper's thread)."""
    try:
        # record has no thread of its own here: preexec_fn is safe (its one risk is a lock
        # another thread held at fork), so the keeper's thread starts after it (`started`)
        proc = subprocess.Popen(list(command), env=dict(env),
                                preexec_fn=lifeline.preexec(os.getpid()))
    except OSError as exc:
        raise RecordError(f"cannot run {command[0]}: {exc.strerror or exc}") from None
    if started is not None:
        started()
    with _forwarding(proc):
        return proc.wait()  # resumed after each forwarded signal (PEP 475)


class _forwarding:
    """While the command runs, SIGINT and SIGTERM sent to ``record`` go to the command.

    A Ctrl-C typed in a terminal already reaches every process of the foreground group, the
    command included; forwarding it as well would interrupt the command twice, so SIGINT is
    forwarded only when it cannot have come that way.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.saved: dict[int, object] = {}

    def __enter__(self) -> "_forwarding":
        for sig in self.SIGNALS:
            self.saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)

    def _handle(self, sig: int, frame: object) -> None:
        if sig == signal.SIGINT and _terminal_foreground():
            return
        try:
            self.proc.send_signal(sig)
        except OSError:  # already gone
            pass


def _terminal_foreground() -> bool:
    """Is ``record`` in its terminal's foreground process group (where Ctrl-C goes)?"""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def exit_like(code: int) -> int:
    """Leave the way the command left: killed by a signal, or with its exit code.

    Dying by the same signal (not just exiting 128+N) lets a calling shell or script see that
    the command was interrupted, as it would without ``record`` in between.
    """
    if code >= 0:
        return code
    sig = -code
    try:
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # these cannot be caught anyway
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    except (OSError, ValueError):
        pass
    return 128 + sig


# ---------------------------------------------------------------------------------------------
# What the user sees: one line before, one after (stderr)


def _say(line: str) -> None:
    # One line, shown not obeyed: module names and exception texts in it come from run files.
    print(safe.one_line(line), file=sys.stderr, flush=True)


def start_line(settings: Settings) -> str:
    """Where it records and what it samples: ``ampdoctor: recording into run.h5 (...)``."""
    every = DEFAULT_EVERY if settings.every is None else settings.every
    tiers = "every step: loss, loss scale, grad norm"
    if every == 1:
        tiers += ", per-layer statistics"
    elif every > 1:
        tiers += f"; every {every} steps: per-layer statistics"
    applied = "".join(f" --apply {p.arg}" for p in settings.apply)
    return f"ampdoctor: recording into {settings.shown} ({tiers})" + (
        f", treated with{applied}" if applied else "")


def summary(settings: Settings) -> str:
    """One line: what was recorded, the diagnosis and its first bad step (``diagnose``'s own,
    so that the two never disagree), the command to run next.

    It speaks of the files this ``record``'s own processes wrote (``node_files``): in a
    multi-node job, this node's ranks, read from their summaries and diagnosed together, never
    the files of other nodes (which may still be written); the job's verdict is then
    ``ampdoctor diagnose`` over them all, which the line says.
    """
    files = node_files(settings)
    if not files:
        return ("ampdoctor: nothing recorded: no Python process of the command imported torch "
                "(a process started with python -I, -E or -S, or with PYTHONPATH reset, is not "
                "reached)")
    outlines, unreadable = [], []
    for path in files:
        try:
            outlines.append(_outline(path))
        except RunFileError as exc:
            unreadable.append(str(exc))
    if not outlines:
        return f"ampdoctor: {unreadable[0]}"
    ranks.read_own_flags(outlines, ranks.own_flag_in_file)  # ShardedGradScaler's ranks
    text = _describe(outlines, settings, written.faults(settings.session))
    if unreadable:
        text += f"; {unreadable[0]}"
    return text + f"; next: ampdoctor diagnose {shlex.quote(settings.shown)}"


def node_files(settings: Settings) -> list[str]:
    """The run files this ``record``'s processes wrote, as they noted them (``written``); a
    recording without that list (a recorder the script started itself, or no temporary
    directory) falls back to the files beside the output."""
    noted = [p for p in written.read(settings.session) or [] if os.path.isfile(p)]
    return noted or paths.related_files(settings.output)


def _outline(path: str) -> dict:
    """``ranks.outline`` of one file, from its summary where it has one (a few milliseconds)."""
    from ...diagnosis import job
    from ...runfile.store import load, summary

    s = summary.read(path)
    if s is not None:
        return job.from_summary(s).outline
    with load(path) as run:
        return ranks.outline(run)


def _describe(outlines: list[dict], settings: Settings,
              faults: Optional[dict[str, dict]] = None) -> str:
    # Rank files are told by their names (run.rank{R}.h5 of this output): no directory listing.
    per_rank = [o for o in outlines if o["path"] != settings.output
                and paths.run_name(o["path"]) == settings.output]
    main = per_rank or outlines[:1]
    extra = [o for o in outlines if o not in main]
    world = max(o["world_size"] for o in main)
    node = bool(per_rank) and len({o["rank"] for o in main}) < world
    files = _files(main, settings)
    stopped = next((o for o in main if o.get("stopped")), None)
    # a recording stopped by a write error its file could not hold (a full disk), as noted
    faults = faults or {}
    fault = next((faults[p] for p in (os.path.abspath(o["path"]) for o in main)
                  if p in faults), None)
    if not any(o["steps"] for o in main):
        text = f"ampdoctor: {files}: " + (_stopped(stopped) + ", before any step was kept"
                                          if stopped else
                                          _faulted(fault, " before any step was kept")
                                          if fault else
                                          "no optimizer step (the command never trained)")
    else:
        where = f"{ranks.ranks_text([o['rank'] for o in main])} of {world}" if node else ""
        text = f"ampdoctor: recorded {_steps(main, where)} into {files}, {_skipped(main)}"
        text += f"; {_stopped(stopped)}" if stopped else f"; {_faulted(fault)}" if fault else ""
        received = _received(main) if node else ""
        verdict = received or _verdict([o["path"] for o in main], len(main) > 1)
        if verdict:
            text += f"; this node's ranks: {verdict}" if node else f"; diagnosis: {verdict}"
    text += _ending(main, fault is not None)
    if extra:
        text += "; other training processes wrote " + ", ".join(
            _shown_path(o["path"], settings) for o in extra)
    if node:
        text += (f"; the job's verdict is ampdoctor diagnose {shlex.quote(settings.shown)} "
                 f"over all {world} ranks' files, once every node has finished")
    return text


def _received(outlines: list[dict]) -> str:
    """On one node of a multi-node job: when no rank of this node had a value born there (a
    non-finite loss, a replay that found it in the batch or the forward), what they saw came
    from elsewhere, and a diagnosis of them alone would blame them for it; say so instead."""
    origin = ranks.first_rank(outlines)
    first = next((o for o in outlines if o["rank"] == origin), None)
    if first is None or first["local"] or first.get("own_bad"):
        return ""
    return (f"non-finite gradients from step {first['first_bad']}, none born here (no loss of "
            "theirs went non-finite): received through the gradient all-reduce from another "
            "node, or born in a backward pass")


def _ending(main: list[dict], faulted: bool = False) -> str:
    """How the processes ended, when not by finishing (a file left open by a recording that
    stopped on a write error says nothing of how its process ended)."""
    raised = sorted({o["status"].split(":", 1)[1] for o in main
                     if o["status"].startswith("exception:")})
    stopped = sorted({o["status"].split(":", 1)[1] for o in main
                      if o["status"].startswith("signal:")})
    if raised:
        return f"; the command raised {', '.join(raised)}"
    if stopped:
        return f"; the command was stopped by {', '.join(stopped)}"
    if any(o["status"] == "interrupted" for o in main) and not faulted:
        return "; the recording was cut short (the process was killed)"
    return ""


def _steps(outlines: list[dict], where: str = "") -> str:
    """``30 steps``, ``6 steps each on 2 ranks``, ``6 steps each on ranks 2, 3 of 4``."""
    counts = sorted({o["steps"] for o in outlines})
    if len(outlines) == 1:
        one = f"{counts[0]} step{'s' if counts[0] != 1 else ''}"
        return f"{one} on {where}" if where else one
    each = f"{counts[0]} steps each" if len(counts) == 1 else f"{counts[0]}-{counts[-1]} steps"
    return f"{each} on {where or f'{len(outlines)} ranks'}"


def _skipped(outlines: list[dict]) -> str:
    counts = sorted({o["skipped"] for o in outlines})
    if len(counts) == 1:
        return f"{counts[0]} skipped"
    return f"{counts[0]}-{counts[-1]} skipped (the ranks disagree)"


def _verdict(files: list[str], ranked: bool) -> str:
    """``diagnose``'s verdict and first bad step over ``files``, "lr_overflow, first bad at
    step 4 in blocks.0.attn (backward)", or "" when the run cannot be diagnosed (the line says
    less)."""
    from ...diagnosis.engine import diagnose

    try:
        d = diagnose(files if len(files) > 1 else files[0])
    except Exception:  # noqa: BLE001 - a summary line never fails the command
        return ""
    first = d.first_bad or {}
    if first.get("step") is None:
        return d.verdict
    text = f"{d.verdict}, first bad at step {first['step']}"
    if ranked and first.get("rank") is not None:
        text += f" on rank {first['rank']}"
    place = ranks.where(first)
    return text + (" " + place if place else "")


def _stopped(outline: dict) -> str:
    """"recording stopped at step 3 (before_clip: RuntimeError: ...)"."""
    stop = outline["stopped"]
    why = stop["why"] if len(stop["why"]) <= 160 else stop["why"][:157] + "..."
    return f"recording stopped at step {stop['step']} after an internal error ({why})"


def _faulted(fault: dict, when: str = "") -> str:
    """"recording stopped (could not write run.h5 (No space left on device)); training went
    on without it"."""
    return f"recording stopped{when} ({fault['what']}); training went on without it"


def _files(outlines: list[dict], settings: Settings) -> str:
    if len(outlines) > 1:
        return _rank_pattern(settings, outlines)
    return _shown_path(outlines[0]["path"], settings)


def _shown_path(path: str, settings: Settings) -> str:
    """A file of this recording named as the user named the output (relative stays relative)."""
    folder = os.path.dirname(settings.shown)
    return os.path.join(folder, os.path.basename(path)) if folder else os.path.basename(path)


def _rank_pattern(settings: Settings, outlines: list[dict]) -> str:
    ids = ranks.spans(sorted(o["rank"] for o in outlines)).replace(", ", ",")
    stem, ext = os.path.splitext(settings.shown)
    return f"{stem}.rank{{{ids}}}{ext}"
