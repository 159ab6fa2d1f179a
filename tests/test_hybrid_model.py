"""megatron-core's hybrid model (HybridModel; MambaModel before 0.18) builds and runs on a CPU with the toolkit's
local stack spec (toolkit/blocks/hybrid_spec.py) and the torch Mamba-2 scan (toolkit/blocks/kernels/mamba2_ssd.py),
and gives transformers' NemotronHForCausalLM logits (fp32, 1e-4) at TP 1 and at TP 2 x PP 2 (4 ranks, the
pattern split evenly over the stages as megatron-core slices a pattern without '|': 0.19.2
hybrid_layer_allocation.py select_pipeline_segment, 0.16.1 mamba_block.py _select_layers_for_pipeline_parallel),
with HF's weights placed by the mapping of toolkit/blocks/mixer_mamba.py (each rank's shards built by the
converter's splits: Split.MAMBA_IN_PROJ, MAMBA_CONV, QKV, COLUMN, ROW, VOCAB). The pattern holds every symbol
the dense Nemotron-H has (M Mamba-2, * attention, - MLP) on both stages, 40 tokens over Mamba chunks of 16.

Guard: the attention layer's q/k/v laid out as HF's [q; k; v] instead of per query group differs far
past the tolerance (the comparison sees the attention layers, not only the Mamba ones)."""

from __future__ import annotations

import pytest
import torch

PATTERN = "M-*M-M*-"
HIDDEN, HEADS, HEAD_DIM, GROUPS, STATE, KERNEL, CHUNK = 32, 4, 8, 2, 8, 4, 16
ATTENTION_HEADS, KV_HEADS, ATTENTION_DIM, FFN, VOCAB, SEQ = 4, 2, 8, 48, 96, 40
TOLERANCE = 1e-4  # fp32 logits, max |megatron - HF|


def _hf_model():
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(hidden_size=HIDDEN, hybrid_override_pattern=PATTERN, mamba_num_heads=HEADS,
                             mamba_head_dim=HEAD_DIM, n_groups=GROUPS, ssm_state_size=STATE, conv_kernel=KERNEL,
                             chunk_size=CHUNK, num_attention_heads=ATTENTION_HEADS, num_key_value_heads=KV_HEADS,
                             head_dim=ATTENTION_DIM, intermediate_size=FFN, vocab_size=VOCAB, dtype="float32")
    torch.manual_seed(0)
    model = NemotronHForCausalLM(config).eval()
    with torch.no_grad():  # every piece of every layer moves the output; dt stays above time_step_min
        for name, p in model.named_parameters():
            if name.endswith(("dt_bias", "D")):
                p.uniform_(-1.0, 1.0)
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.05, 1.0).log())
            elif name.endswith("norm.weight") or "norm_f" in name:
                p.uniform_(0.5, 1.5)
            elif p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            else:
                p.uniform_(-0.3, 0.3)
    return config, model


def _megatron_state(model, guard: str | None, tp: int = 1, pp: int = 1) -> dict[str, torch.Tensor]:
    """This rank's shards of HF's tensors under megatron-core's names (its stage's layers numbered from 0), each
    built by its split."""
    from megatron.core import parallel_state as ps

    from toolkit.convert.stages import TensorSource
    from toolkit.runtime.megatron_versions import mamba_conv_names
    from toolkit.splits import Split
    from toolkit.splits.kinds import Geometry, build_shard

    geo = Geometry(num_heads=ATTENTION_HEADS, num_kv_heads=KV_HEADS, head_dim=ATTENTION_DIM, vocab_size=VOCAB,
                   padded_vocab_size=VOCAB, mamba_heads=HEADS, mamba_head_dim=HEAD_DIM, mamba_groups=GROUPS,
                   mamba_state=STATE)
    src = TensorSource({n: p.detach() for n, p in model.named_parameters()})
    conv_weight, conv_bias = mamba_conv_names()
    stage, per_stage = ps.get_pipeline_model_parallel_rank(), len(PATTERN) // pp
    rows = [("embedding.word_embeddings.weight", ("model.embeddings.weight",), Split.VOCAB)] if stage == 0 else []
    if stage == pp - 1:
        rows += [("decoder.final_norm.weight", ("model.norm_f.weight",), Split.REPLICATED),
                 ("output_layer.weight", ("lm_head.weight",), Split.VOCAB)]
    for i in range(stage * per_stage, (stage + 1) * per_stage):
        symbol, L, M = PATTERN[i], f"model.layers.{i}.", f"decoder.layers.{i - stage * per_stage}."
        if symbol == "M":
            rows += [(M + "norm.weight", (L + "norm.weight",), Split.REPLICATED)]
            rows += [(M + "mixer." + m, (L + "mixer." + h,), split) for m, h, split in (
                ("in_proj.weight", "in_proj.weight", Split.MAMBA_IN_PROJ), (conv_weight, "conv1d.weight", Split.MAMBA_CONV),
                (conv_bias, "conv1d.bias", Split.MAMBA_CONV), ("dt_bias", "dt_bias", Split.COLUMN),
                ("A_log", "A_log", Split.COLUMN), ("D", "D", Split.COLUMN), ("norm.weight", "norm.weight", Split.COLUMN),
                ("out_proj.weight", "out_proj.weight", Split.ROW))]
        elif symbol == "*":
            qkv = tuple(L + f"mixer.{p}_proj.weight" for p in "qkv")
            rows += [(M + "input_layernorm.weight", (L + "norm.weight",), Split.REPLICATED),
                     (M + "self_attention.linear_qkv.weight", qkv, Split.QKV),
                     (M + "self_attention.linear_proj.weight", (L + "mixer.o_proj.weight",), Split.ROW)]
        else:
            rows += [(M + "pre_mlp_layernorm.weight", (L + "norm.weight",), Split.REPLICATED),
                     (M + "mlp.linear_fc1.weight", (L + "mixer.up_proj.weight",), Split.COLUMN),
                     (M + "mlp.linear_fc2.weight", (L + "mixer.down_proj.weight",), Split.ROW)]
    rank = ps.get_tensor_model_parallel_rank()
    state = {name: build_shard(split, src, names, tp, rank, geo) for name, names, split in rows}
    if guard == "qkv-as-hf-lays-it-out":
        for name, names, split in rows:
            if split is Split.QKV:
                state[name] = torch.cat([src.read(n) for n in names])
    return state


