"""PyTorch FSDP2 as the data-parallel engine (parallel.dp_engine=fsdp, toolkit.train.fsdp), with
megatron-core's TP: proven against the single-process HF reference (tests/finetune_harness.py) at
DP2 and TP2 x DP2, resumed exactly through torch.distributed.checkpoint, exported to HF; guarded:
torch's clip_grad_norm_ over the DTensor gradients (a norm over DP only) misses the reference."""

from __future__ import annotations

import pytest

from tests.finetune_harness import (GRAD_NORM_TOLERANCE, GRAD_NORM_TOLERANCE_BF16, LOSS_TOLERANCE_BF16, STEPS,
                                    assert_refused_in_one_line, compare_with_reference, launch, parity_setup, read_metrics,
                                    recipe)
from toolkit.errors import ConfigError

MODELS = {"untied": "llama-odd-vocab", "qwen3": "qwen3"}
FSDP = {"pp": 1, "dp_engine": "fsdp"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return parity_setup(tmp_path_factory.mktemp("fsdp"), MODELS)


@pytest.mark.multiprocess
def test_fsdp_dp2_matches_reference_and_resumes_exactly(setup, tmp_path):
    """fp32 at DP2 within the ZeRO parity tolerances; then a run resumed from step 5's
    torch.distributed.checkpoint repeats steps 6-10 bit for bit."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    straight = compare_with_reference(setup, tmp_path / "a", 2, "untied", parallel={"tp": 1, **FSDP}, save_every=5)
    step5 = tmp_path / "a" / "run" / "checkpoints" / "step_0000005"
    assert (step5 / "fsdp" / "tp_00" / ".metadata").is_file() and not (step5 / "ds").exists()
    _, data, models, _ = setup
    cfg = recipe(tmp_path / "b", models["untied"][1], data, parallel={"tp": 1, **FSDP})
    launch(2, cfg, f"resume={step5}")
    resumed = read_metrics(tmp_path / "b" / "run")
    assert [m["step"] for m in resumed] == list(range(6, STEPS + 1))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in straight[5:]]
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in straight[5:]]
    # the engines' checkpoints do not cross: a DeepSpeed run (or another FSDP layout) is refused in one line
    from toolkit.convert.metadata import CheckpointMeta
    from toolkit.train.checkpoint import CheckpointError, check_resumable
    from toolkit.train.checkpoint_verify import intact

    meta = CheckpointMeta.read(models["untied"][1])
    for layout in ({"tp": 1, "pp": 1, "dp": 2, "zero_stage": 1}, {"tp": 1, "pp": 1, "dp": 4, "zero_stage": None,
                                                                  "dp_engine": "fsdp"}):
        with pytest.raises(CheckpointError, match="across the DeepSpeed and FSDP engines") as refused:
            check_resumable(intact(step5), layout, None, meta, 16)
        assert "\n" not in str(refused.value)


@pytest.mark.multiprocess
def test_fsdp_tp2_dp2_sequence_parallel_qk_norms_match_reference_and_export(setup, tmp_path):
    """TP-sharded and TP-replicated parameters, q/k norms and sequence-parallel norms (gradients
    partial over TP), exported to an HF model from_pretrained loads."""
    import torch
    from transformers import AutoModelForCausalLM

    compare_with_reference(setup, tmp_path, 4, "qwen3", parallel={"tp": 2, "sequence_parallel": True, **FSDP},
                           export_hf=True)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(setup[2]["qwen3"][0], dtype=torch.float32)
    trained = "model.layers.3.self_attn.q_norm.weight"
    assert not torch.equal(exported.state_dict()[trained], original.state_dict()[trained])


@pytest.mark.multiprocess
def test_fsdp_bf16_mixed_precision_with_full_recompute_stays_close_to_reference(setup, tmp_path):
    """bf16 parameters in compute, fp32 masters and reduction; megatron-core's full recompute runs
    each layer's forward again inside FSDP's backward."""
    compare_with_reference(setup, tmp_path, 2, "untied", LOSS_TOLERANCE_BF16, norm_tolerance=GRAD_NORM_TOLERANCE_BF16,
                           precision="bf16", parallel={"tp": 1, "recompute": "full", **FSDP})


@pytest.mark.multiprocess
def test_grad_norm_without_the_tp_sum_misses_the_reference(setup, tmp_path):
    """Guard: the grad norm of tests/recipe_fsdp_naive_norm.py (clip_grad_norm_'s, over DP only) is off."""
    from pathlib import Path

    _, data, models, reference = setup
    cfg = recipe(tmp_path, models["qwen3"][1], data, parallel={"tp": 2, **FSDP}, steps=2)
    launch(4, cfg, script=Path(__file__).parent / "recipe_fsdp_naive_norm.py")
    norms = [m["grad_norm"] for m in read_metrics(tmp_path / "run")]
    _, ref_norms = reference("qwen3", cfg)
    off = abs(norms[0] - ref_norms[0]) / max(1.0, ref_norms[0])
    print(f"norm over DP only: grad norm relative error {off:.1e}")
    assert off > 10 * GRAD_NORM_TOLERANCE, (norms, ref_norms)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.dp_engine=fsdp", "parallel.pp=2"], "FSDP is offered at PP = 1 only"),
        (["parallel.dp_engine=fsdp", "precision=fp16"], "use bf16"),
        (["parallel.dp_engine=fsdp", "peft.enabled=true"], "LoRA"),
    ],
)
def test_fsdp_bad_input_refused_in_one_line(tmp_path, overrides, message):
    assert_refused_in_one_line(tmp_path, overrides, message)


def test_memory_and_plan_know_the_fsdp_rules():
    """`toolkit memory` / `plan` (the library calls under them) refuse what the recipe refuses,
    and plan's FSDP layouts are PP 1 without offload."""
    from tests.workers_memory import tiny_spec
    from toolkit.dsconfig import Setup
    from toolkit.memory import GIB, estimate
    from toolkit.plan import Cluster, plan

    spec = tiny_spec()
    for setup, message in ((Setup(gpus=4, pp=2, zero=1), "PP = 1 only"), (Setup(gpus=4, precision="fp16", zero=3), "bf16")):
        with pytest.raises(ConfigError, match=message):
            estimate(spec, setup, 32, dp_engine="fsdp")
    with pytest.raises(ConfigError, match="MoE"):
        estimate(tiny_spec(variant="mixtral"), Setup(gpus=4, zero=3), 32, dp_engine="fsdp")
    result = plan(spec, Cluster(4, 4 * GIB), 32, dp_engine="fsdp")
    assert result.ranked and all(c.setup.pp == 1 and not c.offloaded and c.memory.dp_engine == "fsdp" for c in result.ranked)
    assert "FSDP" in result.best.explain(result.cluster)
