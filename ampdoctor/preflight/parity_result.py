"""What ``ampdoctor.parity`` found: per module, how much precision it loses under autocast.

Plain Python (no torch, no numpy needed), so that a result renders anywhere: as text
(``str(result)``), Markdown and HTML (Jupyter shows them), JSON (``to_dict``; ``load`` reads
it back for ``ampdoctor report --parity``). ``layer_parity`` computes it.

Each module is judged alone: fed the fp32 inputs of the reference run (rounded to the dtype
autocast gives them), its own ops run in the low precision, and what it produces (its outputs,
and the tensors it hands to its child modules) is compared with the same computation in fp32.
Verdicts, worst first:

- ``overflows``: a value the fp32 computation holds is beyond the dtype's range (fp16: 65504),
  or the low-precision run produced inf/NaN where fp32 did not;
- ``lossy``: the relative error (rms of the difference over rms of the fp32 values) is above
  ``LOSSY_ROUNDOFFS`` times the dtype's unit roundoff: the module loses several bits beyond
  what storing its result in that dtype costs;
- ``ok``: neither.

Example::

    r = ampdoctor.parity(model, batch, torch.bfloat16)
    r.modules[0].name, r.modules[0].verdict, r.modules[0].sqnr_db
    print(r)                       # the table ``ampdoctor parity`` prints
    json.dump(r.to_dict(), open("parity.json", "w"))
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from .. import outputs, safe
from ..diagnosis import fixes
from ..errors import AmpDoctorError
from ..numfmt import fmt

# Unit roundoff (half the machine epsilon) of each low precision: the relative error of
# storing one fp32 value in it.
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
# The largest finite value of each dtype.
DTYPE_MAX = {"bfloat16": 3.3895313892515355e38, "float16": 65504.0}
# A module is lossy when its relative error exceeds this many unit roundoffs (bf16: 6.25 %,
# SQNR 24 dB; fp16: 0.78 %, 42 dB). Healthy layers measure about one (0.4 to 1.2 on the
# models of tests/preflight/test_layer_parity.py: rounding their inputs, weights and result); 16 is
# four bits lost beyond that.
LOSSY_ROUNDOFFS = 16
VERDICTS = ("overflows", "lossy", "ok")  # worst first
# How each of parity's formats begins: what `parity -o FILE --force` may replace.
_HEADS = (re.compile(rb'\A\{\s*"format": "ampdoctor-parity"'),
          re.compile(rb"\Aparity: (" + "|".join(VERDICTS).encode() + rb")\n  "),
          re.compile(rb"\A## Layer parity in (" + "|".join(UNIT_ROUNDOFF).encode() + rb"): `"))
SHOWN = 10  # modules shown in text and Markdown (all of them are in to_dict)


def lossy_rel_err(dtype: str) -> float:
    """The relative error above which a module is ``lossy`` in ``dtype``."""
    return LOSSY_ROUNDOFFS * UNIT_ROUNDOFF[dtype]


def sqnr_db(rel_err: Optional[float]) -> Optional[float]:
    """Signal-to-quantisation-noise ratio in dB from a relative error (inf when exact)."""
    if rel_err is None or math.isnan(rel_err):
        return None
    return math.inf if rel_err == 0 else -20.0 * math.log10(rel_err)


@dataclass
class ModuleParity:
    """One module's precision under autocast, over all its calls in the batch."""

    name: str  # its path in the model ('' is the model itself)
    type: str  # its class
    calls: int
    numel: int  # elements compared
    rel_err: float  # rms(low - fp32) / rms(fp32) of what it produces
    absmax_fp32: float
    absmax_low: float  # NaN when the low-precision run produced only non-finite values
    nonfinite: int  # elements inf/NaN in low precision and finite in fp32
    grad_rel_err: Optional[float] = None  # the same for its gradients (with a loss_fn)
    grad_absmax: Optional[float] = None
    grad_nonfinite: int = 0
    verdict: str = "ok"
    reason: str = ""

    @property
    def sqnr_db(self) -> Optional[float]:
        return sqnr_db(self.rel_err)

    @property
    def grad_sqnr_db(self) -> Optional[float]:
        return sqnr_db(self.grad_rel_err)

    @property
    def worst_rel_err(self) -> float:
        errs = [e for e in (self.rel_err, self.grad_rel_err) if e is not None]
        return max(errs) if errs else 0.0

    def judge(self, dtype: str) -> None:
        """Set ``verdict`` and ``reason`` from the numbers (see the module docstring)."""
        top, limit = DTYPE_MAX[dtype], lossy_rel_err(dtype)
        if self.nonfinite or self.grad_nonfinite:
            what = "values it produces" if self.nonfinite else "gradient values"
            n = self.nonfinite or self.grad_nonfinite
            self.verdict = "overflows"
            self.reason = f"{n} {what} are inf/NaN in {dtype} and finite in fp32"
        elif self.absmax_fp32 > top or (self.grad_absmax or 0.0) > top:
            self.verdict = "overflows"
            self.reason = f"values up to {fmt(max(self.absmax_fp32, self.grad_absmax or 0))} " \
                          f"in fp32, beyond {dtype}'s {fmt(top)}"
        elif self.worst_rel_err > limit:
            what = "gradient" if (self.grad_rel_err or 0) > self.rel_err else "output"
            self.verdict = "lossy"
            self.reason = f"{what} relative error {_pct(self.worst_rel_err)} " \
                          f"(over {_pct(limit)})"
        else:
            self.verdict, self.reason = "ok", ""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["sqnr_db"], d["grad_sqnr_db"] = self.sqnr_db, self.grad_sqnr_db
        return d


