"""FP8 training (precision=fp8; docs/guide/precision.md).

Which recipe runs where is decided once, in toolkit.fp8.recipes: on the Transformer Engine spec
(GPUs with TE) megatron-core's own fp8 / fp8_recipe fields drive TE's kernels; on the local spec
(CPU, GPUs without TE) toolkit.fp8.local runs torchao's float8 training math inside
megatron-core's column- and row-parallel linears, so that FP8 arithmetic really runs where
megatron-core alone would run none (without TE its FP8 context is a null context).
"""
