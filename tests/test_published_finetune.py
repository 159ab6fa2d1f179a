"""Fine-tuning checkpoints as published (issue 24) at TP2 x PP2 x DP2 (x EP2) against the HF
reference, exported back to a checkpoint from_pretrained loads: LongRoPE past its switch point
(Phi-3, original_max_position_embeddings 16 < seq_len 24) and Qwen3-MoE with mlp_only_layers.
The Gemma 3 wrapper (Gemma3ForConditionalGeneration) fine-tunes at TP2 x PP2 x DP2 in
tests/test_finetune_parity.py, in the launch that was the Gemma 3 text model's, and is exported back
into the wrapper there."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.finetune_harness import (GRAD_NORM_TOLERANCE, LOSS_TOLERANCE_FP32, STEPS, differences, hf_reference, launch,
                                    read_metrics, recipe, write_uneven_data)
from tests.test_moe_finetune import (EXPERT_TOLERANCE, assert_routed_as_the_reference, expert_errors, hf_state, moe_setup,
                                     run, trained)
from toolkit.convert import hf_to_megatron


def padded_micro_batch_loss(pad_id: int):
    """tests.finetune_harness.hf_reference's `step_loss`: the trainer's micro-batches padded to seq_len,
    one forward each. LongRoPE picks its factors by the input's length, so the reference must see
    the padded length the trainer runs (an unpadded document of 16 tokens or fewer would get the
    short factors)."""

    def step_loss(model, global_rows, cfg, device):
        seq_len, micro = cfg["data"]["seq_len"], cfg["micro_batch"]
        total, count = 0.0, 0
        for i in range(0, len(global_rows), micro):
            tokens, masks = zip(*(row[0] for row in global_rows[i:i + micro]))
            ids = torch.tensor([t + [pad_id] * (seq_len + 1 - len(t)) for t in tokens], device=device)
            mask = torch.tensor([m + [0] * (seq_len + 1 - len(m)) for m in masks], dtype=torch.float32, device=device)
            logits = model(input_ids=ids[:, :-1]).logits.float()
            token_loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
            total = total + (token_loss * mask[:, 1:].flatten()).sum()
            count += int(mask[:, 1:].sum())
        return total / count, total / count

    return step_loss


@pytest.mark.multiprocess
def test_longrope_fine_tune_at_tp2_pp2_dp2_matches_hf_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.tinymodels import make_tiny_model

    hf = make_tiny_model("phi3-longrope", tmp_path / "hf", dtype="float32", num_hidden_layers=4, vocab_size=250)
    data = write_uneven_data(tmp_path / "data.jsonl", 300)
    cfg = recipe(tmp_path, hf_to_megatron(hf, tmp_path / "mc", fmt="torch_dist", progress=False), data,
                 parallel={"tp": 2, "pp": 2, "zero_stage": 1}, export_hf=True)
    assert cfg.read_text().count("seq_len: 24")  # past original_max_position_embeddings (16)
    launch(8, cfg)
    metrics = read_metrics(tmp_path / "run")
    losses, norms = hf_reference(hf, data, cfg, STEPS, step_loss=padded_micro_batch_loss(
        AutoTokenizer.from_pretrained(hf).pad_token_id))
    loss, norm = differences(metrics, losses, norms)
    assert loss < LOSS_TOLERANCE_FP32 and norm < GRAD_NORM_TOLERANCE, (loss, norm)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", dtype=torch.float32)
    assert exported.config.rope_parameters["rope_type"] == "longrope"
    key = "model.layers.3.self_attn.qkv_proj.weight"
    assert not torch.equal(exported.state_dict()[key], AutoModelForCausalLM.from_pretrained(hf).state_dict()[key])


@pytest.mark.multiprocess
def test_qwen3_moe_with_mlp_only_layers_fine_tunes_at_tp2_pp2_dp2_ep2_as_hf(tmp_path, monkeypatch):
    """Layers 0 and 2 dense, so each PP 2 stage holds a dense and a MoE layer: routed (in fp64, as the
    harness routes) as the reference at every step, every expert and router row trained as the
    reference's, the dense MLPs trained."""
    from transformers import AutoModelForCausalLM

    from toolkit import tinymodels

    monkeypatch.setitem(tinymodels.VARIANTS, "qwen3-moe-dense-0-2",
                        ("Qwen3MoeConfig", {**tinymodels.QWEN3_MOE, "mlp_only_layers": [0, 2]}))
    (tmp_path / "model").mkdir()
    setup = moe_setup(tmp_path / "model", "qwen3-moe-dense-0-2")
    cfg, metrics = run(setup, tmp_path, 8, {"zero_stage": 1, "tp": 2, "pp": 2, "ep": 2, "sequence_parallel": True},
                       export_hf=True)
    reference = setup[3](cfg)
    # the run logs a row per layer (zeros on the dense ones), the reference one per MoE layer
    assert all(not any(m["tokens_per_expert"][i]) for m in metrics for i in (0, 2))
    assert_routed_as_the_reference([{**m, "tokens_per_expert": [m["tokens_per_expert"][i] for i in (1, 3)]}
                                    for m in metrics], reference)
    loss, norm = differences(metrics, *reference[:2])
    assert loss < LOSS_TOLERANCE_FP32 and norm < GRAD_NORM_TOLERANCE, (loss, norm)
    errors = expert_errors(setup[0], tmp_path / "run", reference[2][STEPS])  # 2 MoE layers x 3 tensors x 8 experts
    assert len(errors) == 2 * 3 * 8 and max(errors.values()) < EXPERT_TOLERANCE, max(errors.items(), key=lambda e: e[1])
    before, after = hf_state(setup[0]), hf_state(tmp_path / "run" / "hf")
    dense = [n for n in before if n.startswith(("model.layers.0.mlp.", "model.layers.2.mlp."))]
    assert len(dense) == 6 and all(trained(before[n], after[n], False) for n in dense)
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf")).__name__ == "Qwen3MoeForCausalLM"