@dataclass
class ParityResult:
    """``ampdoctor.parity``'s answer: ``modules`` ranked worst first, the whole model's output
    error when everything runs in ``dtype``, and the fp32-island fix for the worst module."""

    dtype: str  # 'bfloat16' or 'float16'
    device: str  # 'cpu', 'cuda'
    model: str  # the model's class
    modules: list[ModuleParity] = field(default_factory=list)
    output_rel_err: Optional[float] = None  # the model's output, everything in dtype
    output_nonfinite: int = 0
    loss_fp32: Optional[float] = None
    loss_low: Optional[float] = None
    grad_scale: Optional[float] = None  # the loss scale gradients were compared at (fp16)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for m in self.modules:
            m.judge(self.dtype)
        order = {v: i for i, v in enumerate(VERDICTS)}
        self.modules.sort(key=lambda m: (order[m.verdict], -m.worst_rel_err, m.name))

    @property
    def verdict(self) -> str:
        """The worst module's verdict ('ok' for a model with no module compared)."""
        return self.modules[0].verdict if self.modules else "ok"

    @property
    def counts(self) -> dict[str, int]:
        return {v: sum(m.verdict == v for m in self.modules) for v in VERDICTS}

    @property
    def worst(self) -> Optional[ModuleParity]:
        """The worst module, when it is not ``ok``."""
        return self.modules[0] if self.modules and self.verdict != "ok" else None

    @property
    def fixes(self) -> list[fixes.Fix]:
        """For the worst module: the fp32 island (and, for attention, pre-scaling q)."""
        w = self.worst
        if w is None:
            return []
        ctx = fixes.Context(device=self.device, module=w.name or None, module_type=w.type,
                            root=not w.name, autocast=self.dtype)
        ids = ["fp32_island"] + (["scale_attention"] if fixes.is_attention(w.name, w.type)
                                 else [])
        return fixes.make(ids, ctx)

    @property
    def output_sqnr_db(self) -> Optional[float]:
        return sqnr_db(self.output_rel_err)

    def to_dict(self) -> dict:
        return {"format": "ampdoctor-parity", "version": 1, "dtype": self.dtype,
                "device": self.device, "model": self.model, "verdict": self.verdict,
                "counts": self.counts, "lossy_rel_err": lossy_rel_err(self.dtype),
                "dtype_max": DTYPE_MAX[self.dtype],
                "output": {"rel_err": self.output_rel_err, "sqnr_db": self.output_sqnr_db,
                           "nonfinite": self.output_nonfinite},
                "loss": {"fp32": self.loss_fp32, "low": self.loss_low},
                "grad_scale": self.grad_scale,
                "modules": [m.to_dict() for m in self.modules],
                "fixes": [asdict(f) for f in self.fixes], "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, data: dict) -> "ParityResult":
        names = {f for f in ModuleParity.__dataclass_fields__}
        mods = [ModuleParity(**{k: v for k, v in m.items() if k in names})
                for m in data["modules"]]
        out, loss = data.get("output") or {}, data.get("loss") or {}
        return cls(data["dtype"], data["device"], data["model"], mods,
                   out.get("rel_err"), int(out.get("nonfinite") or 0), loss.get("fp32"),
                   loss.get("low"), data.get("grad_scale"), list(data.get("notes") or []))

    def json(self) -> str:
        return json.dumps(_finite(self.to_dict()), indent=2, allow_nan=False) + "\n"

    def __str__(self) -> str:
        return render_text(self)

    def _repr_markdown_(self) -> str:
        return render_markdown(self)

    def _repr_html_(self) -> str:
        return render_html(self)


def is_parity_output(path: str) -> bool:
    """Is ``path`` a result ``ampdoctor parity -o`` wrote (text, Markdown or JSON), by how it
    begins?"""
    first = outputs.head(path)
    return any(p.match(first) for p in _HEADS)


# A parity result is a few hundred bytes per module: 64 MiB holds any model's, and a file
# past it (or /dev/zero) is refused before it is read whole.
MAX_BYTES = 64 << 20


def load(path: str) -> ParityResult:
    """Read a result written by ``ampdoctor parity ... --format json`` (or ``r.json()``).
    The file is untrusted: a regular file of at most ``MAX_BYTES``, JSON of finite numbers,
    each field of its type; anything else is one sentence (``AmpDoctorError``)."""
    data = _parsed(path, _read(path))
    if not isinstance(data, dict) or data.get("format") != "ampdoctor-parity":
        raise AmpDoctorError(f"{path} is not a parity result: write one with "
                             "`ampdoctor parity SCRIPT:FUNCTION --format json -o FILE`")
    version = data.get("version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise AmpDoctorError(f"{path} is a damaged parity result (its version is "
                             f"{_shown(version)})")
    if version > 1:
        raise AmpDoctorError(f"{path} was written by a newer ampdoctor (parity format "
                             f"{version}); this one reads 1: upgrade ampdoctor")
    problem = _wrong_field(data)
    if problem:
        raise AmpDoctorError(f"{path} is a damaged parity result ({problem})")
    try:
        return ParityResult.from_dict(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise AmpDoctorError(f"{path} is a damaged parity result ({exc})") from None


def _read(path: str) -> bytes:
    """The file's bytes, opened without waiting (a FIFO would wait for a writer forever) and
    read no further than ``MAX_BYTES`` (a device such as /dev/zero never ends)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise AmpDoctorError(f"{path} does not exist") from None
    except OSError as exc:
        raise AmpDoctorError(f"{path} cannot be read ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise AmpDoctorError(f"{path} is not a regular file: a parity result is one")
        if info.st_size > MAX_BYTES:
            raise _too_large(path)
        try:
            data = fh.read(MAX_BYTES + 1)
        except OSError as exc:
            raise AmpDoctorError(f"{path} cannot be read ({exc.strerror})") from None
    if len(data) > MAX_BYTES:  # (it grew while read)
        raise _too_large(path)
    return data


def _too_large(path: str) -> AmpDoctorError:
    return AmpDoctorError(f"{path} is larger than a parity result can be ({MAX_BYTES >> 20} MiB)")


def _parsed(path: str, data: bytes) -> Any:
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constant,
                          parse_float=_finite_float)
    except RecursionError:
        raise AmpDoctorError(f"{path} is not a parity result (JSON nested too deep)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise AmpDoctorError(f"{path} is not a parity result ({exc})") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is no JSON number")  # the writer writes null for inf/NaN


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is out of a float's range")
    return value


_NUMBER = (int, float, type(None))  # a number, or null: what the writer makes of inf/NaN
_COUNT = (int, type(None))
# the JSON types each field of the file may hold: at the top, inside output and loss, and in
# each module
_FIELDS = {"dtype": str, "device": str, "model": str, "modules": list, "output": (dict,
           type(None)), "loss": (dict, type(None)), "grad_scale": _NUMBER,
           "notes": (list, type(None))}
_INNER: dict[str, dict[str, Any]] = {
    "output": {"rel_err": _NUMBER, "nonfinite": _COUNT},
    "loss": {"fp32": _NUMBER, "low": _NUMBER}}
_MODULE = {"name": str, "type": str, "calls": int, "numel": int, "rel_err": _NUMBER,
           "absmax_fp32": _NUMBER, "absmax_low": _NUMBER, "nonfinite": int,
           "grad_rel_err": _NUMBER, "grad_absmax": _NUMBER, "grad_nonfinite": int}
_MODULE_OPTIONAL = ("grad_rel_err", "grad_absmax", "grad_nonfinite")


def _wrong_field(data: dict) -> str:
    """The first field of the wrong type, in words ('' when every one is right)."""
    for key, want in _FIELDS.items():
        if not _is(data.get(key), want):
            return f"{key} holds {_shown(data.get(key))}"
    if data["dtype"] not in DTYPE_MAX:
        return f"dtype {_shown(data['dtype'])} is none of {', '.join(DTYPE_MAX)}"
    for outer, fields in _INNER.items():
        inner = data.get(outer) or {}
        wrong = next((k for k, want in fields.items() if not _is(inner.get(k), want)), None)
        if wrong:
            return f"{outer}.{wrong} holds {_shown(inner[wrong])}"
    if not all(isinstance(n, str) for n in data.get("notes") or []):
        return "notes holds something else than texts"
    return next((f"modules[{i}] {problem}" for i, m in enumerate(data["modules"])
                 for problem in [_wrong_module(m)] if problem), "")


def _wrong_module(m: Any) -> str:
    if not isinstance(m, dict):
        return f"is {_shown(m)}, not an object"
    missing = next((k for k in _MODULE if k not in m and k not in _MODULE_OPTIONAL), None)
    if missing:
        return f"has no {missing}"
    wrong = next((k for k, want in _MODULE.items() if k in m and not _is(m[k], want)), None)
    return f"{wrong} holds {_shown(m[wrong])}" if wrong else ""


def _is(value: Any, want: Any) -> bool:
    """isinstance, where a bool is no number (JSON's true is not 1)."""
    return isinstance(value, want) and not (isinstance(value, bool) and bool not in
                                            (want if isinstance(want, tuple) else (want,)))


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ---------------------------------------------------------------------------------------------
# rendering


def _pct(x: Optional[float]) -> str:
    if x is None or math.isnan(x):
        return "-"
    return f"{x * 100:.3g} %" if x < 10 else f"{x:.3g}x"


def _db(x: Optional[float]) -> str:
    if x is None or math.isnan(x):
        return "-"
    return "exact" if math.isinf(x) else f"{x:.1f} dB"


HEAD = ("module", "type", "verdict", "rel. error", "SQNR", "abs max fp32", "grad rel. error")


def label(m: ModuleParity) -> str:
    """'blocks.0.attn (Attention)'; the model itself is '(GPT)'."""
    return f"{m.name} ({m.type})" if m.name else f"({m.type})"


def rows(r: ParityResult, limit: Optional[int] = SHOWN) -> list[tuple[str, ...]]:
    mods = r.modules if limit is None else r.modules[:limit]
    return [(m.name or f"({m.type})", m.type, m.verdict, _pct(m.rel_err), _db(m.sqnr_db),
             fmt(m.absmax_fp32), _pct(m.grad_rel_err)) for m in mods]


def headline(r: ParityResult) -> str:
    c = r.counts
    if not r.modules:
        return f"{r.model} in {r.dtype}: no module produced a floating-point tensor to compare."
    text = (f"{r.model} in {r.dtype} autocast, one batch, each module judged alone: "
            f"{c['overflows']} overflow, {c['lossy']} lossy, {c['ok']} ok.")
    if r.output_rel_err is not None:
        text += (f" The whole model in {r.dtype}: output relative error "
                 f"{_pct(r.output_rel_err)} ({_db(r.output_sqnr_db)})"
                 + (f", {r.output_nonfinite} non-finite values" if r.output_nonfinite else "")
                 + ".")
    if r.loss_fp32 is not None:
        text += f" Loss {fmt(r.loss_fp32)} in fp32, {fmt(r.loss_low)} in {r.dtype}."
    return text


def _criteria(r: ParityResult) -> str:
    return (f"lossy: relative error over {_pct(lossy_rel_err(r.dtype))} "
            f"({LOSSY_ROUNDOFFS} unit roundoffs of {r.dtype}); overflows: beyond "
            f"{fmt(DTYPE_MAX[r.dtype])} or inf/NaN only in {r.dtype}"
            + (f"; gradients compared at a loss scale of {fmt(r.grad_scale)}"
               if r.grad_scale and r.grad_scale != 1 else ""))


def render_text(r: ParityResult) -> str:
    out = [f"parity: {r.verdict}", "  " + headline(r), ""]
    table = rows(r)
    if table:
        widths = [max(len(str(x)) for x in col) for col in zip(HEAD, *table)]
        fmt = "  " + "  ".join(f"{{:<{w}}}" for w in widths)
        out += [fmt.format(*HEAD).rstrip()] + [fmt.format(*row).rstrip() for row in table]
        if len(r.modules) > SHOWN:
            out.append(f"  ... {len(r.modules) - SHOWN} more modules (to_dict or --format json "
                       "has them all)")
        out.append("  " + _criteria(r))
    for m in r.modules[:SHOWN]:
        if m.verdict != "ok":
            out.append(f"  {label(m)}: {m.reason}")
    for fx in r.fixes:
        out += ["", f"what to change [{fx.id}]: {fx.text}"]
        out += ["    " + line for line in fx.snippet.splitlines()]
    out += [f"note: {n}" for n in r.notes]
    return "\n".join(out).rstrip() + "\n"


def render_markdown(r: ParityResult, level: int = 2) -> str:
    """Names come from the user's model or a parity JSON: each text goes through ``safe``."""
    h, md = "#" * level, safe.md_text
    out = [f"{h} Layer parity in {md(r.dtype)}: {safe.md_code(r.verdict)}", "", md(headline(r)),
           ""]
    table = rows(r)
    if table:
        out += ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
        out += ["| " + " | ".join(md(x) for x in row) + " |" for row in table]
        out += ["", md(_criteria(r) + "."), ""]
    for fx in r.fixes:
        out += [f"**{md(fx.id)}**: {md(fx.text)}", ""] + safe.md_fence(fx.snippet, "python") + [""]
    out += [f"> {md(n)}" for n in r.notes]
    return "\n".join(out).rstrip() + "\n"


def render_html(r: ParityResult) -> str:
    esc = safe.html
    cls = {"ok": "ok", "lossy": "warn"}.get(r.verdict, "bad")
    out = [f"<h2>Layer parity in {esc(r.dtype)}: <code>{esc(r.verdict)}</code></h2>",
           f'<div class="verdict {cls}"><p>{esc(headline(r))}</p></div>']
    table = rows(r)
    if table:
        th = "".join(f"<th>{esc(x)}</th>" for x in HEAD)
        body = "".join("<tr>" + "".join(f"<td>{esc(str(x))}</td>" for x in row) + "</tr>"
                       for row in table)
        out += [f"<table><tr>{th}</tr>{body}</table>",
                f'<p class="muted">{esc(_criteria(r))}.</p>']
    for fx in r.fixes:
        out += [f"<p><code>{esc(fx.id)}</code> {esc(fx.text)}</p>",
                f"<pre><code>{esc(fx.snippet)}</code></pre>"]
    out += [f'<p class="muted">Note: {esc(n)}</p>' for n in r.notes]
    return "\n".join(out)


def render(r: ParityResult, fmt: str = "text") -> str:
    if fmt == "json":
        return r.json()
    if fmt == "markdown":
        return render_markdown(r)
    return render_text(r)


def _finite(value: Any) -> Any:
    """JSON has no inf/NaN: they become None (numbers) — 'exact' SQNR reads as None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
