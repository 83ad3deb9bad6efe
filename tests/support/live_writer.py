"""A run file written step by step on command, by a child process (no torch: it starts fast).

The live-view tests drive it through its stdin, one command a line, and wait for its "ok"::

    steps N [nan]     N more steps (with GradScaler's scale; 'nan': a non-finite loss, skipped)
    sampled           per-layer statistics for the last step (an activation near 65504, a
                      gradient half flushed)
    replay            a forensic snapshot for the last step (blocks.0.attn, forward)
    close STATUS      finish the file with STATUS and exit

    python tests/support/live_writer.py run.h5 [--rank R --world W] [--host NAME]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from ampdoctor.runfile import schema, store
from ampdoctor.runfile.schema import Event, Kind, Phase, Source, flag

LAYERS = [(Kind.OUTPUT, "blocks.0.attn", "Attention", 40000.0, 0),
          (Kind.OUTPUT, "blocks.0.mlp", "Sequential", 12.0, 0),
          (Kind.PARAM_GRAD, "blocks.0.mlp.weight", "Linear", 3.0, 2048)]


class Driven:
    def __init__(self, path: str, rank: int, world: int, host: str | None):
        self.w = store.Writer(path, rank=rank, world_size=world, create=False)
        if host:
            self.w._attrs["host"] = host
        self.w.create()
        self.step = 0
        self.scale = 65536.0
        self.w.meta("status", schema.STATUS_RUNNING)
        self.w.meta("recorder", {"every": 5})
        self.w.meta("autocast", {"device_type": "cpu", "enabled": True, "dtype": "float16"})
        self.w.meta("scaler", {"class": "GradScaler", "enabled": True, "init_scale": 65536.0,
                               "growth_interval": 2000})
        for tid, (kind, name, owner, _, _) in enumerate(LAYERS):
            row = schema.empty("tensors", 1)
            row["id"], row["kind"], row["numel"] = tid, int(kind), 4096
            row["name_off"], row["name_len"] = self.w.text(name)
            row["type_off"], row["type_len"] = self.w.text(owner)
            self.w.append("tensors", row)
        self.w.flush()

    def steps(self, n: int, nan: bool) -> None:
        rows = schema.empty("steps", n)
        groups = schema.empty("groups", 2 * n)
        for i in range(n):
            r = rows[i]
            r["step"], r["time"], r["dt"] = self.step, time.time(), 0.01
            r["loss"] = np.nan if nan else 2.0 / (1 + 0.1 * self.step)
            r["scale"], r["found_inf"], r["skipped"] = self.scale, int(nan), int(nan)
            r["grad_norm"] = np.inf if nan else 1.0 + 0.01 * self.step
            r["flags"] = flag(Event.SKIPPED) | flag(Event.NONFINITE_LOSS) if nan else 0
            self.scale = self.scale / 2 if nan else self.scale
            r["scale_after"] = self.scale
            r["lr"] = 1e-3
            for g, lr in enumerate((1e-3, 1e-4)):
                groups[2 * i + g]["step"], groups[2 * i + g]["group"] = self.step, g
                groups[2 * i + g]["lr"] = lr * (1 + self.step / 100)
            self.step += 1
        self.w.append("steps", rows)
        self.w.append("groups", groups)
        self.w.flush()

    def sampled(self) -> None:
        rows = schema.empty("stats", len(LAYERS))
        for tid, (kind, _, _, absmax, sub) in enumerate(LAYERS):
            r = rows[tid]
            r["step"], r["tensor"], r["source"] = self.step - 1, tid, int(Source.SAMPLED)
            r["numel"] = r["sample_n"] = 4096
            for key in ("nonfinite", "nan", "posinf", "neginf", "zeros", "over16", "near16",
                        "sub16", "flush16", "overbf16", "subbf16", "flushbf16"):
                r[key] = 0
            r["absmax"], r["sub16"], r["dtype"] = absmax, sub, int(schema.DType.FLOAT16)
            r["near16"] = 10 if absmax >= 2 ** 15 else 0
        self.w.append("stats", rows)
        self.w.flush()

    def replay(self) -> None:
        row = schema.empty("snapshots", 1)
        sid = self.w.rows("snapshots")
        row["id"], row["step"], row["trigger"] = sid, self.step - 1, int(Event.SKIPPED)
        row["phase"], row["culprit"], row["fp32_finite"] = int(Phase.FORWARD), 0, 1
        row["module_off"], row["module_len"] = self.w.text("blocks.0.attn")
        row["module_type_off"], row["module_type_len"] = self.w.text("Attention")
        row["detail_off"], row["detail_len"] = self.w.text(json.dumps({"how": "matmul overflowed"}))
        self.w.append("snapshots", row)
        ev = schema.empty("events", 1)
        ev["step"], ev["kind"], ev["value"] = self.step - 1, int(Event.FORENSICS), sid
        self.w.append("events", ev)
        self.w.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--host")
    args = parser.parse_args()
    d = Driven(args.path, args.rank, args.world, args.host)
    print("ok", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "steps":
            d.steps(int(cmd[1]), "nan" in cmd)
        elif cmd[0] == "sampled":
            d.sampled()
        elif cmd[0] == "replay":
            d.replay()
        elif cmd[0] == "close":
            d.w.close(cmd[1])
            print("ok", flush=True)
            return
        print("ok", flush=True)


if __name__ == "__main__":
    main()
