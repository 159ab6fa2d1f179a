"""Mamba-2's state-space duality (SSD) scan in plain torch: what megatron-core's MambaMixer (ssm/mamba_mixer.py)
imports from `mamba_ssm`, whose Triton kernels exist only on a GPU with Triton. toolkit/runtime/cpu_compat.py
(stand_in_mamba_ssm) installs these where `mamba_ssm` is missing; with it present, upstream's own kernels run.

Per head h (its state S of shape [headdim, d_state] starting at zero, or at `initial_states`), per token t:

    dt_t = softplus(dt_t + dt_bias_h)          where dt_softplus; clamped to dt_limit where one is given
    S <- exp(dt_t A_h) S + dt_t x_t B_t^T       A_h = -exp(A_log_h) < 0: the decay; B_t of the head's group
    y_t = S C_t + D_h x_t                       then y_t * silu(z_t) where z is given

computed as mamba_ssm's kernels do, in chunks of `chunk_size` tokens: inside a chunk the quadratic
("attention") form with the decay mask exp(segment_sum(dt A)); across chunks each chunk's final state,
decayed, passed to the next. Every sum in fp32. Heads h of group g are g * (heads / groups) onward
(mamba_ssm's `repeat(B, "b l g n -> b l (g h) n")`). Autograd differentiates it, so it trains too.

    mamba_chunk_scan_combined           mamba_ssm.ops.triton.ssd_combined's: x, dt, A, B, C -> y
    mamba_split_conv1d_scan_combined    the same, fed the in_proj output [z, xBC, dt]: the depthwise causal
                                        conv and silu on xBC first (megatron-core's training path,
                                        mamba_mixer.py:_ssm_training), then the gated RMSNorm and out_proj
                                        where their weights are given
    RMSNormGated                        mamba_ssm.ops.triton.layernorm_gated.RMSNorm: per group of
                                        `group_size` channels, norm_before_gate as given
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toolkit.blocks.kernels.gated_delta_rule import causal_conv1d

NO_LIMIT = (0.0, float("inf"))  # mamba_ssm's default dt_limit: no clamp


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: out[i, j] = a[j+1] + ... + a[i] for j <= i (0 on the diagonal), -inf above it.
    A masked cumulative sum rather than cumsum(a)[i] - cumsum(a)[j], which cancels badly in fp32."""
    steps = a.shape[-1]
    strictly_lower = torch.tril(torch.ones(steps, steps, dtype=torch.bool, device=a.device), diagonal=-1)
    terms = a[..., :, None].expand(*a.shape, steps).masked_fill(~strictly_lower, 0)  # terms[k, j] = a[k] for k > j
    sums = terms.cumsum(dim=-2)
    lower = torch.tril(torch.ones(steps, steps, dtype=torch.bool, device=a.device))
    return sums.masked_fill(~lower, -torch.inf)


