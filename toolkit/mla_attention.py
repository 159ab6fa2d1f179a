"""megatron-core 0.16.1's multi-latent attention, made buildable on the local layer spec, without
Transformer Engine and without CUDA. Three gaps, each closed by the smallest change:

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
3. Without CUDA, YaRN cannot be built (toolkit/yarn.py): CpuYarnRotaryEmbedding while the model is built.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from megatron.core.transformer.dot_product_attention import DotProductAttention


class MLACoreAttention(DotProductAttention):
    def __init__(self, config, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        if v_channels is not None and v_channels != config.kv_channels:
            raise ValueError(f"the local attention lays out kv_channels={config.kv_channels} per head; MLA's values "
                             f"are {v_channels} wide (set kv_channels to v_head_dim)")
        super().__init__(config, *args, **kwargs)


def with_mla_core_attention(spec):
    """A local-spec layer (ModuleSpec) or block (TransformerBlockSubmodules) with MLACoreAttention as
    each MLA layer's core attention."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if isinstance(spec, TransformerBlockSubmodules):
        return replace(spec, layer_specs=[with_mla_core_attention(layer) for layer in spec.layer_specs])
    attention = spec.submodules.self_attention
    if attention.submodules.core_attention is not DotProductAttention:
        return spec
    attention = replace(attention, submodules=replace(attention.submodules, core_attention=MLACoreAttention))
    return replace(spec, submodules=replace(spec.submodules, self_attention=attention))


@contextlib.contextmanager
def buildable_mla(config):
    """While in this block, megatron-core's MLASelfAttention builds where TE or CUDA is missing (2, 3)."""
    if not getattr(config, "multi_latent_attention", False):
        yield
        return
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.transformer import multi_latent_attention as mla

    from toolkit.yarn import CpuYarnRotaryEmbedding

    patches = {"HAVE_TE": mla.HAVE_TE and te_extension.HAVE_TE}
    if not torch.cuda.is_available():
        patches["YarnRotaryEmbedding"] = CpuYarnRotaryEmbedding
    original = {name: getattr(mla, name) for name in patches}
    vars(mla).update(patches)
    try:
        yield
    finally:
        vars(mla).update(original)
