"""The fixes ``ampdoctor record --apply FIX[=VALUE]`` can apply to a command with no change to
its code: their names, what value each takes, and the one sentence a bad one gets.

torch-free (``record``'s parent process reads it before the command starts; the children
carry the arguments in ``AMPDOCTOR_APPLY`` and ``treatment.py`` applies them):

=======================================  =====================================================
``fp32_island=NAME[,NAME...]``           the named modules (qualified names, as ``diagnose``
                                         shows them) run with autocast off on fp32 inputs
``use_bf16``                             fp16 autocast becomes bf16; GradScalers are disabled
``adam_eps=EPS``                         every optimizer with an eps (Adam family) uses EPS
``init_scale=S``, ``growth_interval=N``  GradScaler's initial scale, its growth interval
``lr_factor=F``, ``lr=LR``               the LR each optimizer steps with is multiplied by F
                                         (``lr``: F = LR / the LR the optimizer was made with)
``loss_in_fp32``                         torch's loss functions get fp32 inputs, autocast off
``scheduler_per_step``                   an LR scheduler steps at most once per optimizer step
``fp8=[RECIPE][:keep=NAME,...]``         the model's Linears train in fp8 (torchao, emulated
                                         where the device has no fp8 matmul), those named kept
                                         (``keep=from:RUN``: those RUN's fp8 trial kept;
                                         ``fp8=from:RUN``: its recipe too)
=======================================  =====================================================

Example::

    parse_all(["use_bf16", "lr_factor=0.1"])   # [Prescription('use_bf16'), ...('lr_factor', 0.1)]
    parse("adam_eps=abc")    # RecordError: --apply adam_eps=abc: EPS must be a positive number
    parse("init_scale=1e39") # RecordError: ... S must lie between 2^-24 and 2^32 (...)

Each number is checked against the range its ``Form`` declares (what the optimizer and
GradScaler take, and what can help a run), here in the parent: a value outside it would kill,
crash or silently spoil the run after the command started.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Union

from ...errors import RecordError

Value = Union[None, float, int, tuple[str, ...]]


class Form(NamedTuple):
    """One ``--apply`` form: the value's placeholder ("" for none), what it does, and for a
    number the range it must lie in (``low`` to ``high``, both included) with why: a value
    outside it would kill the run, crash GradScaler, overflow or silently train nothing, so it
    is refused in the parent, before the command starts. ``doc`` is its row of the --apply
    table in docs/commands.md, which docs/doctables.py writes."""

    placeholder: str
    does: str
    low: float = 0.0
    high: float = math.inf
    why: str = ""
    doc: str = ""  # what it changes, in full: its row of docs/commands.md's --apply table
    with_row: str = ""  # the form whose row it shares (its doc says both)


# fp32's smallest normal number: GradScaler's scale and the optimizers' state are fp32.
FP32_TINY = 2.0 ** -126


# The one declaration of the --apply forms: parse() accepts these, the CLI's help lists them
# (help_text), treatment.INSTALL is derived from them (one ``_install_<form>`` each, or its
# import fails) and docs/commands.md's --apply table is written from them (docs/doctables.py:
# a row per form, ``doc`` what it changes; a form ``with_row`` another shares that one's row).
FORMS: dict[str, Form] = {
    "fp32_island": Form(
        "NAME[,NAME...]", "the named modules run with autocast off, on fp32 inputs",
        doc="the modules of those qualified names (as `diagnose` names them) run with autocast "
            "off on fp32 inputs: a forward pre-hook and hook on each, installed when the model "
            "is first called, before their own first call; a name not in the model by the "
            "first optimizer step is warned about in the run and noted by `diagnose`, a module "
            "with half weights is left alone"),
    "use_bf16": Form(
        "", "fp16 autocast becomes bf16, and GradScalers are disabled",
        doc="every fp16 autocast (also CUDA's default) runs in bf16, and every GradScaler is "
            "disabled (bf16 has fp32's range: nothing to scale); weights the code made half "
            "stay half"),
    "adam_eps": Form(
        "EPS", "every optimizer with an eps uses EPS", FP32_TINY, 1.0,
        "an eps above 1 drowns every gradient's own scale, below fp32's smallest normal number "
        "it is no eps at all",
        doc="every optimizer with an `eps` (the Adam family, RMSprop, Adagrad) is created with "
            "EPS, in every param group"),
    "init_scale": Form(
        "S", "GradScaler starts at scale S", 2.0 ** -24, 2.0 ** 32,
        "below 2^-24 every fp16 gradient flushes to zero, and the steps are skipped without a "
        "word; above 2^32 every step overflows and is skipped while the scale halves",
        doc="every enabled GradScaler starts at scale S, grows every N clean steps"),
    "growth_interval": Form(
        "N", "GradScaler grows its scale every N clean steps", 1, 2 ** 31 - 1,
        "GradScaler counts clean steps in a 32-bit integer", with_row="init_scale"),
    "lr_factor": Form(
        "F", "each optimizer steps with its LR times F (schedules keep working)", 1e-12, 1e3,
        "a larger factor blows the weights up within steps, a smaller one leaves them as they "
        "were",
        doc="each optimizer step runs with every group's LR times F, put back after the step, "
            "so that schedulers and the script's own `group[\"lr\"] = ...` keep working; "
            "`lr=LR`: F = LR / the LR the optimizer was created with. The run file records the "
            "LR the steps ran with"),
    "lr": Form(
        "LR", "each optimizer steps with its LR times LR / the LR it was created with", 1e-12,
        1e3, "a larger LR blows the weights up within steps, a smaller one leaves them as they "
        "were", with_row="lr_factor"),
    "loss_in_fp32": Form(
        "", "torch's loss functions run in fp32, autocast off",
        doc="torch's loss functions (`torch.nn.functional`'s, which the `nn` loss modules "
            "call) get fp32 inputs with autocast off; a hand-written loss is not reached"),
    "scheduler_per_step": Form(
        "", "an LR scheduler steps at most once per optimizer step",
        doc="an LR scheduler's `step()` runs at most once per optimizer step that ran (the "
            "later calls before the next optimizer step are left out; a step GradScaler "
            "skipped does not count)"),
    "fp8": Form(
        "[RECIPE][:keep=NAME,...]", "the model's Linears train in fp8 (torchao's RECIPE: "
        "tensorwise, rowwise or rowwise_with_gw_hp; tensorwise when left out), those named kept "
        "in high precision (keep=from:RUN.h5: those RUN's fp8 trial kept; fp8=from:RUN.h5: its "
        "recipe too); needs torchao (pip install 'ampdoctor[fp8]')",
        doc="the model's Linears train in fp8: torchao's `convert_to_float8_training` with the "
            "recipe's `Float8LinearConfig` (`tensorwise`, the default, `rowwise` or "
            "`rowwise_with_gw_hp`), applied at the model's first call with grad enabled (a "
            "copy on the meta device or one called under no_grad is not the model); the "
            "Linears named after `keep=` (and everything under a name) and those whose sizes "
            "are not multiples of 16 stay as they are (`keep=from:RUN.h5`: the layers RUN's "
            "[fp8 trial](fp8.md#which-layers-to-keep-the-fp8-trial) kept under that recipe; "
            "`fp8=from:RUN.h5`: its recipe too, read once before the command starts); emulated "
            "(`emulate=True`) where the device has no fp8 matmul, CPU included; off CUDA a "
            "converted Linear runs with autocast off on fp32 inputs (torchao's backward fails "
            "under CPU autocast). Needs torchao: `pip install 'ampdoctor[fp8]'`; without it, "
            "one sentence before the command starts. `/meta` `applied` lists the Linears "
            "converted and kept, and whether emulated. `ampdoctor compare base.h5 fp8.h5` then "
            "gives the fp8 run's parity against its baseline"),
}
# A number as a person types it: ASCII digits, a point, an exponent. float() and int() also
# take "nan", "inf", "1_000" and any Unicode digit ("²", "١٢"), none of which is meant here.
_DECIMAL = re.compile(r"[+]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", re.ASCII)
_WHOLE = re.compile(r"[+]?\d+", re.ASCII)

# Forms that cannot be given together.
EXCLUSIVE = (("lr", "lr_factor"),)


@dataclass(frozen=True)
class Prescription:
    """One ``--apply`` argument, parsed: the fix's name and its value."""

    name: str
    value: Value = None
    given: str = ""  # the value as typed ("4.7e-6"), kept so that /meta shows it unchanged

    @property
    def arg(self) -> str:
        """The argument as ``--apply`` takes it: ``lr_factor=0.1``, ``fp32_island=a,b``."""
        if self.value is None:
            return self.name
        if isinstance(self.value, tuple):
            return f"{self.name}={self.given or ','.join(self.value)}"
        return f"{self.name}={self.given or self.value}"


