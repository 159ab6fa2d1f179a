"""FP8 fine-tuning on the local spec against bf16, as Megatron-LM's FP8 CI judges it: the area under
the loss curve within 1%. One launch of 4 processes (TP 2 x PP 2, sequence parallelism) trains the
same tiny model from the same weights on the same batches with the recipe's pieces (toolkit.train:
model, DeepSpeed engine, schedule, step) in bf16, FP8 tensorwise and FP8 rowwise; a guard (TP rank 1's
FP8 tensors given to the GEMM without their scale) must fail the criterion.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.test_fp8 import scales_not_applied

STEPS = 100
GUARD_STEPS = 5  # the guard's curve against bf16's first 5 steps: its forward is wrong from the first step
AUC_TOLERANCE = 0.01  # Megatron-LM's FP8 CI: area under the loss curve within 1% of the reference's
TP, PP = 2, 2


def train_losses(mapping: dict, overrides: list[str], steps: int, info, rows) -> list[float]:
    """The recipe's fine-tune of `mapping` + `overrides` for `steps` steps in this launch's processes,
    with the recipe's own pieces (recipes/finetune.py steps 3-8, without checkpoints and metrics)."""
    from toolkit.train import build
    from toolkit.train.config import config_from_mapping
    from toolkit.train.loss import padded_vocab_mask
    from toolkit.train.parallel import build_engine, mark_tied_output_replica, sum_partial_grads_over_tp
    from toolkit.train.schedule import LRSchedule
    from toolkit.train.step import StepContext, train_step

    cfg = config_from_mapping(mapping, [*overrides, f"steps={steps}"])
    meta = build.read_checkpoint_meta(cfg)  # the FP8 checks (toolkit.fp8.recipes) run here
    spec = meta.model_spec
    model, layout = build.build_model(meta, cfg)
    mark_tied_output_replica(model, spec.tied_embeddings)
    sum_partial_grads_over_tp(model)
    train_data, _, _ = build.build_data(cfg, info, rows)
    engine = build_engine(model, cfg, build.ds_config(cfg, spec, info.dp), LRSchedule.from_config(cfg))
    vocab_mask = padded_vocab_mask(spec.vocab_size, layout.padded_vocab(spec.vocab_size), TP, info.tp_rank, info.device)
    losses = []
    for _ in range(steps):
        batches = train_data.next_global_batch()
        counts = train_data.last_counts
        ctx = StepContext(len(batches), info.dp, counts.loss_tokens, vocab_mask, cfg.data.seq_len, cfg.micro_batch,
                          counts.real_tokens, spec.is_moe, cfg.parallel.sequence_parallel)
        loss, _, _ = train_step(engine, model, batches, ctx, spec.tied_embeddings)
        losses.append(loss)
    engine.destroy()
    return losses


def fp8_against_bf16(mapping: dict) -> dict:
    """Worker (TP x PP ranks): each case's loss curve and seconds."""
    from toolkit.runtime.distributed import init_parallel
    from toolkit.train import recipe_data
    from toolkit.train.config import config_from_mapping

    info = init_parallel(TP, PP, mapping["seed"])
    cfg = config_from_mapping(mapping)
    rows = recipe_data.read_data(cfg, recipe_data.load_tokenizer(cfg))  # once: every case reads the same rows
    cases = {"bf16": (["precision=bf16"], STEPS, None),
             "tensorwise": (["precision=fp8", "fp8.recipe=tensorwise"], STEPS, None),
             "rowwise": (["precision=fp8", "fp8.recipe=rowwise"], STEPS, None),
             "tensorwise, TP rank 1's scales not applied": (["precision=fp8", "fp8.recipe=tensorwise"], GUARD_STEPS, {1})}
    out = {}
    for name, (overrides, steps, guard_ranks) in cases.items():
        began = time.perf_counter()
        if guard_ranks is None:
            losses = train_losses(mapping, overrides, steps, info, rows)
        else:
            with scales_not_applied(guard_ranks):
                losses = train_losses(mapping, overrides, steps, info, rows)
        out[name] = {"losses": losses, "seconds": time.perf_counter() - began}
    return out


def area(losses: list[float]) -> float:
    return float(sum(losses))  # steps are one apart: the rectangle rule Megatron-LM's check sums


@pytest.mark.multiprocess
def test_fp8_fine_tune_at_tp2_pp2_matches_bf16_area_under_the_loss_curve(tmp_path):
    """100 steps at TP 2 x PP 2 with sequence parallelism: tensorwise and rowwise within 1% of bf16's
    area under the loss curve (and not equal to it: FP8 ran); a TP rank's scales not applied fails it."""
    from tests.finetune_harness import recipe, write_uneven_data
    from toolkit.convert import hf_to_megatron
    from toolkit.runtime.launch import run_on_processes
    from toolkit.tinymodels import make_tiny_model

    hf = make_tiny_model("llama", tmp_path / "hf", dtype="float32", num_hidden_layers=2)
    checkpoint = hf_to_megatron(hf, tmp_path / "mc", progress=False)
    path = recipe(tmp_path, checkpoint, write_uneven_data(tmp_path / "data.jsonl", 96),
                  parallel__tp=TP, parallel__pp=PP, parallel__sequence_parallel=True, data__seq_len=32,
                  optim__lr=3e-3, micro_batch=4, global_batch=8, precision="bf16")
    import yaml

    mapping = yaml.safe_load(path.read_text())
    mapping["seed"] = 1234
    results = run_on_processes("tests.test_fp8_training:fp8_against_bf16", TP * PP, mapping, cpu=True, timeout=1500)[0]
    bf16 = results["bf16"]["losses"]
    for name, r in results.items():
        steps = len(r["losses"])
        gap = abs(area(r["losses"]) - area(bf16[:steps])) / area(bf16[:steps])
        r["gap"] = gap
        print(f"{name}: {steps} steps in {r['seconds']:.0f} s, loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}, "
              f"area {area(r['losses']):.3f} vs bf16 {area(bf16[:steps]):.3f}: {100 * gap:.3f}%")
    assert bf16[-1] < 0.7 * bf16[0], bf16  # the run learns, so the curve has an area worth comparing
    for recipe_name in ("tensorwise", "rowwise"):
        r = results[recipe_name]
        assert r["gap"] < AUC_TOLERANCE, (recipe_name, r["gap"])
        assert max(abs(a - b) for a, b in zip(r["losses"], bf16)) > 1e-4, recipe_name  # FP8 math ran
    guard = results["tensorwise, TP rank 1's scales not applied"]
    assert not guard["gap"] < AUC_TOLERANCE, guard["gap"]
    assert torch.isfinite(torch.tensor(results["tensorwise"]["losses"])).all()
