"""The rank view of a multi-rank diagnosis: where non-finite values began, and how often; the
ranks whose loss scale, skip count, length or status differ from the others'.

Built from the ``job.RankFacts`` of every rank (their summaries, or the loaded runs), so it
costs nothing more than the diagnosis already read, whatever the rank count. It is plain data
(``Diagnosis.rank_view``, in the JSON as it is); ``render.diagnosis`` shows it under
``ranks:``.

The origin of a bad step is the rank where its value was born: in data-parallel training a
NaN born in one rank's forward or loss reaches every rank through the gradient all-reduce in
the same step, but only the origin's own loss is non-finite. So "how often" counts, per rank,
the steps whose loss went non-finite there. (Once an update has made the weights themselves
non-finite, every rank's loss is: then only the first step tells the origin, and the view
says so.) A NaN born in the backward pass or the optimizer shows in no rank's loss.

Example::

    view = rankview.build(facts, origin=17, scales=job.compare_scales(facts, read),
                          full=[17])
    view["origins"][0]       # {'rank': 17, 'steps': 12, 'first': 9000, ...}
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Optional

from ..numfmt import fmt
from . import ranks
from .job import RankFacts

TOP = 10  # origins shown, the most frequent first
LISTED = 10  # ranks listed by name in each disagreement (the JSON has them all)


def build(facts: list[RankFacts], *, origin: Optional[int], scales: Optional[dict],
          full: list[int]) -> dict:
    """The rank view (see the module docstring) as JSON-ready data."""
    world = max([f.world_size for f in facts] + [len(facts)])
    have = {f.rank for f in facts}
    first = next((f for f in facts if f.rank == origin), None)
    return {
        "ranks": len(facts),
        "world_size": world,
        "read_in_full": list(full),
        "missing": [r for r in range(world) if r not in have],
        "first": None if first is None else {
            "rank": first.rank, "step": first.outline["first_bad"],
            "local": bool(first.outline["local"]), "module": first.outline["module"],
            "phase": first.outline["phase"],
            # told by its own found_inf (ShardedGradScaler), no loss or forward telling
            "own_grads": ranks.by_own_flag([f.outline for f in facts], origin)},
        **_origins(facts),
        "scale": _scale(facts, scales),
        **_lengths_and_skips(facts),
        "statuses": dict(sorted(Counter(f.outline["status"] for f in facts).items())),
    }


def _origins(facts: list[RankFacts]) -> dict:
    born = [f for f in facts if f.loss_bad_steps]
    born.sort(key=lambda f: (-f.loss_bad_steps, f.outline["first_loss_bad"], f.rank))
    rows = []
    for f in born[:TOP]:
        row = {"rank": f.rank, "steps": f.loss_bad_steps, "first": f.outline["first_loss_bad"]}
        if f.outline["first_loss_bad"] == f.outline["first_bad"] and f.outline["module"]:
            row.update(module=f.outline["module"], phase=f.outline["phase"])
        if f.outline.get("not_reproduced") is not None:  # the replay side's count, when known
            row["not_reproduced"] = f.outline["not_reproduced"]
        rows.append(row)
    everywhere = len(born) == len(facts) > 1 and len({f.loss_bad_steps for f in born}) == 1
    return {"origins": rows, "origin_ranks": len(born), "poisoned": everywhere}


def _scale(facts: list[RankFacts], scales: Optional[dict]) -> dict:
    scaled = sum(f.scaled for f in facts)
    if not scales:
        return {"ranks": scaled, "diverged_at": None, "differ": []}
    return {"ranks": scaled, "diverged_at": scales.get("step"),
            "differ": scales.get("differ", [])}


def _lengths_and_skips(facts: list[RankFacts]) -> dict:
    """Ranks cut short (a recording that ends before the others'), and among the ranks that
    recorded the same steps as most, those whose skip count differs."""
    last = max((f.last_step for f in facts if f.last_step is not None), default=None)
    short = [{"rank": f.rank, "last_step": f.last_step} for f in facts
             if last is not None and (f.last_step is None or f.last_step < last)]
    spans = Counter((f.first_step, f.last_step) for f in facts)
    usual_span = max(spans.items(), key=lambda kv: (kv[1], kv[0][1] or -1))[0]
    same = [f for f in facts if (f.first_step, f.last_step) == usual_span]
    counts = Counter(f.outline["skipped"] for f in same)
    usual = max(counts.items(), key=lambda kv: (kv[1], -kv[0]))[0] if counts else 0
    differ = [{"rank": f.rank, "skipped": f.outline["skipped"]} for f in same
              if f.outline["skipped"] != usual]
    return {"last_step": last, "short": short,
            "skips": {"usual": usual, "ranks": counts.get(usual, 0), "differ": differ}}


# ---------------------------------------------------------------------------------------------
# In words (render/diagnosis.py lays these lines out)


def lines(view: dict) -> list[str]:
    """The rank view as lines of text, one fact each."""
    out = [_head(view)]
    first = view.get("first")
    if first is not None:
        place = ranks.where(first)
        if first.get("own_grads"):
            place = "in its own shard of the gradients (its own found_inf, before the ranks' " \
                "were combined)"
        out.append(f"went non-finite first: rank {first['rank']} at step {first['step']}"
                   + (f" {place}" if place else ""))
    out.append(_origins_line(view))
    out.append(_scale_line(view))
    out.append(_skips_line(view))
    if view["short"]:
        short = view["short"]
        listed = "; ".join(f"rank {x['rank']} (last step {x['last_step']})"
                           for x in short[:LISTED])
        out.append(f"recorded fewer steps than the others (last step {view['last_step']}): "
                   + listed + _more(short))
    out.append("status: " + ", ".join(f"{n} {status}" for status, n in
                                      view["statuses"].items()))
    if view["missing"]:
        out.append(f"no file: {ranks.ranks_text(view['missing'])}")
    return [x for x in out if x]


def _head(view: dict) -> str:
    full = view["read_in_full"]
    rest = view["ranks"] - len(full)
    head = f"{view['ranks']} rank files of {view['world_size']}"
    if rest > 0:
        head += f"; read in full: {ranks.ranks_text(full)}; the other {rest} from their summaries"
    return head


def _origins_line(view: dict) -> str:
    rows = view["origins"]
    if not rows:
        first = view.get("first") or {}
        if first.get("own_grads"):
            return ("no rank's loss went non-finite: each rank's own found_inf, read before "
                    "the scaler combined them, tells where the gradients went non-finite")
        return ("no rank's loss went non-finite: the non-finite values showed in the gradients, "
                "which the all-reduce mixes, so the losses cannot tell where each began"
                if first else "")
    shown = "; ".join(_origin(x) for x in rows)
    more = view["origin_ranks"] - len(rows)
    text = ("non-finite losses (a NaN born on that rank), most steps first: " + shown
            + (f"; and {more} more ranks" if more > 0 else ""))
    if view.get("poisoned"):
        text += (" (every rank's loss went non-finite on as many steps: the weights themselves "
                 "were non-finite, so only the first step tells where it began)")
    return text


def _origin(x: dict) -> str:
    place = ranks.where(x)
    text = f"rank {x['rank']} on {x['steps']} step{'s' if x['steps'] != 1 else ''} " \
        f"(first {x['first']}" + (f", {place}" if place else "") + ")"
    if x.get("not_reproduced") is not None:
        text += f", {x['not_reproduced']} not reproduced by the replay"
    return text


def _scale_line(view: dict) -> str:
    sc = view["scale"]
    if not sc["ranks"]:
        return ""
    if not sc["differ"]:
        return f"loss scale: the same on every rank ({sc['ranks']} ranks with a GradScaler)"
    parts = [f"{ranks.ranks_text(g['ranks'], LISTED)} from step {g['step']} "
             f"({_fmt(g['scale'])} where the others have {_fmt(g['usual'])})"
             for g in sc["differ"][:LISTED]]
    return "loss scale differs from the others': " + "; ".join(parts) + _more(sc["differ"])


def _skips_line(view: dict) -> str:
    sk = view["skips"]
    if not sk["differ"]:
        return f"skipped steps: {sk['usual']} on each of {sk['ranks']} ranks" \
            if sk["ranks"] > 1 else ""
    listed = ", ".join(f"rank {x['rank']}: {x['skipped']}" for x in sk["differ"][:LISTED])
    return (f"skipped steps: {sk['usual']} on {sk['ranks']} ranks; " + listed
            + _more(sk["differ"]))


def _more(items: list) -> str:
    return f" and {len(items) - LISTED} more" if len(items) > LISTED else ""


def _fmt(x: Any) -> str:
    return fmt(x)