def usage() -> str:
    """Every form, for messages and help: ``fp32_island=NAME[,NAME...], use_bf16, ...``."""
    return ", ".join(f"{n}={f.placeholder}" if f.placeholder else n for n, f in FORMS.items())


def help_text() -> str:
    """``record --apply``'s help: every form (``usage``)."""
    return ("Run the command with this fix applied, no code change (repeatable): "
            f"{usage()}. diagnose prints each fix's own.")


def parse(text: str) -> Prescription:
    """One ``FIX[=VALUE]``; ``RecordError`` (one sentence) for an unknown fix or a bad value."""
    name, eq, raw = text.strip().partition("=")
    name = name.strip()
    if name not in FORMS:
        raise RecordError(f"--apply {text}: unknown fix {name or '(empty)'!r}; record can apply "
                          f"{usage()}")
    placeholder = FORMS[name].placeholder
    if placeholder.startswith("[") and not eq:  # the value may be left out
        return Prescription(name)
    if not placeholder:
        if eq:
            raise RecordError(f"--apply {text}: {name} takes no value")
        return Prescription(name)
    if not raw.strip():
        raise RecordError(f"--apply {text}: {name} needs a value: --apply {name}={placeholder}")
    value = _value(name, raw.strip(), text, placeholder)
    if isinstance(value, tuple) and name == "fp8" and "from:" in raw:
        # read here, once: the children get the names
        given = f"{value[0]}:keep={','.join(value[1:])}" if len(value) > 1 else value[0]
        return Prescription(name, value, given)
    return Prescription(name, value, raw.strip())