def _megatron_model(tp: int = 1, pp: int = 1):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.activations import squared_relu

    from toolkit.blocks.hybrid_spec import buildable_hybrid_stack, hybrid_stack_spec
    from toolkit.runtime.megatron_versions import hybrid_model_class

    config = TransformerConfig(
        num_layers=len(PATTERN), hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=ATTENTION_HEADS,
        num_query_groups=KV_HEADS, kv_channels=ATTENTION_DIM, normalization="RMSNorm", layernorm_epsilon=1e-5,
        activation_func=squared_relu, gated_linear_unit=False, add_bias_linear=False, is_hybrid_model=True,
        mamba_state_dim=STATE, mamba_head_dim=HEAD_DIM, mamba_num_groups=GROUPS, mamba_num_heads=HEADS,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False)
    model_class, stack_argument, pattern_argument = hybrid_model_class()
    with buildable_hybrid_stack():
        return model_class(config=config, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="none",
                           share_embeddings_and_output_weights=False, pre_process=ps.is_pipeline_first_stage(),
                           post_process=ps.is_pipeline_last_stage(),
                           **{stack_argument: hybrid_stack_spec(KERNEL, CHUNK), pattern_argument: PATTERN}).eval()


def hybrid_logits(tp: int, pp: int, guards: tuple[str, ...] = ()) -> dict:
    """Worker (every rank): {case: max |megatron-core - HF| over the logits} on the last stage, {} elsewhere."""
    from types import SimpleNamespace

    from toolkit.convert.parity import _stage_forward
    from toolkit.runtime.distributed import init_parallel

    init_parallel(tp, pp)
    _, hf = _hf_model()
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = hf(input_ids=tokens, use_cache=False).logits
    results = {}
    for case in (f"tp{tp}-pp{pp}", *guards):
        model = _megatron_model(tp, pp)
        state = _megatron_state(hf, case if case in guards else None, tp, pp)
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all(m.endswith("_extra_state") for m in missing), (missing, unexpected)
        logits, _ = _stage_forward(model, tokens, SimpleNamespace(hidden_size=HIDDEN), torch.float32)
        if logits is not None:  # the last stage, its logits gathered over TP
            results[case] = (logits - reference).abs().max().item()
    return results


@pytest.mark.multiprocess
def test_hybrid_model_on_cpu_gives_transformers_logits_at_tp1():
    from toolkit.runtime.launch import run_on_processes

    results = run_on_processes("tests.test_hybrid_model:hybrid_logits", 1, 1, 1, ("qkv-as-hf-lays-it-out",),
                               cpu=True)[0]
    print(results)
    assert results["tp1-pp1"] < TOLERANCE, results
    assert results["qkv-as-hf-lays-it-out"] > 100 * TOLERANCE, results


@pytest.mark.multiprocess
def test_hybrid_model_on_cpu_gives_transformers_logits_at_tp2_pp2():
    from toolkit.runtime.launch import run_on_processes

    results = run_on_processes("tests.test_hybrid_model:hybrid_logits", 4, 2, 2, cpu=True)
    print(results)
    last = [r for r in results if r]
    assert len(last) == 2 and all(r["tp2-pp2"] < TOLERANCE for r in last), results
