"""Tensor-parallel linears beyond megatron-core's own, built where its specs put a linear.

- PostNormRowParallelLinear: a RowParallelLinear whose output (after the TP all-reduce, before the
  residual add) goes through a norm, `post_layernorm` (Megatron-Bridge's name for Gemma 3; OLMo 2's too).
- KeyIsValueLinear: the linear_qkv of a Gemma 4 global layer whose keys are its values (attention_k_eq_v).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from toolkit.blocks.norms import RMSNorm


class PostNormRowParallelLinear(RowParallelLinear):
    def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_layernorm = RMSNorm(config, output_size, config.layernorm_epsilon)

    def forward(self, input_):
        return self.post_layernorm(self.forward_before_norm(input_)), None

    def forward_before_norm(self, input_):
        """The linear alone: where an adapter (toolkit/lora) adds its delta, as HF PEFT does on o_proj."""
        output, bias = super().forward(input_)
        assert bias is None, "a post-norm linear has no bias (add_bias_linear=False)"
        return output


class KeyIsValueLinear(ColumnParallelLinear):
    """linear_qkv of a Gemma 4 global layer with attention_k_eq_v: it holds [q heads; k] per query group
    (Split.GLOBAL_QK) and returns [q heads; k; k], the layout SelfAttention splits into q, k, v, so the
    values are the keys as projected (before k_norm and RoPE), as HF's. Each TP rank holds whole groups."""

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
        self.key_size = config.kv_channels
        tp = ps.get_tensor_model_parallel_world_size()
        if config.num_query_groups % tp:
            raise NotImplementedError(f"attention_k_eq_v with {config.num_query_groups} global key/value heads at TP {tp}")
        self.local_groups = config.num_query_groups // tp
        super().__init__(input_size, output_size - config.kv_channels * config.num_query_groups, config=config, **kwargs)

    keys_as_values = True  # what a LoRA wrapper (toolkit/lora/layers.py) adds its delta before repeat_keys for

    def forward_qk(self, input_, *args, **kwargs):
        """[q heads; k] per group, as stored."""
        return super().forward(input_, *args, **kwargs)

    def repeat_keys(self, output):
        grouped = output.view(*output.shape[:-1], self.local_groups, -1)
        return torch.cat([grouped, grouped[..., -self.key_size:]], dim=-1).flatten(-2)

    def forward(self, input_, *args, **kwargs):
        output, bias = self.forward_qk(input_, *args, **kwargs)
        return self.repeat_keys(output), bias
