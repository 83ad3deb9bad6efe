"""The benchmarks still run (tiny sizes): the docs quote them, so they must not rot.

Nothing here is timed: the figures are measured by running the scripts themselves. overhead.py
runs with ``--threads 1`` (its default is 2): beside the other pytest worker, two threads wait on
each other for a core (a tiny GEMM took 47 ms instead of 0.03, the test 110 CPU s instead of 15).
"""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

import ampdoctor


def bench(*args: str) -> str:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", args[0]), *args[1:]],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_overhead_reports_every_mode(tmp_path):
    path = tmp_path / "o.json"
    bench("overhead.py", "--smoke", "--workload", "conv", "--config", "clip", "--modes", "all",
          "--rounds", "1", "--steps", "6", "--warmup", "1", "--threads", "1", "--json", str(path))
    result = json.loads(path.read_text())
    assert set(result["machine"]["gemm_ms"]) == {"float32", "bfloat16", "float16"}
    modes = result["results"][0]["modes"]
    assert {"plain", "plain-again", "ampdoctor", "ampdoctor --every 1",
            "detect_anomaly"} <= set(modes)
    every1 = modes["ampdoctor --every 1"]
    assert every1["every"] == 1 and every1["sampled_from"] == "own"  # all 6 steps sampled
    default = modes["ampdoctor"]
    assert default["every"] == result["default_every"]
    # amortized over the interval: between the steady and the sampled-step figure
    lo, hi = sorted((default["steady"], default["sampled_step"]))
    assert lo <= default["ratio"] <= hi
    assert all(m["ratio"] > 0 for m in modes.values())


def test_overhead_covers_the_configurations_users_run(tmp_path):
    """Every configuration of the table and the memory pairs, on tiny models (the paths
    gpu_check.sh runs on CUDA)."""
    path = tmp_path / "o.json"
    out = bench("overhead.py", "--smoke", "--rounds", "1", "--steps", "5", "--warmup", "1",
                "--threads", "1", "--json", str(path))
    assert "GEMM 64x128x128: float32" in out.splitlines()[0]
    results = json.loads(path.read_text())["results"]
    assert [r["config"] for r in results] == ["scaler", "scaler+clip", "fused", "clip", "bf16"]
    assert [r["scaler"] for r in results] == [True, True, True, False, False]
    memory = tmp_path / "m.json"
    bench("overhead.py", "--smoke", "--memory", "--workload", "lm", "--config", "fused",
          "--steps", "6", "--pairs", "1", "--json", str(memory))
    m = json.loads(memory.read_text())["results"][0]
    assert m["peak_ratio"] > 0 and m["between_plain_mb"] > 0 and m["sampled_stats_kb"] > 0


def test_diagnose_speed_finds_the_overflow():
    out = json.loads(bench("diagnose_speed.py", "--steps", "3000", "--modules", "12",
                           "--every", "50", "--repeat", "1", "--json"))
    assert out["steps"] == 3000 and out["stats_rows"] > 0
    assert out["verdict"] != "healthy"  # one output overflows fp16 at 90% of the run


def test_make_large_run_writes_a_loadable_run(tmp_path):
    path = tmp_path / "big.h5"
    text = bench("make_large_run.py", str(path), "--steps", "1000", "--modules", "9",
                 "--overflow-step", "700")
    assert "1000 steps" in text
    run = ampdoctor.load(path)
    assert len(run.steps) == 1000 and run.status == "finished"
    assert (run.stats["posinf"] > 0).any()


def test_preflight_cost_measures_both_tools(tmp_path):
    path = tmp_path / "p.json"
    bench("preflight_cost.py", "--rounds", "1", "--width", "16", "--layers", "1", "--json",
          str(path))
    result = json.loads(path.read_text())
    for name in ("parity_forward", "parity_with_loss", "check_amp_step"):
        assert result[name]["ratio"] > 0 and result[name]["aa"] > 0


def test_probe_cost_times_the_sampled_step_with_and_without_the_probe():
    out = bench("probe_cost.py", "--smoke")
    assert "results probed per forward" in out and "op probe on a sampled step:" in out
    probed = int(out.split(" results probed")[0].rsplit(" ", 1)[1])
    assert probed > 10  # the tiny GPT's forward was probed op by op


def test_fp8_cost_times_the_sampled_step_with_and_without_the_fp8_counts():
    out = bench("fp8_cost.py", "--smoke")
    assert "fp8 counts on a sampled step:" in out and "always-on step" in out
    operands = int(out.split(" operands x 4 recipes")[0].rsplit(" ", 1)[1])
    assert operands > 10  # the tiny GPT's Linear layers: input, weight, output gradient
    assert "of which the kurtosis" in out


def test_fp8_gpu_says_in_one_sentence_why_it_skips_where_it_cannot_run():
    """gpu_check.sh's fp8 part on a machine without fp8 matmuls: one sentence, exit 0."""
    import torch

    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this machine has fp8 matmuls: gpu_check.sh runs the path itself")
    out = bench("fp8_gpu.py", "--device", "cuda")
    assert out.startswith("fp8 path skipped: ") and len(out.strip().splitlines()) == 1


def test_scale_diagnose_gives_the_full_reads_answer():
    lines = bench("scale_diagnose.py", "--ranks", "1,4", "--steps", "1000", "--modules", "6",
                  "--json").splitlines()
    results = [json.loads(line) for line in lines]
    live = results.pop()
    # 4 ranks make one node of 8: its line is the whole job's
    assert "first bad at step 900 on rank 3" in live["node_line"] and live["top_refresh_s"] > 0
    assert [r["ranks"] for r in results] == [1, 4]
    four = results[1]
    assert four["same"] and four["full"] is not None
    assert four["fast"]["rank"] == 3 and four["fast"]["step"] == 900  # rank 3N/4, at 90 %
    assert four["fast"]["verdict"] != "healthy"
    assert all(r["fast"]["rss_mb"] > 0 and r["fast"]["s"] > 0 for r in results)


def test_large_runs_are_read_by_every_command_and_written_as_json(tmp_path):
    """``crafted_files.py --large``: every reading command on one honest run, each exit 0,
    its CPU seconds and peak memory in the JSON (``--source``: the package measured)."""
    path = tmp_path / "large.json"
    bench("crafted_files.py", "--large", "3000", "--modules", "3", "--keep",
          str(tmp_path / "large.h5"), "--source", ROOT, "--json", str(path))
    result = json.loads(path.read_text())
    assert result["steps"] == 3000 and result["source"] == ROOT
    commands = [r["command"].split()[0] for r in result["commands"]]
    assert commands == ["diagnose", "dump", "top", "report", "report", "report", "export",
                        "compare"]
    assert all(r["exit"] == 0 and r["cpu_seconds"] > 0 and r["peak_mib"] > 0
               for r in result["commands"])
