"""The gated delta rule in plain torch: what megatron-core's GatedDeltaNet (ssm/gated_delta_net.py:39-40)
imports from flash-linear-attention (`fla`), whose Triton kernels exist only on a GPU with Triton.
toolkit/runtime/cpu_compat.py installs these where `fla` is missing; with `fla` present, upstream's own
kernels run.

Per head, with a state S of shape [d_k, d_v] starting at zero, for each token t (fla's convention,
that of transformers' torch path for Qwen3-Next too):

    S <- exp(g_t) * S                          g_t <= 0: the log of the decay
    S <- S + k_t (beta_t (v_t - S^T k_t))^T    the delta rule: write what the key does not yet recall
    o_t = S^T (scale * q_t)                    scale: 1 / sqrt(d_k) unless given

One token at a time (exactness, not speed: fla's chunked form is the same sum reordered). Autograd
differentiates it, so it trains too.
"""

from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6, output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """fla.modules.l2norm.l2norm: x * rsqrt(sum(x^2) + eps) over the last dimension, in fp32."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).sum(dim=dim, keepdim=True) + eps)
    return out.to(output_dtype or x.dtype)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: float | None = None, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla.ops.gated_delta_rule.chunk_gated_delta_rule's contract. q, k: [batch, time, heads, d_k];
    v: [batch, time, heads, d_v]; g, beta: [batch, time, heads]. Returns the output [batch, time,
    heads, d_v] in v's dtype and, where asked, the final state [batch, heads, d_k, d_v] in fp32."""
    if cu_seqlens is not None:
        raise NotImplementedError("the torch gated delta rule takes no packed sequences (cu_seqlens)")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out_dtype = v.dtype
    # [batch, heads, time, ...] in fp32, as fla accumulates
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    decay, beta = g.transpose(1, 2).float().exp(), beta.transpose(1, 2).float()
    batch, heads, steps, d_k = k.shape
    state = (torch.zeros(batch, heads, d_k, v.shape[-1], dtype=torch.float32, device=v.device)
             if initial_state is None else initial_state.float())
    outputs = []
    for t in range(steps):
        state = state * decay[:, :, t, None, None]
        k_t = k[:, :, t]
        recalled = torch.einsum("bhkv,bhk->bhv", state, k_t)
        delta = beta[:, :, t, None] * (v[:, :, t] - recalled)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t] * scale))
    out = torch.stack(outputs, dim=2).transpose(1, 2).contiguous().to(out_dtype)
    return out, state if output_final_state else None


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None,
                  initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                  cu_seqlens=None, **_) -> tuple[torch.Tensor, None]:
    """fla.modules.convolution.causal_conv1d's contract, which megatron-core 0.18 and later call for the gated
    delta net's depthwise conv (x: [batch, time, channels], weight: [channels, width]): the same sum
    as their own torch path (F.conv1d over the left-padded sequence, then the activation)."""
    if cu_seqlens is not None or initial_state is not None or output_final_state:
        raise NotImplementedError("the torch causal conv takes no packed sequences (cu_seqlens) nor states")
    channels, width = weight.shape
    out = torch.nn.functional.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1,
                                     groups=channels)[..., :x.shape[1]]
    if activation in ("silu", "swish"):
        out = torch.nn.functional.silu(out)
    elif activation is not None:
        raise NotImplementedError(f"the torch causal conv has no activation {activation!r}")
    return out.transpose(1, 2), None
