"""megatron-core 0.16.1's multi-latent attention, made buildable on the local layer spec, without
Transformer Engine and without CUDA, its latent norms at HF's eps (toolkit/blocks/norms.py LatentRMSNorm).
Four gaps, each closed by the smallest change:

1. MLASelfAttention builds its core attention with `k_channels` (qk_head_dim + qk_pos_emb_head_dim) and
`v_channels` (v_head_dim) (multi_latent_attention.py:154-164), which Transformer Engine's attention
takes and the local DotProductAttention (dot_product_attention.py:42-52) does not: the stock local
MLA spec (gpt_layer_specs.py:366-392) fails to build. The local attention's arithmetic needs neither:
its matmuls take the head dims from q, k and v, MLA passes the softmax scale, and only its output
view uses kv_channels x heads, which is the value width where kv_channels is v_head_dim
(toolkit/megatron_settings.py mla_settings). MLACoreAttention is that DotProductAttention,
accepting the two arguments and checking the value width.
2. Without Transformer Engine, megatron-core's TE extension stands TELinear in by a MagicMock, which the
   import in multi_latent_attention.py:54-62 takes for TE (HAVE_TE = True), and
   `isinstance(self.linear_proj, TELinear)` (:184-185) raises TypeError. While the model is built,
   that module is told what the extension found (HAVE_TE False).
3. Without CUDA, YaRN cannot be built (toolkit/blocks/rope_yarn.py): CpuYarnRotaryEmbedding while the model is built.
4. At TP > 1 the local spec's down projections are column-parallel: MLASelfAttention gathers their latent
   (multi_latent_attention.py:594, 607), whose backward keeps this rank's columns of this rank's gradient
   (mappings.py:487). That gradient is partial where every rank uses the whole latent with its own heads:
   the key's rotary part always, the latents themselves without sequence parallelism. Transformer Engine's
   spec never gathers (its down projections are duplicated). Fine-tuning at TP2 was 3e-3 off HF's loss.
   `sum_latent_grads_over_tp`: the gather's backward sums over TP first, and the sequence-parallel scatter
   after it (:596, :614) is a plain slice, whose backward leaves the other ranks' tokens at zero for that sum.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from toolkit.blocks.norms import LatentRMSNorm
from toolkit.runtime import megatron_versions

from megatron.core.transformer.dot_product_attention import DotProductAttention


class MLACoreAttention(DotProductAttention):
    def __init__(self, config, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        if v_channels is not None and v_channels != config.kv_channels:
            raise ValueError(f"the local attention lays out kv_channels={config.kv_channels} per head; MLA's values "
                             f"are {v_channels} wide (set kv_channels to v_head_dim)")
        super().__init__(config, *args, **kwargs)


def with_mla_core_attention(spec, full_rank_query: bool = False, core=MLACoreAttention):
    """A local-spec layer (ModuleSpec) or block (TransformerBlockSubmodules) with `core` (MLACoreAttention;
    DeepSeek Sparse Attention's, toolkit/blocks/attention_dsa.py) as each MLA layer's core attention, and its
    q / kv latent norms LatentRMSNorm (HF's eps, not layernorm_epsilon).
    `full_rank_query` (q_lora_rank None): no query norm, which such a layer never applies, and which
    megatron-core 0.19 refuses in the spec (mla_qk_norm_config.py:259)."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if isinstance(spec, TransformerBlockSubmodules):
        return replace(spec, layer_specs=[with_mla_core_attention(layer, full_rank_query, core)
                                          for layer in spec.layer_specs])
    attention = spec.submodules.self_attention
    if attention.submodules.core_attention is not DotProductAttention:
        return spec
    norms = {"q_layernorm": IdentityOp if full_rank_query else LatentRMSNorm, "kv_layernorm": LatentRMSNorm}
    attention = replace(attention, submodules=replace(attention.submodules, core_attention=core, **norms))
    return replace(spec, submodules=replace(spec.submodules, self_attention=attention))


@contextlib.contextmanager
def buildable_mla(config):
    """While in this block, megatron-core's MLASelfAttention builds where TE or CUDA is missing (2, 3)."""
    if not getattr(config, "multi_latent_attention", False):
        yield
        return
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.transformer import multi_latent_attention as mla

    from toolkit.blocks.rope_yarn import CpuYarnRotaryEmbedding

    sum_latent_grads_over_tp()
    patches = {"HAVE_TE": mla.HAVE_TE and te_extension.HAVE_TE}
    if not torch.cuda.is_available():
        patches["YarnRotaryEmbedding"] = CpuYarnRotaryEmbedding
    original = {name: getattr(mla, name) for name in patches}
    vars(mla).update(patches)
    indexer = _indexer_module(config)  # its YaRN as the attention's, without CUDA the CPU one
    indexer_yarn = indexer and indexer.YarnRotaryEmbedding
    if indexer:
        indexer.YarnRotaryEmbedding = patches.get("YarnRotaryEmbedding", indexer_yarn)
    resolver = megatron_versions.mla_qk_norm_resolver()
    if resolver is not None:
        resolve = resolver._resolve_mla_qk_layernorm
        resolver._resolve_mla_qk_layernorm = _full_rank_query_unfused(resolve)
    try:
        yield
    finally:
        vars(mla).update(original)
        if indexer:
            indexer.YarnRotaryEmbedding = indexer_yarn
        if resolver is not None:
            resolver._resolve_mla_qk_layernorm = resolve


def _indexer_module(config):
    """megatron-core's dsa.py where the model has DeepSeek Sparse Attention, whose indexer builds its own YaRN
    (DSAIndexer.__init__); else None."""
    if getattr(config, "experimental_attention_variant", None) != "dsa":
        return None
    from megatron.core.transformer.experimental_attention_variant import dsa

    return dsa


def _full_rank_query_unfused(resolve):
    """megatron-core 0.19 gives a full-rank query (q_lora_rank None) under qk_layernorm only the backend's fused
    norm + linear (mla_qk_norm_config.py:147-150), which the local spec has none of (backends.py:114), so it
    cannot build (with TE installed but the local spec chosen, it builds TE's); the local spec norms the layer input in its own input_layernorm, so the query projection is
    the spec's plain linear, as in 0.16-0.18; the key-value side is resolved as upstream does."""
    from megatron.core.transformer.identity_op import IdentityOp

    def resolved(self):
        if self.has_q_lora or self.submodules.linear_q_proj is None or self._is_fused_norm_linear(self.submodules.linear_q_proj):
            return resolve(self)  # TE's spec (its fused norm + linear) resolves as upstream
        kv_norm = self.submodules.kv_layernorm or IdentityOp
        return self._result(
            linear_q_proj=self.submodules.linear_q_proj or self.linear_impl,
            linear_q_up_proj=IdentityOp,
            linear_kv_up_proj=self._non_fused_or_default(self.submodules.linear_kv_up_proj, "linear_kv_up_proj"),
            q_layernorm=IdentityOp,
            kv_layernorm=kv_norm,
        )

    return resolved


def _gather_latent(latent: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's columns (forward); backward: the gradient summed over TP, then this rank's columns."""
    from megatron.core.tensor_parallel import mappings

    return mappings.copy_to_tensor_model_parallel_region(mappings.gather_from_tensor_model_parallel_region(latent, group),
                                                         group)


def _scatter_tokens(latent: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's tokens (forward, as megatron-core's scatter); backward: zeros at the other ranks' tokens."""
    from megatron.core import parallel_state as ps

    size = ps.get_tensor_model_parallel_world_size() if group is None else group.size()
    rank = ps.get_tensor_model_parallel_rank() if group is None else group.rank()
    return latent.narrow(0, rank * (latent.shape[0] // size), latent.shape[0] // size)


def sum_latent_grads_over_tp() -> None:
    """Gap 4, for every MLA model of this process (forward and backward run after the build): MLASelfAttention's
    latent gather and sequence-parallel scatter, as the module names them, replaced by the two above."""
    from megatron.core.transformer import multi_latent_attention as mla

    vars(mla).update(gather_from_tensor_model_parallel_region=_gather_latent,
                     scatter_to_sequence_parallel_region=_scatter_tokens)