def _chunked(t: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[b, l, ...] zero-padded to whole chunks -> [b, chunks, chunk_size, ...]."""
    pad = -t.shape[1] % chunk_size
    if pad:
        t = torch.cat([t, t.new_zeros(t.shape[0], pad, *t.shape[2:])], dim=1)
    return t.reshape(t.shape[0], -1, chunk_size, *t.shape[2:])


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk_size: int,
             initial_states: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence above without D and z, all fp32. x [b, l, h, p], dt [b, l, h] (already positive),
    A [h], B and C [b, l, h, n] (per head). Returns y [b, l, h, p] and the final state [b, h, p, n]."""
    batch, steps, heads, headdim = x.shape
    # padded tokens have dt = 0: no input, a decay of exp(0) = 1, so they change neither y nor the final state
    x, dt, B, C = (_chunked(t, chunk_size) for t in (x * dt[..., None], dt, B, C))
    dA = (dt * A).permute(0, 3, 1, 2)  # [b, h, chunks, T]
    dA_cumsum = dA.cumsum(dim=-1)
    # inside each chunk: y_l = sum_{s <= l} (C_l . B_s) exp(dA_{s+1} + ... + dA_l) dt_s x_s
    decay = torch.exp(segment_sum(dA))  # [b, h, c, l, s]
    scores = torch.einsum("bclhn,bcshn->bhcls", C, B) * decay
    y_diag = torch.einsum("bhcls,bcshp->bclhp", scores, x)
    # each chunk's own contribution to the state at its end
    to_end = torch.exp(dA_cumsum[..., -1:] - dA_cumsum)  # [b, h, c, l]
    chunk_states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, to_end, x)
    # the state entering each chunk: earlier chunks' states, decayed across the chunks between
    start = (torch.zeros_like(chunk_states[:, :1]) if initial_states is None
             else initial_states.float()[:, None])
    chunk_states = torch.cat([start, chunk_states], dim=1)  # [b, c + 1, h, p, n]
    across = torch.exp(segment_sum(F.pad(dA_cumsum[..., -1], (1, 0))))  # [b, h, c + 1, c + 1]
    entering = torch.einsum("bhzc,bchpn->bzhpn", across, chunk_states)
    entering, final = entering[:, :-1], entering[:, -1]
    # what the entering state gives each token, decayed from the chunk's start
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", C, entering, torch.exp(dA_cumsum))
    y = (y_diag + y_off).reshape(batch, -1, heads, headdim)[:, :steps]
    return y, final


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=NO_LIMIT,
                              return_final_states=False, return_varlen_states=False, state_dtype=None):
    """mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined's contract: x [b, l, h, p], dt [b, l, h],
    A [h], B and C [b, l, g, n], D [h] or [h, p], z [b, l, h, p]. Returns y [b, l, h, p] in x's dtype and,
    where asked, the final state [b, h, p, n] (in state_dtype, else fp32)."""
    if seq_idx is not None or cu_seqlens is not None or return_varlen_states:
        raise NotImplementedError("the torch Mamba-2 scan takes no packed sequences (seq_idx, cu_seqlens)")
    heads, groups = x.shape[2], B.shape[2]
    dt = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != NO_LIMIT:
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    B, C = (t.float().repeat_interleave(heads // groups, dim=2) for t in (B, C))
    y, final = ssd_scan(x.float(), dt, A.float(), B, C, chunk_size, initial_states)
    if D is not None:
        y = y + x.float() * (D.float()[:, None] if D.dim() == 1 else D.float())
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(x.dtype)
    return (y, final.to(state_dtype or torch.float32)) if return_final_states else y


def rms_norm_gated(x, weight, bias=None, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """mamba_ssm.ops.triton.layernorm_gated.rmsnorm_fn (its rms_norm_ref): RMS per group of `group_size`
    channels (all of them where None), gated by silu(z) after the norm or, with norm_before_gate False, before."""
    dtype = x.dtype
    xf = x.float()
    gate = F.silu(z.float()) if z is not None else None
    if gate is not None and not norm_before_gate:
        xf = xf * gate
    size = group_size or xf.shape[-1]
    grouped = xf.unflatten(-1, (-1, size))
    out = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2) * weight.float()
    if bias is not None:
        out = out + bias.float()
    if gate is not None and norm_before_gate:
        out = out * gate
    return out.to(dtype)


class RMSNormGated(torch.nn.Module):
    """mamba_ssm.ops.triton.layernorm_gated.RMSNorm: the constructor and forward(x, z=None) megatron-core calls
    (mamba_mixer.py: ExtendedRMSNorm(d_inner_local_tp, eps=1e-5, group_size=..., norm_before_gate=False))."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x, z=None):
        return rms_norm_gated(x, self.weight, self.bias, z, self.eps, self.group_size, self.norm_before_gate)


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=NO_LIMIT, return_final_states=False,
                                     activation="silu", rmsnorm_weight=None, rmsnorm_eps=1e-6, outproj_weight=None,
                                     outproj_bias=None, headdim=None, ngroups=1, norm_before_gate=True,
                                     state_dtype=None):
    """mamba_ssm.ops.triton.ssd_combined.mamba_split_conv1d_scan_combined's contract: zxbcdt [b, l, d] holds
    [z (h p); x (h p), B (g n), C (g n); dt (h)]; conv1d_weight [x B C channels, width]; D [h] (with headdim)
    or [h, p]. Returns [b, l, h p] (y * silu(z), or the gated RMSNorm of y where rmsnorm_weight is given),
    through out_proj where its weight is given."""
    heads, headdim = (D.shape[0], headdim) if D.dim() == 1 else D.shape
    inner = heads * headdim
    state = (conv1d_weight.shape[0] - inner) // ngroups // 2
    if zxbcdt.shape[-1] != 2 * inner + 2 * ngroups * state + heads:  # mamba_ssm's d_nonssm (an extra SwiGLU part)
        raise NotImplementedError("the torch Mamba-2 scan takes no channels beyond [z, x, B, C, dt]")
    z, xBC, dt = zxbcdt.split([inner, inner + 2 * ngroups * state, heads], dim=-1)
    xBC, _ = causal_conv1d(xBC, conv1d_weight, conv1d_bias, activation=activation)
    x, B, C = xBC.split([inner, ngroups * state, ngroups * state], dim=-1)
    batch, steps = zxbcdt.shape[:2]
    gated_in_scan = rmsnorm_weight is None
    result = mamba_chunk_scan_combined(
        x.unflatten(-1, (heads, headdim)), dt, A, B.unflatten(-1, (ngroups, state)), C.unflatten(-1, (ngroups, state)),
        chunk_size, D=D, z=z.unflatten(-1, (heads, headdim)) if gated_in_scan else None, dt_bias=dt_bias,
        initial_states=initial_states, seq_idx=seq_idx, dt_softplus=True, dt_limit=dt_limit,
        return_final_states=return_final_states, state_dtype=state_dtype)
    y, final = result if return_final_states else (result, None)
    y = y.reshape(batch, steps, inner)
    if not gated_in_scan:
        y = rms_norm_gated(y, rmsnorm_weight, None, z, rmsnorm_eps, inner // ngroups, norm_before_gate)
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight, outproj_bias)
    return (y, final) if return_final_states else y
