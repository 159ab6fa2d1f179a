"""DeepSeek Sparse Attention (toolkit/families/dsa.py) on megatron-core 0.19's local modules: DSAttention with its
DSAIndexer (transformer/experimental_attention_variant/dsa.py) as the core attention of the local spec's
MLASelfAttention, which passes it the layer input and the normed low-rank query (requires_dsa_inputs,
multi_latent_attention.py:373-374). megatron-core's own DSA spec (experimental_attention_variant_module_specs.py
get_dsa_module_spec_for_backend) takes a Transformer Engine backend only (its `linear()`, TELinear in
parallel_mode 'duplicated') and the absorbed MLA, which requires sequence parallelism at TP > 1; here:

* the indexer's projections are `DuplicatedLinear`, a whole weight on every TP rank (the same tensors as
  TELinear 'duplicated' holds), and its k_norm `IndexerKeyNorm`, torch's LayerNorm (weight and bias) built as
  megatron-core builds a norm (megatron-core's WrappedTorchNorm refuses sequence parallelism, which the indexer
  gathers its input for itself);
* the kernels: megatron-core's DSAttention runs its own torch path, fused_qk_topk_naive and unfused_dsa_fn,
  unless dsa_kernel_backend names a fused one (dsa_kernels.use_fused_dsa_kernels); `kernel_backend()` names
  TileLang's where CUDA and the tilelang package are there (its hooks decline what they do not support and
  megatron-core falls back to the torch path), 'none' otherwise, so no kernel of ours stands in. Which is there
  is megatron-core's own answer (utils._missing_tilelang_dsa_kernel_dependencies, what TransformerConfig checks).
"""

from __future__ import annotations

import torch


class DuplicatedLinear(torch.nn.Linear):
    """y = x W^T with the whole W on every TP rank, built and called as megatron-core's linears are
    (returns (output, bias) with skip_bias_add, else (output, None))."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool = False,
                 skip_bias_add: bool = False, **_):
        super().__init__(input_size, output_size, bias=bias, device="cpu" if config.use_cpu_initialization else None,
                         dtype=config.params_dtype)
        self.skip_bias_add = skip_bias_add
        with torch.no_grad():
            init_method(self.weight)

    def forward(self, x):
        if self.skip_bias_add:
            return torch.nn.functional.linear(x, self.weight), self.bias
        return super().forward(x), None


class IndexerKeyNorm(torch.nn.LayerNorm):
    """The indexer's k_norm: LayerNorm with a weight and a bias (HF's nn.LayerNorm(index_head_dim, eps=1e-6))."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps, device="cpu" if config.use_cpu_initialization else None,
                         dtype=config.params_dtype)


def dsa_core_attention():
    """DSAttention with an indexer of the modules above (megatron-core's DSAIndexerSubmodules)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import (DSAIndexer, DSAIndexerSubmodules,
                                                                              DSAttention, DSAttentionSubmodules)
    from megatron.core.transformer.spec_utils import ModuleSpec

    indexer = ModuleSpec(module=DSAIndexer, submodules=DSAIndexerSubmodules(
        linear_wq_b=DuplicatedLinear, linear_wk=DuplicatedLinear, k_norm=IndexerKeyNorm,
        linear_weights_proj=DuplicatedLinear))
    return ModuleSpec(module=DSAttention, submodules=DSAttentionSubmodules(indexer=indexer))


def kernel_backend() -> str:
    """megatron-core's dsa_kernel_backend here: 'tilelang' with CUDA and its TileLang DSA kernels, else 'none'
    (its torch path)."""
    from megatron.core import utils

    return "tilelang" if torch.cuda.is_available() and not utils._missing_tilelang_dsa_kernel_dependencies() else "none"
