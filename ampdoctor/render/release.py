"""Release material → HTML, Markdown, JSON; a ``Comparison`` → text, JSON, Markdown.

Reporters take data objects, never paths: ``render_release`` turns a ``release.ReleaseReport``
into one self-contained HTML page (inline CSS, plots embedded as base64 PNG, no external
asset or script) or Markdown for a pull request; ``render_comparison`` renders what
``ampdoctor compare`` prints. The diagnosis itself is rendered by ``render/diagnosis.py`` (its
Markdown is embedded as is; the HTML uses its helpers), so a verdict reads the same everywhere.

matplotlib is imported only when an HTML page draws its figures (through ``plots``).
"""

from __future__ import annotations

import base64
import datetime
import json
import re
from typing import Any, Optional

from .. import safe
from ..display import renders
from ..numfmt import count, fmt
from ..release.comparison import Comparison
from ..release.curves import percent as _pct
from ..release.report import ReleaseReport
from ..version import __version__
from . import fix_outcome
from .diagnosis import also_text, split_causes, where_text
from .diagnosis import render_markdown as diagnosis_markdown
from .tables import esc as _esc
from .tables import html_table as _table
from .tables import kv_table as _kv_table
from .tables import md_table as _md_table
from .tables import nbytes as _bytes
from .tables import ratio as _ratio
from .tables import run_label as _run_label
from .tables import scale as _scale
from .tables import seconds as _seconds
from .tables import step as _step
from .tables import text_table as _text_table

# In every HTML report's head: how report --force knows a page it may replace (files.py).
GENERATOR = '<meta name="generator" content="ampdoctor">'
READINESS_ROWS = 15
FP8_NAMES = 5  # layers named per recipe in the fp8 section (the JSON has them all)


# ---------------------------------------------------------------------------------------------
# The pieces every format shows, as (label, value) rows


def summary_rows(s: Any) -> list[tuple[str, str]]:
    """The release summary as label/value pairs."""
    rows = [("steps", f"{s.steps}" + (f" (last step {s.last_step})" if s.last_step is not None
                                      else ""))]
    if s.init_scale is not None:
        skips = f"{s.skipped}"
        if s.calibration_skips:
            skips += f" ({s.calibration_skips} while GradScaler calibrated)"
        rows += [("skipped steps", skips),
                 ("skip rate after calibration", _pct(s.skip_rate, 3) +
                  f" ({s.skipped_after} of {s.steps - s.calibration_skips}; GradScaler's "
                  f"probing accounts for up to {s.probing_allowance})"),
                 ("loss scale: initial / final", f"{_scale(s.init_scale)} / "
                                                 f"{_scale(s.final_scale)}"),
                 ("loss scale: lowest", f"{_scale(s.min_scale)} ({_step(s.min_scale_step)})")]
    else:
        rows.append(("skipped steps", f"{s.skipped} (no GradScaler)"))
    rows += [("non-finite loss steps", _count_first(s.nonfinite_loss, s.first_nonfinite_loss)),
             ("non-finite gradient steps", _count_first(s.nonfinite_grad,
                                                        s.first_nonfinite_grad)),
             ("peak gradient norm", "-" if s.peak_grad_norm is None else
              f"{fmt(s.peak_grad_norm)} ({_step(s.peak_grad_norm_step)})"),
             ("loss: final / lowest", f"{fmt(s.final_loss)} / {fmt(s.min_loss)}"),
             ("peak memory", f"{_bytes(s.peak_memory)} ({s.memory_measure})"
              if s.peak_memory else "-"),
             ("median step time", _seconds(s.median_step_time)),
             ("sampled steps (per-layer statistics)", str(s.sampled_steps))]
    return rows


def _count_first(n: int, first: Optional[int]) -> str:
    return "0" if not n else f"{n} (first at step {first})"


def decision_rows(d: Any) -> list[tuple[str, str]]:
    return [("device", d.device),
            ("bf16 supported", {True: "yes", False: "no", None: "not known from this run"}[
                d.bf16_supported]),
            ("this run", d.run_dtype + ("" if d.autocast or d.run_dtype == "float32"
                                        else " weights, no autocast")
             + (" + GradScaler" if d.scaler else "")),
            *([("fp8 matmuls", {True: "yes", False: "no", None: "not known from this run"}[
                d.fp8_matmuls])] if d.fp8 else []),
            ("recommendation", d.recommendation)]


