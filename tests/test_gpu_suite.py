"""benchmarks/gpu_suite.sh: its dry mode on CPU (every stage that can run here, tiny sizes), and
that it records a failed or hung stage and goes on to the next."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_suite import RESULT_PREFIX, Stage, run_suite  # noqa: E402


@pytest.mark.multiprocess
def test_dry_run_passes_every_stage_that_runs_on_cpu(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_suite.sh"), str(out), "--dry"],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=1500)
    summary = json.loads((out / "summary.json").read_text())
    stages = summary["stages"]
    assert done.returncode == 0, (json.dumps(stages, indent=1)[-4000:], (out / "suite.log").read_text()[-4000:])
    assert sorted(p.name for p in out.iterdir()) == ["suite.log", "summary.json"]  # the device returns <= 8 files
    assert {n: s["status"] for n, s in stages.items()} == {
        "env": "passed", "smoke": "passed", "gpu_tests": "skipped", "parity_fp32": "passed", "parity_bf16": "passed",
        "resume": "passed", "bench": "passed", "fp8": "passed"}
    assert stages["env"]["layer_spec"] == "local" and stages["env"]["deepspeed_ops"]["version"]
    assert stages["smoke"]["checkpoint_saved"] and stages["smoke"]["hf_exported"]
    assert stages["gpu_tests"]["tests"] >= 1 and stages["gpu_tests"]["skipped"] == stages["gpu_tests"]["tests"]
    fp32, bf16 = stages["parity_fp32"], stages["parity_bf16"]
    assert fp32["steps"] == bf16["steps"] == 10 and fp32["max_loss_diff"] < 1e-5 and fp32["max_grad_norm_rel_diff"] <= 1e-4
    assert 0 < bf16["max_loss_diff"] < bf16["loss_tolerance"], "bf16 differs from fp32, within its bar"
    assert stages["resume"]["latest_after_kill"] == "step_0000005"
    assert stages["resume"]["bit_exact_steps"] == [6, 7, 8, 9, 10]
    bench = stages["bench"]
    for side in ("ours", "hf_deepspeed"):
        assert bench[side]["step_s"] > 0 and bench[side]["mfu"] > 0 and bench[side]["peak_memory_bytes"] > 0, bench
    fp8 = stages["fp8"]  # the bench's bf16 run again in FP8 (torchao's tensorwise on CPU)
    assert fp8["bf16"]["losses"] == bench["ours"]["losses"] and len(fp8["fp8"]["losses"]) == len(fp8["bf16"]["losses"])
    assert fp8["fp8"]["losses"] != fp8["bf16"]["losses"] and fp8["loss_area_gap"] < fp8["loss_area_tolerance"], fp8
    assert fp8["fp8"]["step_s"] > 0 and fp8["fp8"]["peak_memory_bytes"] > 0 and fp8["step_time_ratio"] > 0


def test_a_failed_or_hung_stage_is_recorded_and_the_suite_goes_on(tmp_path):
    python = [sys.executable, "-c"]
    ok = f"print('working'); print({RESULT_PREFIX!r} + '{{\"ok\": true, \"figure\": 3}}')"
    stages = [Stage("crashes", [*python, "raise SystemExit('no GPU driver')"], 60),
              Stage("hangs", [*python, "import time; time.sleep(60)"], 2),
              Stage("says_failed", [*python, f"print({RESULT_PREFIX!r} + '{{\"ok\": false, \"why\": 1}}')"], 60),
              # gpu_tests on the H200: 1 failed, 3 skipped (pytest's count), once reported as a skipped stage
              Stage("fails_with_skips", [*python, f"print({RESULT_PREFIX!r} + '{{\"ok\": false, \"failures\": 1, \"skipped\": 3}}')"], 60),
              Stage("passes", [*python, ok], 60)]
    summary = run_suite(tmp_path, stages, budget_s=120, dry=True)
    stages_seen = json.loads((tmp_path / "summary.json").read_text())["stages"]
    assert stages_seen == summary["stages"]
    assert stages_seen["crashes"]["status"] == "failed" and "no GPU driver" in stages_seen["crashes"]["reason"]
    assert stages_seen["hangs"]["status"] == "failed" and "timed out" in stages_seen["hangs"]["reason"]
    assert stages_seen["says_failed"]["status"] == "failed" and stages_seen["says_failed"]["why"] == 1
    assert stages_seen["passes"] == {**stages_seen["passes"], "status": "passed", "figure": 3}
    assert stages_seen["fails_with_skips"]["status"] == "failed"
    assert summary["failed"] == ["crashes", "hangs", "says_failed", "fails_with_skips"] and summary["passed"] == ["passes"]
    assert "working" in (tmp_path / "suite.log").read_text()

    spent = run_suite(tmp_path / "again", stages[-1:], budget_s=1, dry=True)  # no time left for any stage
    assert spent["skipped"] == ["passes"]