def _value(name: str, raw: str, text: str, placeholder: str) -> Value:
    if name == "fp8":
        return fp8_value(raw, text)
    if name == "fp32_island":
        names = tuple(n.strip() for n in raw.split(","))
        if not all(names):
            raise RecordError(f"--apply {text}: give module names separated by commas, as in "
                              "--apply fp32_island=blocks.0.attn,blocks.1.attn")
        return names
    form = FORMS[name]
    if name == "growth_interval":
        if not _WHOLE.fullmatch(raw):
            raise RecordError(f"--apply {text}: {placeholder} must be a whole number of steps "
                              "in ASCII digits, 1 or more")
        return _in_range(int(raw), form, text)
    number = float(raw) if _DECIMAL.fullmatch(raw) else math.nan
    if not (math.isfinite(number) and number > 0):
        raise RecordError(f"--apply {text}: {placeholder} must be a positive number")
    return _in_range(number, form, text)


def _in_range(number: Union[int, float], form: Form, text: str) -> Union[int, float]:
    """``number`` when ``form`` accepts it, else the sentence that says its range and why."""
    if form.low <= number <= form.high:
        return number
    raise RecordError(f"--apply {text}: {form.placeholder} must lie between {_shown(form.low)} "
                      f"and {_shown(form.high)} ({form.why})")


def _shown(bound: float) -> str:
    """A bound as the messages show it: 2^k (or 2^k - 1) where it is one, else the number."""
    for k, rest in ((math.log2(bound), ""), (math.log2(bound + 1), " - 1")):
        if k.is_integer() and abs(k) >= 16:
            return f"2^{int(k)}{rest}"
    return f"{bound:g}"