def readiness_rows(r: Any) -> list[tuple[str, str, str, str]]:
    """The layers worth a line: overflowing, near the max, underflowing, non-finite; (layer,
    kind, finding, where)."""
    out = []
    for x in r.overflowing:
        frac = f", {_pct(x.over)} of values" if x.over else ""
        out.append((x.name, x.kind, f"overflows fp16: abs max {fmt(x.absmax)}{frac}"
                    + (f" (unscaled {fmt(x.absmax / x.scale)})" if x.scale != 1 else ""),
                    f"{count(x.over_steps, 'sampled step')}, first at step {x.first_over}"
                    if x.first_over is not None else _step(x.absmax_step)))
    for x in r.near:
        out.append((x.name, x.kind, f"within 2x of fp16's max: abs max {fmt(x.absmax)}",
                    _step(x.absmax_step)))
    for x in r.underflowing:
        out.append((x.name, x.kind, f"{_pct(x.sub)} of non-zero values subnormal or flushed, "
                    f"{_pct(x.flush)} flushed to zero" + (" (recorded in fp16: what flushed "
                                                          "is already zero)"
                                                          if x.dtype == "float16" else ""),
                    _step(x.sub_step)))
    for x in r.nonfinite:
        out.append((x.name, x.kind, "NaN or inf",
                    f"{count(x.nonfinite_steps, 'sampled step')}, first at step "
                    f"{x.first_nonfinite}"))
    return out[:READINESS_ROWS]


def fp8_rows(f: Any) -> list[tuple[str, str, str, str, str]]:
    """(recipe, decided by, the layers to keep in high precision, what the trial measured,
    the layers that keep their precision in fp8) per recipe; [] without /fp8 rows."""
    out = []
    for name, recipe in (f.recipes.items() if f is not None else ()):
        if not recipe.layers and not recipe.trial:
            continue
        keep = recipe.keep_high_precision
        named = ", ".join(keep[:FP8_NAMES]) + (f" (+{len(keep) - FP8_NAMES})"
                                               if len(keep) > FP8_NAMES else "")
        if recipe.decided_by == "trial":
            untried = recipe.trial["untried"]
            measured = f"all Linears: {_effect(recipe.trial.get('all'))}"
            if keep:
                measured += f"; all but those kept: {_effect(recipe.trial.get('all_but_keep'))}"
            if untried:
                measured += f"; {count(len(untried), 'layer')} not tried (budget)"
        else:
            measured = "not tried: one step holds no amax history" if name == "delayed" \
                else "no trial: ranked from the statistics"
        fine = [n for n in recipe.layers if n not in keep]
        in_fp8 = ", ".join(fine[:FP8_NAMES]) + (f" (+{len(fine) - FP8_NAMES})"
                                                if len(fine) > FP8_NAMES else "")
        out.append((name, recipe.decided_by, f"{len(keep)}: {named}" if keep else "none",
                    measured, f"{len(fine)}: {in_fp8}" if fine else "none"))
    return out


def fp8_warning(w: Any) -> str:
    """The fp8 early warning in a sentence (``diagnosis.fp8watch``): each Linear at risk on
    the latest sampled step, since when and why; "" when none is."""
    risky = w.at_risk if w is not None else []
    if not risky:
        return ""
    named = "; ".join(f"{x.name} from step {x.first_warned} ({x.why()})"
                      for x in risky[:FP8_NAMES])
    more = f" (+{len(risky) - FP8_NAMES})" if len(risky) > FP8_NAMES else ""
    return (f"Early warning at step {w.step}: {count(len(risky), 'Linear')} at risk in fp8, "
            f"{named}{more}. Their curves: figure fp8_headroom; per layer: `report --format "
            "json`, key `fp8_watch`.")


