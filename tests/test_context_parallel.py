"""Context parallelism (parallel.cp): the sequence split zig-zag over CP ranks, megatron-core's RoPE
chunks, the toolkit's all-gather attention on the local spec, gradients over DP x CP.

Proven against the single-process HF reference (tests/finetune_harness.py; 10 steps, fp32) at
sequences of 62 tokens padded to 64 (2·CP chunks of 16, documents crossing chunk boundaries):
CP2 on Gemma 3's sliding windows, CP2 x DP2 packed, TP2 x CP2 with sequence parallelism and full
recompute (Qwen3's q/k norms), PP2 x CP2 packed (MoE under CP: tests/test_moe_finetune.py).
Guarded: RoPE positions that start at 0 on every CP rank, a loss averaged over CP instead of
summed, and the window dropped under CP, each fail it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.finetune_harness import (GRAD_NORM_TOLERANCE, LOSS_TOLERANCE_FP32, REPO, assert_refused_in_one_line,
                                    compare_with_reference, differences, hf_eval_loss_after_training, launch,
                                    parity_setup, read_metrics, recipe, recipe_config, run_against_reference,
                                    write_uneven_data)
from toolkit.blocks import context_parallel as cpl
from toolkit.errors import ConfigError

MODELS = {"untied": "llama-odd-vocab", "qwen3": "qwen3", "gemma3": "gemma3"}
# 62 tokens: not a multiple of 2·CP (padded to 64), long enough for several documents per packed row
LONG = {"data__seq_len": 62, "global_batch": 8}


# (processes, model, parallel.*, packed) of each launch; every one at CP 2 over 4 chunks of 16 tokens
LAYOUTS = {
    "CP2xDP2-zero2-packed": (4, "untied", {"cp": 2, "zero_stage": 2}, True),
    "TP2xCP2-SP-recompute-qwen3": (4, "qwen3", {"cp": 2, "tp": 2, "sequence_parallel": True, "recompute": "full"}, False),
    "PP2xCP2-packed": (4, "untied", {"cp": 2, "pp": 2}, True),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return parity_setup(tmp_path_factory.mktemp("cp"), MODELS)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_matches_hf_reference(setup, tmp_path, layout):
    nprocs, model, parallel, pack = LAYOUTS[layout]
    compare_with_reference(setup, tmp_path, nprocs, model, pack=pack, parallel=parallel, **LONG)


def _resume(tmp_path, name: str, saved, setup, nprocs: int, parallel: dict) -> list[dict]:
    """Steps 6-10 from a copy of the step-5 checkpoint `saved`, on `parallel`."""
    import shutil

    _, data, models, _ = setup
    checkpoints = tmp_path / name / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    shutil.copytree(saved, checkpoints / saved.name)
    (checkpoints / "latest").write_text(saved.name)
    launch(nprocs, recipe(tmp_path / name, models[WINDOWED][1], data, parallel=parallel, **LONG), "resume=auto")
    return read_metrics(tmp_path / name / "run")


# Gemma 3: windows of 8 on every other layer (each with its own RoPE base), so windows reach back
# across chunk boundaries (chunks of 16) onto the other CP rank's chunks
WINDOWED = "gemma3"


@pytest.mark.multiprocess
def test_cp2_with_sliding_windows_matches_reference_resumes_bit_exact_and_at_cp1_from_the_layout_independent_state(
        setup, tmp_path):
    """CP2 unpacked on Gemma 3's sliding windows (one launch doubling as a parity case), saved at
    step 5; resumed at CP2 its steps 6-10 are bit-identical to the uninterrupted run's, and at DP2
    without CP (DeepSpeed's files unusable: another DP group) they continue from the
    layout-independent state within 1e-6. The eval loss at the last step, over a validation set split
    over CP like the training batches, is the HF reference's after the same 10 steps within 1e-5."""
    _, data, models, reference = setup
    (tmp_path / "straight").mkdir()
    valid = write_uneven_data(tmp_path / "valid.jsonl", 16, seed=1)
    cfg = recipe(tmp_path / "straight", models[WINDOWED][1], data, parallel={"cp": 2}, save_every=5,
                 data__valid_file=str(valid), **LONG)
    launch(2, cfg)
    straight = read_metrics(tmp_path / "straight" / "run")
    loss, norm = differences(straight, *reference(WINDOWED, cfg))
    print(f"CP2 {WINDOWED}: max |loss - reference| {loss:.1e}, grad norm relative {norm:.1e}")
    assert loss < LOSS_TOLERANCE_FP32 and norm < GRAD_NORM_TOLERANCE, (loss, norm)
    evaluated = hf_eval_loss_after_training(models[WINDOWED][0], data, valid, cfg)
    print(f"CP2 {WINDOWED}: eval loss {straight[-1]['eval_loss']:.7f}, reference {evaluated:.7f}")
    assert [m["step"] for m in straight if "eval_loss" in m] == [10]
    assert abs(straight[-1]["eval_loss"] - evaluated) < LOSS_TOLERANCE_FP32, (straight[-1]["eval_loss"], evaluated)
    saved = tmp_path / "straight" / "run" / "checkpoints" / "step_0000005"
    same = _resume(tmp_path, "cp2", saved, setup, 2, {"cp": 2})
    assert [(m["step"], m["loss"], m["grad_norm"]) for m in same] == \
        [(m["step"], m["loss"], m["grad_norm"]) for m in straight[5:]]
    other = _resume(tmp_path, "dp2", saved, setup, 2, {"cp": 1})
    assert [m["step"] for m in other] == list(range(6, 11))
    worst = max(max(abs(a[k] - b[k]) / abs(b[k]) for k in ("loss", "grad_norm")) for a, b in zip(other, straight[5:]))
    print(f"CP2 -> DP2 resume: max relative difference steps 6-10 {worst:.1e}")
    assert worst < 1e-5, worst


# defect -> the model of its CP2 launch
GUARDED = {"cp-positions-from-zero": "untied", "cp-loss-mean": "untied", "cp-window-dropped": WINDOWED}


@pytest.mark.multiprocess
@pytest.mark.parametrize("defect", list(GUARDED))
def test_guard_context_parallel_defects_fail_the_reference(setup, tmp_path, defect):
    """Guard: a CP2 case above for 3 steps with one defect (tests/recipe_with_defect.py). RoPE
    positions from 0 on each rank change every loss; a loss averaged over CP halves the gradients
    (the gradient norm is 0.5 off, the losses Adam and clipping partly hide); Gemma 3's windowed
    layers attending to the whole causal past under CP change every loss, and the eval loss at the
    end (the eval comparison of the windowed test above fails with it)."""
    _, data, models, _ = setup
    valid = write_uneven_data(tmp_path / "valid.jsonl", 16, seed=1) if defect == "cp-window-dropped" else None
    metrics, loss, norm = run_against_reference(setup, tmp_path, 2, GUARDED[defect], parallel={"cp": 2}, steps=3,
                                                script=REPO / "tests" / "recipe_with_defect.py", env={"DEFECT": defect},
                                                **LONG, **({"data__valid_file": str(valid)} if valid else {}))
    print(f"{defect}: max |loss - reference| {loss:.1e}, grad norm relative {norm:.1e}")
    if defect == "cp-loss-mean":  # measured: losses 8.4e-7 (hidden), gradient norm 0.50 relative
        assert norm > 0.3, (loss, norm)
    else:  # measured over 3 steps: positions 4.7e-5 and 2.7e-4; window 2.3e-2 and 0.30
        assert loss > LOSS_TOLERANCE_FP32 and norm > GRAD_NORM_TOLERANCE, (loss, norm)
    if valid is not None:
        evaluated = hf_eval_loss_after_training(models[WINDOWED][0], data, valid, tmp_path / "recipe.yaml")
        print(f"{defect}: eval loss {metrics[-1]['eval_loss']:.7f}, reference {evaluated:.7f}")
        assert abs(metrics[-1]["eval_loss"] - evaluated) > LOSS_TOLERANCE_FP32, (metrics[-1]["eval_loss"], evaluated)


def _packed_batch(seq_len: int = 62, rows: int = 3):
    """Collated packed rows of the test data (toolkit.train.data), as the recipe makes them."""
    from tests.finetune_harness import write_uneven_data
    from toolkit.train.data import Sample, collate, pack_rows

    import json
    import tempfile
    from pathlib import Path

    path = write_uneven_data(Path(tempfile.mkdtemp()) / "d.jsonl", 40)
    samples = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        p, a = [ord(c) for c in r["prompt"]], [ord(c) for c in r["response"]] + [1]
        samples.append(Sample(p + a, [0] * len(p) + [1] * len(a)))
    return collate(pack_rows(samples, seq_len + 1, 0)[:rows], packed=True)


@pytest.mark.parametrize("cp", [2, 4])
def test_split_keeps_every_token_once_with_its_position_and_mask(cp):
    """The data loader's part of CP: padded to the split's multiple (never a token dropped), each
    rank's chunks at the right global positions, its queries' mask over the gathered keys that of
    the whole row, and documents that do cross chunk boundaries (so the parity tests test that)."""
    batch = _packed_batch()
    length = cpl.padded_length(62, cp)
    assert length % (2 * cp) == 0 and 62 <= length < 62 + 2 * cp
    padded = cpl.pad_batch(batch, length)
    assert padded["loss_mask"].sum() == batch["loss_mask"].sum()
    parts = [cpl.split_batch(padded, cp, r) for r in range(cp)]
    positions = torch.cat([p["positions"][0] for p in parts])
    assert sorted(positions.tolist()) == list(range(length))  # every position on exactly one rank
    keys = cpl.gathered_positions(length, cp)
    assert torch.equal(positions, keys)  # the all-gather's order is the ranks' order
    for part in parts:
        q = part["positions"][0]
        assert torch.equal(part["tokens"], padded["tokens"][:, q])
        assert torch.equal(part["loss_mask"], padded["loss_mask"][:, q])
        assert torch.equal(part["attention_mask"], padded["attention_mask"][:, :, q][:, :, :, keys])
    assert sum(p["loss_mask"].sum() for p in parts) == batch["loss_mask"].sum()
    # a document crossing from one chunk to the next: the same document on both sides of a boundary
    same_doc = ~batch["attention_mask"][0, 0]
    chunk = length // (2 * cp)
    crossing = [b for b in range(chunk, 62, chunk) if same_doc[b, b - 1]]
    assert crossing, "no document crosses a chunk boundary in this data"


def test_causal_mask_is_over_global_positions():
    """Rank 0 of CP 2 on 8 tokens holds positions 0,1 and 6,7; the keys come as 0,1,6,7,2,3,4,5."""
    mask = cpl.causal_mask(8, 2, 0)
    assert cpl.chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cpl.gathered_positions(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert (~mask[0]).tolist() == [True, False, False, False, False, False, False, False]
    assert (~mask[2]).tolist() == [True, True, True, False, True, True, True, True]


def test_local_spec_gets_the_toolkits_attention_and_te_keeps_its_own(monkeypatch):
    """The local spec's DotProductAttention (which asserts CP 1) is replaced, also in a block spec
    (the families' own); on the Transformer Engine spec (stood in for: TE cannot be imported here) TE's
    attention stays and the TransformerConfig built with the GPU flags carries CP 2 and the ring."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from tests.test_cuda_shaped import cuda_present
    from tests.workers_memory import tiny_spec
    from toolkit import model
    from toolkit.layouts import Layout
    from toolkit.train.build import model_config

    cfg = recipe_config_for(["parallel.cp=2", "precision=bf16"])
    config, _ = model_config(tiny_spec(), cfg, Layout(1, 1), "local")
    built = model.layer_spec_module("local", config, tiny_spec())
    assert built.submodules.self_attention.submodules.core_attention is cpl.ContextParallelAttention
    block = cpl.with_context_parallel_attention(TransformerBlockSubmodules(layer_specs=[gpt_layer_specs.get_gpt_layer_local_spec()] * 2))
    assert {s.submodules.self_attention.submodules.core_attention for s in block.layer_specs} == {cpl.ContextParallelAttention}

    cuda_present(monkeypatch)
    te_spec = object()  # Transformer Engine's layer spec cannot be built without TE
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", lambda **_: te_spec)
    config, _ = model_config(tiny_spec(), cfg, Layout(1, 1), "te")
    assert not config.use_cpu_initialization and config.bias_dropout_fusion  # the GPU flags are on
    assert (config.context_parallel_size, config.cp_comm_type) == (2, "p2p")
    assert model.layer_spec_module("te", config, tiny_spec()) is te_spec



def recipe_config_for(overrides):
    import tempfile
    from pathlib import Path

    return recipe_config(Path(tempfile.mkdtemp()), overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.cp=2", "parallel.vpp=2", "parallel.pp=2"], "parallel.cp=2 with parallel.vpp=2"),
        (["parallel.cp=2", "parallel.dp_engine=fsdp"], "parallel.cp=2 with parallel.dp_engine=fsdp"),
        (["parallel.cp=2", "peft.enabled=true"], "parallel.cp=2 with peft.enabled"),
        (["parallel.cp=2", "wandb.sample_generations=2"], "parallel.cp=2 with wandb.sample_generations"),
    ],
)
def test_context_parallel_bad_input_refused_in_one_line(tmp_path, overrides, message):
    assert_refused_in_one_line(tmp_path, overrides, message)


def test_longrope_under_cp_is_refused_and_windows_and_experts_are_not_on_the_local_spec():
    from tests.workers_memory import tiny_spec
    from toolkit.train.build import check_context_parallel_family

    cfg = recipe_config_for(["parallel.cp=2"])
    with pytest.raises(ConfigError, match="LongRoPE") as refused:
        check_context_parallel_family(cfg, dataclasses.replace(tiny_spec(), longrope={"short_factor": [1.0]}))
    assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match="gated delta net layers") as refused:  # Qwen3-Next: a state along the sequence
        check_context_parallel_family(cfg, dataclasses.replace(tiny_spec(), linear_layers="1110"))
    assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match="Mamba-2 layers"):  # Nemotron-H: the scan's state along the sequence
        check_context_parallel_family(cfg, dataclasses.replace(tiny_spec(), linear_layers="M*-M", mamba={"heads": 4}))
    check_context_parallel_family(cfg, dataclasses.replace(tiny_spec(), window_size=8, num_experts=4))
    check_context_parallel_family(cfg, dataclasses.replace(tiny_spec(), linear_layers="0000"))


@pytest.mark.parametrize("overrides, change, message", [
    (["data.pack=true"], {}, "data.pack=true on the Transformer Engine spec"),  # TE's CP attention: causal mask only
    ([], {"window_size": 8}, "sliding-window attention on the Transformer Engine spec"),  # TE's ring: no window
])
def test_te_spec_refuses_packing_and_sliding_windows_under_cp(monkeypatch, overrides, change, message):
    """On the Transformer Engine spec (CUDA-shaped: the spec choice stood in for, TE cannot run
    here) TE's ring attention does CP: packed rows would attend across documents, and its p2p
    ring asserts it takes no window; each refused in one line, before any process group."""
    from tests.workers_memory import tiny_spec
    from toolkit import model
    from toolkit.train.build import check_context_parallel_family

    monkeypatch.setattr(model, "running_layer_spec", lambda: "te")
    with pytest.raises(ConfigError, match=message) as refused:
        check_context_parallel_family(recipe_config_for(["parallel.cp=2", *overrides]),
                                      dataclasses.replace(tiny_spec(), **change))
    assert "\n" not in str(refused.value)
    check_context_parallel_family(recipe_config_for(["parallel.cp=2"]), tiny_spec())  # unpacked, no window: TE's own CP


def test_sliding_window_mask_is_over_global_positions():
    """A window of 3 (megatron-core's (2, 0)) on 8 tokens at CP 2: rank 1 holds positions 2,3,4,5;
    position 4 sees keys 2,3,4 of the gathered 0,1,6,7,2,3,4,5, the first from the other rank's
    chunk; every rank's rows are those of the whole sequence's banded mask."""
    mask = cpl.causal_mask(8, 2, 1, window=(2, 0))
    assert (~mask[2]).tolist() == [False, False, False, False, True, True, True, False]
    whole = torch.ones(8, 8, dtype=torch.bool).triu(1) | torch.ones(8, 8, dtype=torch.bool).tril(-3)
    keys = cpl.gathered_positions(8, 2)
    for rank in range(2):
        assert torch.equal(cpl.causal_mask(8, 2, rank, window=(2, 0)), whole[cpl.chunk_positions(8, 2, rank)][:, keys])


def test_experts_are_carved_out_of_cp_x_dp():
    """EP 2 at TP2 x CP2 on 4 processes (DP 1): megatron-core's expert groups span CP x DP, so an EP
    group holds a sequence's chunks (tests/test_moe_finetune.py runs it); EP 4 there does not fit."""
    from toolkit.train.build import check_expert_layout, data_parallel_size

    cfg = recipe_config_for(["parallel.cp=2", "parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true"])
    check_expert_layout(cfg, data_parallel_size(cfg, 4), "mixtral")
    cfg = recipe_config_for(["parallel.cp=2", "parallel.tp=2", "parallel.ep=4", "parallel.sequence_parallel=true"])
    with pytest.raises(ConfigError, match=r"TP x CP x DP = 2 x 2 x 1 .*EP must divide CP x DP \(2\)"):
        check_expert_layout(cfg, data_parallel_size(cfg, 4), "mixtral")


def test_world_size_must_divide_by_tp_pp_cp():
    from toolkit.train.build import data_parallel_size

    cfg = recipe_config_for(["parallel.cp=2", "parallel.tp=2"])
    assert data_parallel_size(cfg, 8) == 2
    with pytest.raises(ConfigError, match=r"not divisible by TP\*PP\*CP = 2\*1\*2.*8 \(DP 2\)"):
        data_parallel_size(cfg, 6)


def test_plan_finds_context_parallel_layouts_for_llama_3_1_8b_at_65536_tokens():
    """8 x 80 GiB, 65,536 tokens: without CP only full-recompute layouts fit (the whole sequence's
    activations on each rank); with CP, layouts without recompute fit and rank first (faster)."""
    from pathlib import Path

    import toolkit.plan as planner
    from toolkit.memory import GIB
    from toolkit.modelspec import read

    spec = read(Path(REPO) / "ds_configs" / "models" / "llama-3.1-8b")
    cluster = planner.Cluster(8, 80 * GIB)
    with_cp = planner.plan(spec, cluster, 65536, allow_offload=False)
    best = with_cp.best
    print(best.explain(cluster))
    assert best.memory.cp > 1 and best.recompute != "full"
    assert any(c.memory.cp > 1 and c.recompute == "none" for c in with_cp.ranked)
    without = [c for c in with_cp.ranked if c.memory.cp == 1]
    assert without and all(c.recompute == "full" for c in without)
    assert best.time.tokens_per_gpu_s > max(c.time.tokens_per_gpu_s for c in without)
    assert planner.context_parallel_sizes(spec, 4096, 8) == [1]  # short sequences: not enumerated


def test_plan_without_full_recompute_finds_llama_3_1_8b_at_65536_tokens_a_cp_layout_and_none_without(capsys):
    """The recipe runs without recompute unless asked (parallel.recompute), and full recompute costs a
    second forward pass: limited to none / selective, `toolkit plan` finds no layout without CP on 8 x 80 GiB
    (each rank holds the whole sequence's activations: 120 GiB at TP8), and with CP it finds TP2 x CP4.
    The narrowed search says what the full one finds."""
    from toolkit.cli import main

    common = ["plan", "--model", str(Path(REPO) / "ds_configs" / "models" / "llama-3.1-8b"), "--gpus", "8",
              "--gpu-memory", "80GiB", "--seq-len", "65536", "--no-offload", "--recompute", "none", "selective"]
    assert main([*common, "--max-cp", "1"]) == 1
    out = capsys.readouterr().out
    assert "nothing fits in 8 x 80 GiB without offload" in out and "CP" not in out.split("note: without the limits")[0]
    assert "note: without the limits (recompute none/selective, CP <= 1)" in out and "CP4 (DP1 x CP4)" in out
    assert main(common) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[1]
    assert first.startswith("  1. ") and "CP4 (DP1 x CP4)" in first and "recompute none" in first, out
    assert "recompute full" not in out


def test_plan_refuses_an_empty_recompute_list_or_a_cp_limit_below_one():
    import toolkit.plan as planner
    from toolkit.errors import ConfigError
    from toolkit.memory import GIB
    from toolkit.modelspec import read

    spec = read(Path(REPO) / "ds_configs" / "models" / "llama-3.1-8b")
    with pytest.raises(ConfigError, match="recompute modes must be among none, selective, full, got sometimes"):
        planner.plan(spec, planner.Cluster(8, 80 * GIB), 4096, recompute=("sometimes",))
    with pytest.raises(ConfigError, match="context-parallel size must be 1 or more, got 0"):
        planner.plan(spec, planner.Cluster(8, 80 * GIB), 4096, max_cp=0)


# The local spec's CP attention is SDPA over the gathered K/V (toolkit/blocks/attention_sdpa.py): with no s^2
# scores, a model blind to CP misses a tiny model's layer by 8% only, so the bar is 5% (measured: exact).
CP_MEMORY_TOLERANCE = 0.05


@pytest.mark.multiprocess
def test_memory_model_matches_saved_tensors_at_cp2():
    """Activation bytes per layer and per model at CP2 on CPU (the local spec's all-gather attention)
    against torch.autograd.graph.saved_tensors_hooks counts, each rank, within 5%."""
    from tests.workers_memory import SEQ, tiny_spec
    from toolkit.dsconfig import Setup
    from toolkit.memory import CPU_LOCAL, estimate
    from toolkit.memory import activations as act
    from toolkit.runtime.launch import run_on_processes

    cases = [dict(variant=v, precision=p, recompute=r, micro=2)
             for v, p, r in (("llama", "bf16", "none"), ("llama", "fp32", "none"), ("llama", "bf16", "selective"),
                             ("llama", "bf16", "full"), ("qwen3", "bf16", "none"))]
    rows = []
    for rank, out in enumerate(run_on_processes("tests.workers_memory:context_parallel_saved_bytes", 2, cases)):
        for r in out:
            spec, saved, width = tiny_spec(4, r["variant"]), r["saved"], 2 if r["precision"] == "bf16" else 4
            per_layer = (saved[4] - saved[2]) / 2
            predicted = act.layer_bytes(spec, act.Shape(SEQ, r["micro"], 1, width, cp=2), CPU_LOCAL, r["recompute"])
            setup = Setup(gpus=2, tp=1, pp=1, zero=1, precision=r["precision"], micro_batch=r["micro"],
                          global_batch=2 * r["micro"])
            whole = estimate(spec, setup, SEQ, r["recompute"], CPU_LOCAL, cp=2).stages[0].activations
            rows.append(f"{r['variant']} {r['precision']} recompute {r['recompute']} rank {rank}: per layer measured "
                        f"{per_layer:,.0f} predicted {predicted:,} ({predicted / per_layer - 1:+.1%}); model measured "
                        f"{saved[4]:,} predicted {whole:,} ({whole / saved[4] - 1:+.1%})")
            assert abs(predicted / per_layer - 1) <= CP_MEMORY_TOLERANCE, rows[-1]
            assert abs(whole / saved[4] - 1) <= CP_MEMORY_TOLERANCE, rows[-1]
            if r["recompute"] == "none":  # guard: a model blind to CP (a rank as a sequence of SEQ / 2) misses
                blind = act.layer_bytes(spec, act.Shape(SEQ // 2, r["micro"], 1, width), CPU_LOCAL)
                assert abs(blind / per_layer - 1) > CP_MEMORY_TOLERANCE, (blind, per_layer)
    print("\n".join(rows))


def test_plan_bundle_at_65536_tokens_carries_parallel_cp_the_recipe_accepts(tmp_path, capsys):
    """`toolkit plan -o` writes the CP layout it priced: parallel.cp in recipe.yaml, the global batch
    in sequences, and the recipe's own DeepSpeed Setup equal to the priced one (plan_bundle checks)."""
    from toolkit.cli import main
    from toolkit.train.build import data_parallel_size
    from toolkit.train.config import load_config

    out = tmp_path / "plan-64k"
    assert main(["plan", "--model", str(REPO / "ds_configs" / "models" / "llama-3.1-8b"), "--gpus", "8",
                 "--gpu-memory", "80GiB", "--seq-len", "65536", "--top", "3", "-o", str(out)]) == 0
    assert "parallel.cp=" in capsys.readouterr().err
    cfg = load_config(str(out / "recipe.yaml"))
    assert cfg.parallel.cp > 1 and cfg.global_batch == 64
    assert data_parallel_size(cfg, 8) * cfg.parallel.cp * cfg.parallel.tp * cfg.parallel.pp == 8


def test_memory_command_prices_context_parallelism(capsys):
    """`toolkit memory --cp 4`: Llama-3.1-8B at 65,536 tokens, TP2 x CP4 on 8 GPUs fits 80 GiB without
    recompute; the same layout without CP does not (it suggests full recompute)."""
    from toolkit.cli import main

    model = str(REPO / "ds_configs" / "models" / "llama-3.1-8b")
    common = ["--gpus", "8", "--tp", "2", "--zero", "2", "--seq-len", "65536", "--micro-batch", "1", "--gpu-memory", "80GiB"]
    assert main(["memory", model, *common, "--cp", "4"]) == 0
    out = capsys.readouterr().out
    assert "(DP 1 x CP 4)" in out and "fits:" in out
    assert main(["memory", model, *common]) == 1
    assert "does not fit" in capsys.readouterr().out
