"""Mamba-2's tensors (Nemotron-H's NemotronHMamba2Mixer -> megatron-core's MambaMixer): HF keeps them in
megatron-core's part order already, one tensor each, but TP splits each part on its own, so a rank's shard
is not a contiguous chunk of the whole (toolkit/splits/__init__.py names the kinds).

  MAMBA_IN_PROJ  in_proj.weight [z (heads x head_dim); x (heads x head_dim); B (groups x state);
                 C (groups x state); dt (heads), hidden] (HF's split of projected_states into gate,
                 hidden_states_B_C, dt, then of hidden_states_B_C into x, B, C) -> MambaMixer.in_proj, each
                 of the five parts over TP (mamba_mixer.py in_proj_partition_sizes; torch_dist keys
                 `in_proj.weight.<z|x|B|C|dt>`, sharded_state_dict's _split_tensor_factory)
  MAMBA_CONV     conv1d.weight [x; B; C channels, 1, kernel] and conv1d.bias [x; B; C] -> MambaMixer's
                 conv1d weight and bias, each of the three parts over TP (conv_partition_sizes;
                 torch_dist keys `conv1d.<weight|bias>.<x|B|C>`)

TP rank r holds heads r*h/tp .. and B/C groups r*g/tp ..: the heads of group j stay with group j, since
megatron-core requires both to divide by TP (mamba_mixer.py: nheads % tp, ngroups % tp).
"""

from __future__ import annotations

from toolkit.splits.kinds import Geometry, RelaidSplit


def _sizes(geo: Geometry) -> tuple[int, int, int]:
    """(inner = heads x head_dim, groups x state, heads)."""
    return geo.mamba_heads * geo.mamba_head_dim, geo.mamba_groups * geo.mamba_state, geo.mamba_heads


class MambaInProj(RelaidSplit):
    name = "MAMBA_IN_PROJ"
    dist_names = ("z", "x", "B", "C", "dt")

    def parts(self, size, geo):
        inner, bc, heads = _sizes(geo)
        return [inner, inner, bc, bc, heads]

    def to_megatron(self, tensors, geo):
        return tensors[0]

    def to_hf(self, whole, geo):
        return [whole.contiguous()]


class MambaConv(MambaInProj):
    name = "MAMBA_CONV"
    dist_names = ("x", "B", "C")

    def parts(self, size, geo):
        inner, bc, _ = _sizes(geo)
        return [inner, bc, bc]