def _effect(e: Any) -> str:
    """What one re-run did: the gradient's relative error, the loss's relative change."""
    if not isinstance(e, dict) or "grad_error" not in e:
        return "not measured"
    grad = e["grad_error"]
    text = f"gradient {_pct(grad)} off" if isinstance(grad, (int, float)) else "gradient " \
        "non-finite"
    change = e.get("loss_change")
    if isinstance(change, (int, float)):
        text += f", loss {'+' if change >= 0 else ''}{_pct(change)}"
    return text


def fp8_paste(f: Any) -> Optional[tuple[str, str, dict]]:
    """(recipe, the sentence that introduces it, its lines to paste) for the recipe the trial
    found to suit the model (else tensorwise); None where no trial decided."""
    if f is None or not any(r.decided_by == "trial" for r in f.recipes.values()):
        return None
    t = f.trial
    name = f.suits or "tensorwise"
    why = (f"{name} suits this model: with the layers it keeps in high precision its step "
           "stays within the thresholds, with the fewest kept" if f.suits else
           "no recipe kept the step within the thresholds; tensorwise, with its layers kept")
    intro = (f"The fp8 trial re-ran step {t['step']}'s batch with the weights after step "
             f"{t['weights_step']} ({count(t['runs'], 're-run')}, {_seconds(t['seconds'])}): "
             f"{why}.")
    if t.get("stopped"):
        intro += f" It stopped early: {t['stopped']}."
    return name, intro, f.recipes[name].paste()


FP8_NOTE = ("Layers to keep in high precision: where the fp8 trial ran, those whose cast to "
            "fp8 alone moved the step's gradient by more than 10 % or its loss by more than 1 % "
            "(the last sampled step re-run with each Linear in emulated fp8); elsewhere ranked "
            "from the sampled statistics (values flushed, saturated, SQNR). Per layer and "
            "tensor: `report --format json`, key `fp8`.")
FP8_HEAD = ("recipe", "decided by", "keep in high precision", "measured", "keep precision in fp8")
FP8_PASTE = (("torchao", "torchao", "python"), ("TransformerEngine", "transformer_engine",
                                                 "python"), ("ampdoctor record", "apply", "sh"))


def comparison_rows(c: Any) -> list[tuple[str, str]]:
    rows = [("verdict", c.verdict),
            ("tolerance", f"match within {_pct(c.tolerance['rtol'])}, diverged beyond "
                          f"{_pct(c.tolerance['diverge'])}"
                          + (f", trailing mean of {c.tolerance['window']} steps"
                             if c.tolerance["window"] > 1 else "")),
            ("common steps", str(c.common_steps)),
            ("largest loss difference", f"{_pct(c.max_rel)} ({_step(c.max_rel_step)})"),
            ("final loss difference", f"{_pct(c.final_rel)} ({_step(c.final_step)})")]
    if c.divergence_step is not None:
        rows.append(("divergence step", str(c.divergence_step)))
    if c.nonfinite_count:
        shown = ", ".join(map(str, c.nonfinite_steps[:8]))
        more = f" and {c.nonfinite_count - 8} more" if c.nonfinite_count > 8 else ""
        rows.append(("non-finite loss (mixed precision only)",
                     f"{c.nonfinite_count}: steps {shown}{more}"))
    st = c.step_time
    rows.append(("median step time", f"{_seconds(st.get('base'))} -> {_seconds(st.get('amp'))}"
                 + (f" (speedup {_ratio(c.speedup)})" if c.speedup else "")))
    m = c.memory
    rows.append(("peak memory", f"{_bytes(m.get('base'))} -> {_bytes(m.get('amp'))}"
                 + (f" ({_ratio(c.memory_ratio)} of the baseline, {m.get('measure')})"
                    if c.memory_ratio else "")))
    return rows


def layer_diff_rows(c: Any) -> list[tuple[str, ...]]:
    return [(x.name, x.kind, f"{x.ratio:.4g}", f"{x.worst_ratio:.4g} (step {x.worst_step})",
             f"{fmt(x.absmax_base)} / {fmt(x.absmax_amp)}") for x in c.layers]


LAYER_DIFF_HEAD = ("layer", "kind", "rms ratio (median)", "worst ratio", "abs max base / amp")


