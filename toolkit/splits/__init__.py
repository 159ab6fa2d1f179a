"""How megatron-core tensors are built from HF tensors and split across tensor-parallel ranks.

This is the one place that knows the layouts; both conversion directions, LoRA's shards and the tests
use it. Each split kind is one class holding its rules (build a rank's shard, merge the shards back,
the shape of a shard), so a new tensor kind (a fused HF QKV, a fused gate_up) is one class:

    kinds.py        the rules (SplitKind), the kinds below but Qwen3-Next's, Geometry, build_shard,
                    merge_shards, megatron_shape
    gated_delta.py  Qwen3-Next's tensors, re-laid out whole before the split (GATED_QKV, GDN_*)

`Split` (here) is the table of the kinds the family tables name:

    COLUMN      split dim 0 (ColumnParallelLinear output rows)
    ROW         split dim 1 (RowParallelLinear input columns)
    REPLICATED  every rank holds the whole tensor (norms)
    VOCAB       rows padded with zeros to the padded vocab, then split dim 0
    QKV         q, k, v fused per query group: [q heads of group g; k_g; v_g] for each g,
                then split dim 0 as a contiguous chunk. When TP > groups, a rank holds part of one
                group; megatron-core all-gathers and re-slices (attention.py, num_query_groups < TP).
    GATE_UP     [gate; up] fused, but per TP rank: rank r holds [gate_r; up_r], which is not a
                contiguous chunk of the TP=1 tensor.
    HF_QKV      QKV from one HF tensor [q; k; v] (Phi-3's qkv_proj)
    HF_GATE_UP  GATE_UP from one HF tensor [gate; up] (Phi-3's gate_up_proj)
    UNSPLIT_*   that kind's whole tensor on every TP rank (experts at expert TP 1)
    GLOBAL_*    that kind on a Gemma 4 global layer (its own head size and KV heads)
    GATED_QKV, GDN_IN_PROJ, GDN_IN_PROJ_CAT, GDN_CONV   Qwen3-Next's and Qwen3.5's (gated_delta.py)
    GDN_IN_PROJ_EACH, GDN_CONV_EACH                    OLMo-Hybrid's (gated_delta.py)
    MAMBA_IN_PROJ, MAMBA_CONV   Mamba-2's (Nemotron-H) input projection and causal conv (mamba.py)

The package imports no other toolkit module (torch only where tensors are made), so the family tables
import it cheaply.
"""

from __future__ import annotations

from toolkit.splits.gated_delta import GatedQKV, GDNConv, GDNConvEach, GDNInProj, GDNInProjCat, GDNInProjEach
from toolkit.splits.mamba import MambaConv, MambaInProj
from toolkit.splits.kinds import (ColumnSplit, FusedGateUp, FusedQK, FusedQKV, GlobalLayer, HFFusedGateUp,
                                  HFFusedQKV, Replicated, RowSplit, Unsplit, VocabSplit)


class Split:
    """The split kinds the family tables name (one instance of each class)."""

    COLUMN = ColumnSplit()
    ROW = RowSplit()
    REPLICATED = Replicated()
    VOCAB = VocabSplit()
    QKV = FusedQKV()
    GATE_UP = FusedGateUp()
    HF_QKV = HFFusedQKV()
    HF_GATE_UP = HFFusedGateUp()
    UNSPLIT_GATE_UP = Unsplit(GATE_UP)
    UNSPLIT_ROW = Unsplit(ROW)
    # Gemma 4's global layers: q, k, v with their own head size and KV heads; q, k alone where k is v
    GLOBAL_QKV = GlobalLayer(QKV)
    GLOBAL_QK = GlobalLayer(FusedQK())
    # Qwen3-Next: the output-gated attention's q/gate/k/v, the gated delta net's input projection and its causal conv
    GATED_QKV = GatedQKV()
    GDN_IN_PROJ = GDNInProj()
    GDN_IN_PROJ_CAT = GDNInProjCat()  # Qwen3.5's four in_proj_* tensors, in megatron-core's order already
    GDN_CONV = GDNConv()
    # OLMo-Hybrid's: each of q, k, v, gate, beta, alpha a Linear of its own; q, k, v's convs apart
    GDN_IN_PROJ_EACH = GDNInProjEach()
    GDN_CONV_EACH = GDNConvEach()
    # Mamba-2 (Nemotron-H): in_proj [z; x; B; C; dt] and conv1d [x; B; C], each part over TP
    MAMBA_IN_PROJ = MambaInProj()
    MAMBA_CONV = MambaConv()
