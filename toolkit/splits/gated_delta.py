"""Qwen3-Next's tensors whose HF layout differs from megatron-core's (toolkit/splits/__init__.py names the kinds).

Each is a re-layout of the HF tensors into the TP=1 megatron tensor (`to_megatron`, and back:
`to_hf`), then a list of parts that tensor-parallel ranks split each on its own (`parts`): rank r
holds the r-th chunk of every part, in part order.

  GATED_QKV    HF q_proj [heads x (q_h; gate_h), hidden] (query and output gate interleaved per head,
               Qwen3NextAttention.forward's chunk of the view [.., heads, 2 x head_dim]), k_proj, v_proj
               -> megatron-core's linear_qkv with attention_output_gate: per query group
               [q heads; gate heads; k; v] (attention.py:1390-1430), split as QKV (contiguous chunks)
  GDN_IN_PROJ  HF in_proj_qkvz [key heads x (q; k; v group; z group)] and in_proj_ba
               [key heads x (b group; a group)] (Qwen3NextGatedDeltaNet.fix_query_key_value_ordering)
               -> GatedDeltaNet.in_proj [q; k; v; z; beta; alpha], each part over TP
               (gated_delta_net.py:289-298)
  GDN_IN_PROJ_CAT  Qwen3.5's in_proj_qkv [q; k; v], in_proj_z, in_proj_b, in_proj_a (Qwen3_5GatedDeltaNet:
               value heads in the same order, key head i serving value heads i*r .. i*r + r - 1 as in
               Qwen3-Next and megatron-core) -> the same in_proj, concatenated: already megatron-core's
               part order, so GDN_IN_PROJ's parts, TP split and torch_dist keys, without its regrouping
  GDN_CONV     HF conv1d.weight [q; k; v channels, 1, kernel] -> GatedDeltaNet.conv1d, each part over TP
               (gated_delta_net.py:161-174, :333-337)
  GDN_IN_PROJ_EACH  OLMo-Hybrid's six Linears q_proj, k_proj, v_proj, g_proj (the output gate, z),
               b_proj (beta), a_proj (alpha, the decay's input): GDN_IN_PROJ_CAT with q, k, v apart
  GDN_CONV_EACH  OLMo-Hybrid's q_conv1d, k_conv1d, v_conv1d as published (transformers' conversion
               mapping concatenates them into conv1d on load, Concatenate(dim=0)): GDN_CONV's parts
"""

from __future__ import annotations

from toolkit.splits.kinds import Geometry, RelaidSplit


class GatedQKV(RelaidSplit):
    name = "GATED_QKV"

    def to_megatron(self, tensors, geo):
        import torch

        q_gate, k, v = tensors
        d, groups, hpg = geo.head_dim, geo.num_kv_heads, geo.heads_per_group
        rest = q_gate.shape[1:]
        q, gate = q_gate.reshape(groups, hpg, 2, d, *rest).unbind(2)
        return torch.cat([q.reshape(groups, hpg * d, *rest), gate.reshape(groups, hpg * d, *rest),
                          k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1).reshape(-1, *rest)

    def to_hf(self, whole, geo):
        import torch

        d, groups, hpg = geo.head_dim, geo.num_kv_heads, geo.heads_per_group
        rest = whole.shape[1:]
        q, gate, k, v = whole.reshape(groups, (2 * hpg + 2) * d, *rest).split([hpg * d, hpg * d, d, d], dim=1)
        q_gate = torch.stack([q.reshape(groups, hpg, d, *rest), gate.reshape(groups, hpg, d, *rest)], dim=2)
        return [q_gate.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(),
                v.reshape(-1, *rest).contiguous()]


def _linear(geo: Geometry) -> tuple[int, int, int, int]:
    """(key heads, value heads per key head, key head dim, value head dim)."""
    return geo.linear_k_heads, geo.linear_v_heads // geo.linear_k_heads, geo.linear_k_dim, geo.linear_v_dim


class GDNInProj(RelaidSplit):
    name = "GDN_IN_PROJ"
    # megatron-core's torch_dist keys each part as a tensor of its own, `<key>.<part>` (gated_delta_net.py:
    # 474-485, _split_tensor_factory)
    dist_names = ("query", "key", "value", "z", "beta", "alpha")

    def parts(self, size, geo):
        nk, r, dk, dv = _linear(geo)
        return [nk * dk, nk * dk, nk * r * dv, nk * r * dv, nk * r, nk * r]

    def to_megatron(self, tensors, geo):
        import torch

        qkvz, ba = tensors
        nk, r, dk, dv = _linear(geo)
        rest = qkvz.shape[1:]
        q, k, v, z = qkvz.reshape(nk, 2 * dk + 2 * r * dv, *rest).split([dk, dk, r * dv, r * dv], dim=1)
        b, a = ba.reshape(nk, 2 * r, *rest).split([r, r], dim=1)
        return torch.cat([t.reshape(-1, *rest) for t in (q, k, v, z, b, a)])

    def to_hf(self, whole, geo):
        import torch

        nk, r, dk, dv = _linear(geo)
        rest = whole.shape[1:]
        q, k, v, z, b, a = (t.reshape(nk, -1, *rest) for t in whole.split(self.parts(whole.shape[0], geo)))
        return [torch.cat([q, k, v, z], dim=1).reshape(-1, *rest).contiguous(),
                torch.cat([b, a], dim=1).reshape(-1, *rest).contiguous()]


class GDNInProjCat(GDNInProj):
    name = "GDN_IN_PROJ_CAT"

    def to_megatron(self, tensors, geo):
        import torch

        return torch.cat(list(tensors))

    def to_hf(self, whole, geo):
        import torch

        q, k, v, z, b, a = whole.split(self.parts(whole.shape[0], geo))
        return [t.contiguous() for t in (torch.cat((q, k, v)), z, b, a)]


class GDNConv(RelaidSplit):
    name = "GDN_CONV"
    dist_names = ("query", "key", "value")  # gated_delta_net.py:487-507

    def parts(self, size, geo):
        nk, r, dk, dv = _linear(geo)
        return [nk * dk, nk * dk, nk * r * dv]

    def to_megatron(self, tensors, geo):
        return tensors[0]

    def to_hf(self, whole, geo):
        return [whole.contiguous()]


class GDNInProjEach(GDNInProjCat):
    name = "GDN_IN_PROJ_EACH"

    def to_hf(self, whole, geo):
        return [t.contiguous() for t in whole.split(self.parts(whole.shape[0], geo))]


class GDNConvEach(GDNConv):
    name = "GDN_CONV_EACH"

    def to_megatron(self, tensors, geo):
        import torch

        return torch.cat(list(tensors))

    def to_hf(self, whole, geo):
        return [t.contiguous() for t in whole.split(self.parts(whole.shape[0], geo))]