# ---------------------------------------------------------------------------------------------
# ampdoctor compare


def render_comparison(c: Comparison, fmt: str = "text") -> str:
    if fmt == "json":
        return json.dumps(c.to_dict(), indent=2, allow_nan=False, default=str) + "\n"
    if fmt == "markdown":
        return comparison_markdown(c, level=2)
    return safe.terminal(comparison_text(c))


def comparison_text(c: Any) -> str:
    if c.kind == "fix":
        return fix_outcome.text(c)
    lines = [f"ampdoctor compare: {_run_label(c.base)}", f"               vs {_run_label(c.amp)}",
             "", f"verdict: {c.verdict}", f"  {c.summary}", ""]
    width = max(len(k) for k, _ in comparison_rows(c))
    lines += [f"  {k:<{width}}  {v}" for k, v in comparison_rows(c)[1:]]
    if c.layers:
        lines += ["", f"layers that differ most (rms of the mixed-precision run over the "
                      f"baseline's, {count(c.layer_steps, 'common sampled step')}, "
                      "gradients unscaled):"]
        lines += _text_table(LAYER_DIFF_HEAD, layer_diff_rows(c), indent="  ")
    rng = c.amp_range
    if rng:
        lines += ["", f"fp16 range in the {c.amp['dtype']} run: {rng['status']}",
                  f"  {rng['advice']}"]
        for x in rng.get("overflowing", []) + rng.get("near", []):
            lines.append(f"  - {x['name']} ({x['kind']}): abs max {fmt(x['absmax'])} at step "
                         f"{x['step']}")
        for x in rng.get("underflowing", []):
            lines.append(f"  - {x['name']} ({x['kind']}): {_pct(x['sub'])} subnormal or "
                         f"flushed at step {x['sub_step']}")
        for x in rng.get("nonfinite", []):
            lines.append(f"  - {x['name']} ({x['kind']}): NaN or inf from step "
                         f"{x['first_nonfinite']}")
    for note in c.notes:
        lines += ["", f"note: {note}"]
    return "\n".join(lines) + "\n"


def comparison_markdown(c: Any, level: int = 2) -> str:
    if c.kind == "fix":
        return fix_outcome.markdown(c, level)
    h, code, md = "#" * level, safe.md_code, safe.md_text
    out = [f"{h} fp32 parity: {code(c.verdict)}", "",
           f"{code(c.base['path'])} ({md(c.base['dtype'])}) vs {code(c.amp['path'])} "
           f"({md(c.amp['dtype'])}" + (" + GradScaler" if c.amp.get("scaler") else "") + ")", "",
           md(c.summary), ""]
    out += _md_table(("", ""), comparison_rows(c)[1:]) + [""]
    if c.layers:
        out += [f"{h}# Layers that differ most", "",
                f"rms of the mixed-precision run over the baseline's on "
                f"{count(c.layer_steps, 'common sampled step')}, gradients unscaled.", ""]
        out += _md_table(LAYER_DIFF_HEAD, layer_diff_rows(c)) + [""]
    rng = c.amp_range
    if rng:
        out += [f"{h}# fp16 range in the {md(c.amp['dtype'])} run: {code(rng['status'])}", "",
                md(rng["advice"]), ""]
    for note in c.notes:
        out += [f"> {md(note)}", ""]
    return "\n".join(out).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------
# ampdoctor report


def render_release(r: ReleaseReport, fmt: str = "html",
                   images: Optional[dict[str, str]] = None) -> str:
    """``html``: one self-contained page, figures drawn and embedded. ``markdown``: for a pull
    request; ``images`` maps figure names to paths the CLI wrote them to (else no figures).
    ``json``: the data."""
    if fmt == "json":
        return json.dumps(r.to_dict(), indent=2, allow_nan=False, default=str) + "\n"
    if fmt == "markdown":
        return release_markdown(r, images)
    return release_html(r)


def _title(r: Any) -> str:
    return r.diagnosis.run.get("path") or r.run.path or "run"