# torchao's Float8LinearConfig recipes (``from_recipe_name``) that --apply fp8 can name.
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def fp8_value(raw: str, text: str) -> tuple[str, ...]:
    """``RECIPE``, ``RECIPE:keep=A,B`` or ``keep=A,B``: (recipe, kept names...); with
    ``keep=from:RUN`` the layers RUN's fp8 readiness keeps under that recipe, with
    ``from:RUN`` its trial's recipe too (``measured``)."""
    if raw.startswith("from:"):
        return measured(raw[5:], "", text)
    recipe, _, keep = raw.partition(":") if not raw.startswith("keep=") else ("", "", raw)
    recipe = recipe.strip() or FP8_RECIPES[0]
    if recipe not in FP8_RECIPES:
        raise RecordError(f"--apply {text}: unknown fp8 recipe {recipe!r}; torchao's are "
                          f"{', '.join(FP8_RECIPES)}")
    names: tuple[str, ...] = ()
    if keep.startswith("keep=from:"):
        return measured(keep[10:], recipe, text)
    if keep:
        if not keep.startswith("keep=") or not all(n.strip() for n in keep[5:].split(",")):
            raise RecordError(f"--apply {text}: name the modules to keep in high precision as "
                              "in --apply fp8=tensorwise:keep=lm_head,blocks.0.mlp.fc1")
        names = tuple(n.strip() for n in keep[5:].split(","))
    return (recipe, *names)


def measured(path: str, recipe: str, text: str) -> tuple[str, ...]:
    """(recipe, kept names...) from an earlier run's fp8 trial (its ``Event.FP8_TRIAL`` row,
    ``record/forensic/fp8trial.py``): the layers it kept under ``recipe``; ``recipe`` "": the
    one it found to suit the model where record can train it (tensorwise or rowwise), else
    tensorwise. rowwise_with_gw_hp takes rowwise's."""
    from ...errors import AmpDoctorError
    from ...runfile.payloads import Fp8Trial
    from ...runfile.schema import Event
    from ...runfile.store import opened

    if not path.strip():
        raise RecordError(f"--apply {text}: name the run to read, as in "
                          "--apply fp8=tensorwise:keep=from:bf16.h5")
    try:
        with opened(path.strip(), "--apply fp8") as run:
            rows = run.events[run.events["kind"] == int(Event.FP8_TRIAL)]
            trial = Fp8Trial.from_text(rows["text"][-1]) if len(rows) else Fp8Trial()
    except AmpDoctorError as exc:
        raise RecordError(f"--apply {text}: {exc}") from None
    recipes = trial.recipes or {}
    if not recipe:
        recipe = trial.suits if trial.suits in FP8_RECIPES else FP8_RECIPES[0]
    part = recipes.get("rowwise" if recipe == "rowwise_with_gw_hp" else recipe)
    if part is None or part.keep is None:
        why = trial.note or trial.error or "it was recorded without one"
        raise RecordError(f"--apply {text}: {path.strip()} holds no fp8 trial of {recipe} "
                          f"({why}): name the layers to keep, as in "
                          f"--apply fp8={recipe}:keep=lm_head")
    return (recipe, *part.keep)


def parse_all(texts: Sequence[str]) -> list[Prescription]:
    """Every ``--apply`` argument, checked together: each once, and no two that exclude each
    other (``lr`` and ``lr_factor``)."""
    out = [parse(t) for t in texts]
    names = [p.name for p in out]
    for name in names:
        if names.count(name) > 1:
            raise RecordError(f"--apply {name} is given {names.count(name)} times: give it once")
    for a, b in EXCLUSIVE:
        if a in names and b in names:
            raise RecordError(f"--apply {a} and --apply {b} both set the learning rate: give one")
    if "fp8" in names and importlib.util.find_spec("torchao") is None:
        raise RecordError("--apply fp8 converts the model with torchao, which is not installed "
                          "here: pip install 'ampdoctor[fp8]'")
    return out


def to_env(prescriptions: Sequence[Prescription]) -> str:
    """What ``AMPDOCTOR_APPLY`` carries to the children: the arguments, as JSON."""
    return json.dumps([p.arg for p in prescriptions])


def from_env(text: Optional[str]) -> list[Prescription]:
    """The prescriptions ``AMPDOCTOR_APPLY`` carries (none when it is unset); ``RecordError``
    when it cannot be read."""
    if not text:
        return []
    try:
        args = json.loads(text)
    except ValueError:
        raise RecordError(f"AMPDOCTOR_APPLY is not a JSON list of --apply arguments: "
                          f"{text[:80]}") from None
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise RecordError("AMPDOCTOR_APPLY is not a JSON list of --apply arguments")
    return parse_all(args)
