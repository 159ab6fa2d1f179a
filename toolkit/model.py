"""Build a megatron-core GPTModel for a ModelSpec on the current TP/PP rank, and load a
converted checkpoint into it.

The Transformer Engine layer spec is used where transformer_engine is importable (GPU machines);
otherwise the local spec (always on CPU). Both read the same checkpoints: torch_dist through
megatron-core's sharded keys, per-rank `torch` files through our name mapping.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F

from toolkit.convert import naming, torch_format
from toolkit.convert.metadata import CheckpointMeta, verify_file
from toolkit.convert.megatron_checkpoint import resolve_iteration_dir
from toolkit.errors import ConversionError
from toolkit.families.spec import ModelSpec
from toolkit.layouts import Layout


def running_layer_spec() -> str:
    has_te = importlib.util.find_spec("transformer_engine") is not None
    return "te" if has_te and torch.cuda.is_available() else "local"


def transformer_config(spec: ModelSpec, layout: Layout, dtype: torch.dtype = torch.float32, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = torch.cuda.is_available()
    kwargs = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        # HF: a token attends to `window` tokens including itself; megatron: (left, right) extra tokens.
        window_size=(spec.window_size - 1, 0) if spec.window_size else None,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        # Fused kernels are CUDA-only (apex / TE); the unfused paths are numerically the reference.
        bias_activation_fusion=on_gpu,
        masked_softmax_fusion=False,
        bias_dropout_fusion=on_gpu,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_spec_module(layer_spec: str):
    from megatron.core.models.gpt import gpt_layer_specs

    if layer_spec == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")


def build_gpt_model(spec: ModelSpec, layout: Layout, dtype: torch.dtype = torch.float32, config=None, layer_spec=None):
    """GPTModel for this process's pipeline stage (parallel_state must be initialised)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = config or transformer_config(spec, layout, dtype)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec or layer_spec_module(running_layer_spec()),
        vocab_size=layout.padded_vocab(spec.vocab_size),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=spec.rope_theta,
        rope_scaling=spec.rope_scaling_factor is not None,
        rope_scaling_factor=spec.rope_scaling_factor or 8.0,
    )
    if torch.cuda.is_available():
        model.cuda()
    return model


def load_converted(model, checkpoint_dir: str | Path, check_sums: bool = True) -> CheckpointMeta:
    """Load a checkpoint written by `toolkit convert hf-to-megatron` into `model`.

    torch_dist loads into any TP/PP layout through megatron-core's loader; per-rank torch files
    written for another layout are merged and re-split in memory (this stage's tensors only).
    `check_sums=False` is for `verify`, which reports mismatching files itself and still
    compares the logits (to name the first divergent layer).
    """
    from megatron.core import parallel_state as ps

    root = Path(checkpoint_dir)
    meta = CheckpointMeta.read(root)
    shards = resolve_iteration_dir(root)
    if meta.format == "torch_dist":
        load_dist(model, shards)
        return meta
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    if (tp, pp) == (meta.tp, meta.pp):
        path = torch_format.rank_file(shards, meta.layout, tp_rank, pp_rank)
        if check_sums and meta.checksums:  # Megatron-LM's own checkpoints carry none
            verify_file(root, path, meta.checksums)  # before unpickling anything from it
        state = torch_format.load_trusted_types(path)["model"]
    else:
        state = dict(_reshard(root, meta, Layout(tp, pp, meta.vocab_divisor), tp_rank, pp_rank))
    load_state_by_name(model, state)
    return meta


def _reshard(root: Path, meta: CheckpointMeta, layout: Layout, tp_rank: int, pp_rank: int):
    """This rank's shard of a per-rank checkpoint written for another layout: merge the HF
    tensors this stage needs from the stored shards, then split them for the new layout."""
    from toolkit.convert.megatron_checkpoint import MegatronCheckpoint
    from toolkit.convert.stages import TensorSource, stage_hf_names, stage_tensors

    ckpt = MegatronCheckpoint.open(root)
    wanted = stage_hf_names(ckpt.family, ckpt.spec, layout, pp_rank)
    source = TensorSource(dict(ckpt.hf_tensors(wanted)))
    return stage_tensors(source, ckpt.family, ckpt.spec, layout, tp_rank, pp_rank)


def load_state_by_name(model, state: dict) -> None:
    """load_state_dict that accepts either TE or local names and ignores `_extra_state`."""
    target_spec = naming.detect_layer_spec(model.state_dict().keys())
    dtype = next(model.parameters()).dtype
    renamed = {
        naming.to_spec_name(naming.to_canonical(k), target_spec): v.to(dtype)
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    }
    missing, unexpected = model.load_state_dict(renamed, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ConversionError(f"checkpoint does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")


def load_dist(model, shards: Path) -> None:
    """megatron-core's own loader. `args` in common.pt is an argparse.Namespace, so it is
    allowed explicitly for weights_only unpickling."""
    from megatron.core import dist_checkpointing

    with torch.serialization.safe_globals(torch_format.SAFE_GLOBALS):
        loaded = dist_checkpointing.load(model.sharded_state_dict(), str(shards))
    for key in ("args", "checkpoint_version", "iteration"):
        loaded.pop(key, None)
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ConversionError(f"torch_dist checkpoint does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