def release_markdown(r: Any, images: Optional[dict[str, str]] = None) -> str:
    from .plots import CAPTIONS

    s, d, rd = r.summary, r.decision, r.readiness
    code, md = safe.md_code, safe.md_text
    out = [f"# ampdoctor release report: {code(_title(r))}", ""]
    diagnosis = diagnosis_markdown(r.diagnosis).rstrip()
    if diagnosis.startswith("## ampdoctor: "):  # report's heading, as a section of this one
        diagnosis = "## Diagnosis: " + diagnosis[len("## ampdoctor: "):]
    out += [diagnosis, ""]
    out += ["## Summary", ""] + _md_table(("", ""), summary_rows(s)) + [""]
    out += ["## Precision decision", "", f"**{md(d.recommendation)}**", ""]
    if d.fix_first:
        out += [f"> {md(d.fix_first)}", ""]
    out += _md_table(("", ""), decision_rows(d)[:-1]) + [""]
    out += [f"- {md(reason)}" for reason in d.reasons] + [""]
    out += [f"## fp16 readiness: {code(rd.status)}", "", md(rd.advice), ""]
    rows = readiness_rows(rd)
    if rows:
        out += _md_table(("layer", "kind", "finding", "where"), rows) + [""]
    fp8 = fp8_rows(r.fp8)
    if fp8:
        out += ["## fp8 readiness", "", FP8_NOTE, ""]
        out += _md_table(FP8_HEAD, fp8) + [""]
        warned = fp8_warning(r.fp8_watch)
        if warned:
            out += [md(warned), ""]
        paste = fp8_paste(r.fp8)
        if paste is not None:
            out += [md(paste[1]), ""]
            for label, key, info in FP8_PASTE:
                if paste[2][key]:
                    out += [f"{label}:", "", *safe.md_fence(paste[2][key], info), ""]
    if r.comparison is not None:
        out += [comparison_markdown(r.comparison, level=2).rstrip(), ""]
    if r.parity is not None:
        from ..preflight.parity_result import render_markdown as parity_markdown

        out += [parity_markdown(r.parity, level=2).rstrip(), ""]
    if images:
        out += ["## Figures", ""]
        for name, path in images.items():
            out += [f"![{md(CAPTIONS.get(name, name))}]({_md_link(path)})", ""]
    for note in r.notes:
        out += [f"> {md(note)}", ""]
    # Every text above went through safe's escapers; the footer is the one tag of our own.
    return "\n".join(out).rstrip() + f"\n\n<sub>ampdoctor {__version__}</sub>\n"


_PLAIN_PATH = re.compile(r"[\w./\-]+")


