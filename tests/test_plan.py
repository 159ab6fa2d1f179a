"""`plan` on public architectures: layouts that match well-known practice, never an invalid one.

The Llama-3-8B and Llama-3-70B config.json files are in ds_configs/models/ (the published HF
configs, written out; nothing is downloaded).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ds_oracle import oracle  # noqa: F401 - fixture
from toolkit.dsconfig import build, check
from toolkit.layouts import Layout
from toolkit.memory import GIB
from toolkit.memory.params import total_params
from toolkit.modelspec import read
from toolkit.plan import Cluster, plan

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "ds_configs" / "models"
H100 = 80 * GIB


@pytest.fixture(scope="module")
def llama8b():
    return read(MODELS / "llama-3-8b")


@pytest.fixture(scope="module")
def llama70b():
    return read(MODELS / "llama-3-70b")


@pytest.fixture(scope="module")
def plans(llama8b, llama70b):
    return {
        "8b@8": plan(llama8b, Cluster(8, H100)),
        "70b@8": plan(llama70b, Cluster(8, H100)),
        "70b@64": plan(llama70b, Cluster(64, H100)),
    }


def test_70b_full_finetune_does_not_fit_8_gpus_without_offload_and_offload_is_offered(plans, llama70b):
    """Adam in mixed precision needs ~16 bytes per parameter of model states (ZeRO paper §3):
    70.6B x 16 = 1.13 TB, more than 8 x 80 GiB = 687 GB even fully sharded with ZeRO-3."""
    assert 16 * total_params(llama70b) > 8 * H100
    p = plans["70b@8"]
    assert not p.fits_without_offload
    assert p.advice[0] == "nothing fits in 8 x 80 GiB without offload"
    assert p.ranked, "offload layouts must be offered"
    assert all(c.setup.offload_optimizer == "cpu" and c.setup.zero >= 1 for c in p.ranked)
    assert any("offload fits" in line for line in p.advice)
    # Offloading the optimizer moves its 12 bytes/param plus the 4-byte fp32 gradients to the
    # host: 16 x 70.6B = 1.13 TB per node (ZeRO-3). ZeRO-1/2 offload also keep a 16-bit copy of
    # the partition there, and ZeRO-2 accumulates gradients there: up to 20 bytes/param.
    n = total_params(llama70b)
    for c in p.ranked:
        host_per_node = c.memory.host_bytes_per_gpu * 8
        assert 16 * n * 0.99 < host_per_node < 20 * n * 1.05, c.explain(p.cluster)
        if c.setup.zero == 3 and c.setup.offload_param == "none":
            assert host_per_node == pytest.approx(16 * n, rel=0.01)
    assert any(line.startswith("more GPUs:") for line in p.advice)


def test_70b_fits_64_gpus_with_tp_4_or_more_and_zero_1_or_zero_3(plans):
    """At 64 GPUs, 1.13 TB of model states divided by TP x PP (ZeRO-1 shards the optimizer
    further over DP) or by 64 (ZeRO-3) leaves room for activations: both families must be found,
    and the best layout keeps TP inside a node."""
    p = plans["70b@64"]
    assert p.fits_without_offload
    assert not p.best.offloaded  # offload only adds host traffic when it is not needed
    assert any(c.setup.tp >= 4 and c.setup.zero == 1 for c in p.ranked)
    assert any(c.setup.zero == 3 for c in p.ranked)
    best = p.best.setup
    assert best.tp >= 4 and best.tp <= 8
    assert best.zero == 3 or best.zero <= 1 and best.tp * best.pp >= 8


def test_8b_on_one_node_needs_no_pipeline(plans, llama8b):
    """8B x 16 bytes = 128 GB of model states shard over 8 GPUs with ZeRO-2/3 (16 GB each):
    pipeline stages would only add a bubble, so the best layouts use PP = 1 and little TP."""
    p = plans["8b@8"]
    assert p.fits_without_offload
    for c in p.ranked[:5]:
        assert c.setup.pp == 1 and c.setup.tp <= 2, c.explain(p.cluster)


def test_plan_never_proposes_an_invalid_layout(plans, llama8b, llama70b, oracle):
    specs = {"8b@8": llama8b, "70b@8": llama70b, "70b@64": llama70b}
    for name, p in plans.items():
        spec = specs[name]
        for c in p.ranked:
            s = c.setup
            Layout(s.tp, s.pp).check(spec)
            assert s.tp <= p.cluster.gpus_per_node and s.gpus == s.tp * s.pp * s.dp
            assert s.pp == 1 or s.zero <= 1
            assert c.memory.gpu_bytes <= p.cluster.gpu_memory
            config = build(s, spec)
            assert oracle.accepts(config, s.dp), (name, c.explain(p.cluster))
            assert check(config, gpus=s.gpus, tp=s.tp, pp=s.pp).ok


def test_each_row_explains_its_rank(plans):
    p = plans["70b@64"]
    lines = [c.explain(p.cluster) for c in p.ranked[:10]]
    assert all("GiB" in line and "tok/s/GPU" in line and "ZeRO-" in line for line in lines)
    rates = [c.time.tokens_per_gpu_s for c in p.ranked]
    assert rates == sorted(rates, reverse=True)
    pipelined = next(c for c in p.ranked if c.setup.pp > 1)
    m, pp = pipelined.setup.micro_batches, pipelined.setup.pp
    assert pipelined.time.bubble == pytest.approx((pp - 1) / (m + pp - 1))


def test_plan_cli_shows_offload_but_writes_no_bundle_the_recipe_cannot_run(tmp_path):
    out = tmp_path / "plan-70b"
    run = subprocess.run([sys.executable, "-m", "toolkit", "plan", "--model", str(MODELS / "llama-3-70b"),
                          "--gpus", "8", "--gpu-memory", "80GiB", "--top", "3", "-o", str(out)],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2, run.stderr
    assert "nothing fits in 8 x 80 GiB without offload" in run.stdout
    assert "offload: host memory" in run.stdout  # the breakdown table of the chosen layout
    assert run.stderr.strip().splitlines() == [
        "error: only layouts with CPU offload fit 8 GPUs, and recipes/finetune.py does not offload: plan for more "
        "GPUs (16 GPUs fit without offload), a LoRA fine-tune (--lora-r R) or a shorter --seq-len"]
    assert not out.exists()


def test_plan_writes_a_bundle_only_when_given_o(tmp_path, monkeypatch, capsys):
    from toolkit.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", str(MODELS / "llama-3-8b"), "--gpus", "8", "--gpu-memory", "80GiB",
                 "--top", "1"]) == 0
    assert list(tmp_path.iterdir()) == []
    assert "wrote" not in capsys.readouterr().err
    assert main(["plan", "--model", str(MODELS / "llama-3-8b"), "--gpus", "8", "--gpu-memory", "80GiB",
                 "--top", "1", "-o", "best"]) == 0
    assert sorted(p.name for p in (tmp_path / "best").iterdir()) == ["PLAN.md", "job.sbatch", "recipe.yaml"]
    assert "deepspeed --num_gpus 8" in capsys.readouterr().err


def test_plan_prints_the_global_batch_even_when_nothing_fits(capsys):
    from toolkit.cli import main

    assert main(["plan", "--model", str(MODELS / "llama-3-70b"), "--gpus", "8", "--gpu-memory", "80GiB",
                 "--no-offload", "--top", "1"]) == 1
    out = capsys.readouterr().out
    assert "None" not in out
    assert "global batch 64 sequences" in out  # the default: 4 x GPUs, at least 64


def test_lora_makes_70b_fit_8_gpus_without_offload_where_full_finetune_does_not(plans, llama70b, capsys):
    """LoRA r=16 on every linear: the frozen 70.6B base is 2 bytes/param (141 GB, 17.6 GB per GPU
    over TP x PP = 8), the adapter (~0.2B) carries the 16 bytes/param of Adam in mixed precision."""
    from toolkit.cli import main
    from toolkit.memory.lora import LoraShape, adapter_numels

    lora = LoraShape(16)
    assert 0.1e9 < sum(adapter_numels(llama70b, lora, 1, 1)) < 0.01 * total_params(llama70b)
    with_lora = plan(llama70b, Cluster(8, H100), allow_offload=False, lora=lora)
    assert not plans["70b@8"].fits_without_offload and with_lora.fits_without_offload
    assert with_lora.advice[-1].endswith("; full fine-tuning: nothing fits")
    for c in with_lora.ranked:
        states = c.memory.peak.states
        assert states.optimizer + states.grads < 2 * GIB, c.explain(with_lora.cluster)  # the adapter's only
    assert main(["plan", "--model", str(MODELS / "llama-3-70b"), "--gpus", "8", "--gpu-memory", "80GiB",
                 "--no-offload", "--top", "1", "--lora-r", "16"]) == 0
    assert "LoRA r=16" in capsys.readouterr().out
    assert main(["memory", str(MODELS / "llama-3-70b"), "--gpus", "8", "--tp", "8", "--zero", "1", "--bf16",
                 "--gpu-memory", "80GiB", "--lora-r", "16", "--lora-targets", "q_proj", "v_proj"]) == 0
    assert main(["memory", str(MODELS / "llama-3-70b"), "--gpus", "8", "--tp", "8", "--zero", "1", "--bf16",
                 "--lora-r", "16", "--lora-targets", "qkv"]) == 2  # a name Llama does not have: one line


def test_lora_throughput_counts_no_weight_gradients_for_the_frozen_base(llama8b):
    """A frozen base skips the weight-gradient GEMMs: ~2/3 of full fine-tuning's FLOPs (plus the
    adapter's own, under 1%), and only the adapter's gradients cross DP; ZeRO-3 still gathers the base.
    A short sequence keeps attention (weightless, its backward unchanged) out of the ratio."""
    from toolkit.dsconfig import Setup
    from toolkit.memory.lora import LoraShape
    from toolkit.throughput import step_time

    lora = LoraShape(16)
    for zero in (1, 3):
        setup = Setup(gpus=8, tp=2, pp=2, zero=zero, precision="bf16", micro_batch=1, global_batch=64)
        full, adapted = (step_time(llama8b, setup, 256, "none", 8, lora=x) for x in (None, lora))
        assert 2 / 3 < adapted.compute / full.compute < 2 / 3 + 0.015, (adapted.compute, full.compute)
        assert adapted.dp_comm < (0.01 if zero == 1 else 0.7) * full.dp_comm
        assert adapted.tokens_per_gpu_s > full.tokens_per_gpu_s
    recomputed = step_time(llama8b, setup, 256, "full", 8, lora=lora).compute / adapted.compute
    assert recomputed == pytest.approx(3 / 2, rel=0.05)  # one extra forward on top of two passes


def test_a_gpu_memory_without_a_unit_is_one_line_that_names_the_fix(tmp_path, capsys):
    """`--gpu-memory 80` used to be read as 80 bytes ('nothing fits in 8 x 0 GiB'): a size without a unit is refused."""
    from toolkit.cli import main

    out = tmp_path / "plan"
    assert main(["plan", "--model", str(MODELS / "llama-3-8b"), "--gpus", "8", "--gpu-memory", "80",
                 "-o", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: '80' has no unit: write it as 80GiB (or GB, TiB, ...)"]
    assert not out.exists()