def _md_link(path: str) -> str:
    """A link destination: as written when plain, else in <...> where any character but a
    line break (written out), < and > (escaped) is part of it."""
    if _PLAIN_PATH.fullmatch(path):
        return path
    return "<" + safe.one_line(path).replace("\\", "\\\\").replace("<", "\\<") \
        .replace(">", "\\>") + ">"


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#222;
max-width:980px;margin:2em auto;padding:0 1em}
h1{font-size:1.5em;margin-bottom:.2em}h2{font-size:1.2em;margin-top:1.8em;
border-bottom:1px solid #ddd;padding-bottom:.2em}h3{font-size:1em}
.sub{color:#666;margin-top:0}code,pre{font:12.5px/1.4 ui-monospace,Menlo,Consolas,monospace}
pre{background:#f6f8fa;padding:.6em .8em;overflow-x:auto;border-radius:4px}
table{border-collapse:collapse;margin:.5em 0}td,th{padding:.25em .8em;text-align:left;
border-bottom:1px solid #eee;vertical-align:top}th{background:#fafafa}
.verdict{padding:.6em 1em;border-left:5px solid;border-radius:3px}
.ok{border-color:#2ca02c;background:#f3fbf3}.bad{border-color:#d62728;background:#fdf3f3}
.warn{border-color:#ff7f0e;background:#fff8ef}.rec{font-size:1.15em;font-weight:600}
figure{margin:1em 0}figure img{max-width:100%;height:auto}figcaption{color:#555;font-size:.9em}
.muted{color:#777}
"""


def _figure(name: str, data: bytes, caption: str) -> str:
    b64 = base64.b64encode(data).decode("ascii")
    return (f'<figure id="fig-{_esc(name)}"><img alt="{_esc(caption)}" '
            f'src="data:image/png;base64,{b64}"><figcaption>{_esc(caption)}</figcaption>'
            "</figure>")


def release_html(r: Any) -> str:
    """One self-contained HTML page: every figure embedded, no external reference."""
    from . import plots

    figs = plots.figures(r.run, r.diagnosis, r.readiness, r.comparison)
    images = {name: plots.png(fig) for name, fig in figs.items()}
    run = r.diagnosis.run
    sub = [f"{run.get('steps', 0)} steps", f"status {run.get('status')}",
           f"autocast {run.get('autocast_dtype') or 'off'}", r.decision.device,
           f"ampdoctor {__version__}",
           datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")]
    parts = [f"<h1>ampdoctor release report: <code>{_esc(_title(r))}</code></h1>",
             f'<p class="sub">{_esc(" · ".join(sub))}</p>',
             _diagnosis_html(r.diagnosis),
             "<h2>Summary</h2>", _kv_table(summary_rows(r.summary)),
             _decision_html(r.decision), "<h2>Curves</h2>"]
    for name in ("loss", "scale", "grad_norm", "lr", "activations", "fp8_headroom"):
        if name in images:
            parts.append(_figure(name, images[name], plots.CAPTIONS[name]))
    parts.append(_readiness_html(r.readiness, images))
    fp8 = fp8_rows(r.fp8)
    if fp8:
        parts += ["<h2>fp8 readiness</h2>", f'<p class="muted">{_esc(FP8_NOTE)}</p>',
                  _table(FP8_HEAD, fp8)]
        warned = fp8_warning(r.fp8_watch)
        if warned:
            parts.append(f"<p>{_esc(warned)}</p>")
        paste = fp8_paste(r.fp8)
        if paste is not None:
            parts.append(f"<p>{_esc(paste[1])}</p>")
            parts += [f"<p>{_esc(label)}:</p><pre><code>{_esc(paste[2][key])}</code></pre>"
                      for label, key, _ in FP8_PASTE if paste[2][key]]
    if r.comparison is not None:
        parts.append(_comparison_html(r.comparison, images))
    if r.parity is not None:
        from ..preflight.parity_result import render_html as parity_html

        parts.append(parity_html(r.parity))
    for note in r.notes:
        parts.append(f'<p class="muted">{_esc(note)}</p>')
    title = _esc(f"ampdoctor report: {_title(r)}")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"{GENERATOR}<title>{title}</title><style>{_CSS}</style></head><body>\n"
            + "\n".join(parts) + "\n</body></html>\n")


def _diagnosis_html(d: Any) -> str:
    cls = "ok" if d.healthy else "bad"
    out = [f"<h2>Diagnosis: <code>{_esc(d.verdict)}</code> "
           f"<span class=\"muted\">(confidence {d.confidence:.2f})</span></h2>",
           f'<div class="verdict {cls}"><p>{_esc(d.summary)}</p>']
    if d.first_bad:
        out.append(f"<p><b>First bad:</b> {_esc(where_text(d.first_bad))}</p>")
    chain, also = split_causes(d)
    if len(chain) > 1:
        out.append("<p><b>Chain:</b> " + " → ".join(f"<code>{_esc(c['verdict'])}</code>"
                                                    for c in chain) + "</p>")
    for cause in also:
        out.append(f"<p><b>Also:</b> {_esc(also_text(cause))}</p>")
    out.append("</div>")
    out += _warning_html(d)
    if d.evidence:
        out.append("<h3>Evidence</h3><ul>" + "".join(f"<li>{_esc(e.text)}</li>"
                                                     for e in d.evidence) + "</ul>")
    if d.fixes:
        out.append("<h3>What to change</h3>")
        for fx in d.fixes:
            out.append(f"<p><code>{_esc(fx.id)}</code> {_esc(fx.text)}</p>")
            if fx.snippet:
                out.append(f"<pre><code>{_esc(fx.snippet)}</code></pre>")
    for note in d.notes:
        out.append(f'<p class="muted">Note: {_esc(note)}</p>')
    return "\n".join(out)


def _warning_html(d: Any) -> list[str]:
    """The early warning (``forecast.warning_lines``): a box under a healthy verdict, a line on
    a failed run."""
    from ..diagnosis.forecast import warning_lines

    found = warning_lines(getattr(d, "forecast", None), d.healthy)
    if not found:
        return []
    if not d.healthy:
        return [f"<p><b>Early warning:</b> {_esc(found[0])}</p>"]
    return ['<h3>Early warning</h3><div class="verdict warn">', f"<p>{_esc(found[0])}</p>"] + \
        [f"<p>{_esc(x)}</p>" for x in found[1:]] + ["</div>"]


def _decision_html(d: Any) -> str:
    out = ["<h2>Precision decision</h2>",
           f'<div class="verdict ok"><p class="rec">{_esc(d.recommendation)}</p></div>']
    if d.fix_first:
        out.append(f'<div class="verdict warn"><p>{_esc(d.fix_first)}</p></div>')
    out.append(_kv_table(decision_rows(d)[:-1]))
    out.append("<ul>" + "".join(f"<li>{_esc(x)}</li>" for x in d.reasons) + "</ul>")
    return "\n".join(out)


def _readiness_html(rd: Any, images: dict[str, bytes]) -> str:
    from .plots import CAPTIONS

    cls = {"ready": "ok", "needs_scaler": "ok", "tight": "warn", "unknown": "warn"}.get(
        rd.status, "bad")
    out = [f"<h2>fp16 readiness: <code>{_esc(rd.status)}</code></h2>",
           f'<div class="verdict {cls}"><p>{_esc(rd.advice)}</p></div>']
    rows = readiness_rows(rd)
    if rows:
        out.append(_table(("layer", "kind", "finding", "where"), rows))
    if rd.layers:
        out.append(f'<p class="muted">From {count(rd.sampled_steps, "sampled step")}, '
                   f"{count(len(rd.layers), 'layer tensor')}; gradients "
                   + ("at the run's loss scale" if rd.scaled else "unscaled") + ".</p>")
    if "grad_underflow" in images:
        out.append(_figure("grad_underflow", images["grad_underflow"],
                           CAPTIONS["grad_underflow"]))
    return "\n".join(out)


def _comparison_html(c: Any, images: dict[str, bytes]) -> str:
    from .plots import CAPTIONS

    if c.kind == "fix":
        return fix_outcome.html(c, _figure("parity", images["parity"], CAPTIONS["parity"])
                                if "parity" in images else "")
    cls = {"match": "ok", "drift": "warn"}.get(c.verdict, "bad")
    out = [f"<h2>fp32 parity: <code>{_esc(c.verdict)}</code></h2>",
           f"<p><code>{_esc(c.base['path'])}</code> ({_esc(c.base['dtype'])}) vs "
           f"<code>{_esc(c.amp['path'])}</code> ({_esc(c.amp['dtype'])})</p>",
           f'<div class="verdict {cls}"><p>{_esc(c.summary)}</p></div>',
           _kv_table(comparison_rows(c)[1:])]
    if "parity" in images:
        out.append(_figure("parity", images["parity"], CAPTIONS["parity"]))
    if c.layers:
        out.append(f"<h3>Layers that differ most</h3><p class=\"muted\">rms of the mixed-"
                   f"precision run over the baseline's on "
                   f"{count(c.layer_steps, 'common sampled step')}, gradients unscaled.</p>")
        out.append(_table(LAYER_DIFF_HEAD, layer_diff_rows(c)))
    for note in c.notes:
        out.append(f'<p class="muted">Note: {_esc(note)}</p>')
    return "\n".join(out)


# str(), Jupyter and ReleaseReport.html()/.markdown() find these through ampdoctor.display.
renders(Comparison, "text")(lambda c: render_comparison(c, "text"))
renders(Comparison, "markdown")(lambda c: render_comparison(c, "markdown"))
renders(ReleaseReport, "html")(lambda r: render_release(r, "html"))
renders(ReleaseReport, "markdown")(lambda r: render_release(r, "markdown"))
