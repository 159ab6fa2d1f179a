"""Context parallelism (parallel.cp): the sequence split over CP ranks, and the toolkit's CP attention.

The split is megatron-core's (and Transformer Engine's) zig-zag: the padded sequence is cut into
2·CP equal chunks and CP rank r holds chunks r and 2·CP-1-r, so that every rank does the same
causal work (the early chunk attends to little, the late one to much). megatron-core's RoPE takes
each rank's positions from that same rule (rope_utils.get_pos_emb_on_this_cp_rank), so the data
split here and the positions there must agree: `chunk_positions` is the one rule.

On the Transformer Engine spec, TE's attention does CP (cp_comm_type "p2p"). The local spec's
DotProductAttention refuses CP (dot_product_attention.py:58), so `ContextParallelAttention` is
the toolkit's: it all-gathers K and V over the CP group (megatron-core's sequence-parallel gather:
forward all-gather, backward reduce-scatter of dK/dV, so the gradients reach the rank that made
each key) and masks causally over global positions, Llama 3's choice. Each rank then holds the
whole sequence's K/V for the layer being computed: memory O(s) per layer, where a ring keeps O(s/CP).
"""

from __future__ import annotations

import copy

import torch

# Where the ring (p2p) is chosen over all-to-all for TE: it works for any head count (a2a needs the
# heads of each TP rank divisible by CP, and GQA models have few KV heads) and overlaps each
# step's K/V exchange with the previous block's attention; it is also TE's and Megatron-LM's default.
TE_CP_COMM_TYPE = "p2p"


def split_multiple(cp: int, tp: int = 1, sequence_parallel: bool = False) -> int:
    """The sequence length must be a multiple of this: 2·CP chunks, each split over TP under SP."""
    return 2 * cp * (tp if sequence_parallel else 1)


def padded_length(seq_len: int, cp: int, tp: int = 1, sequence_parallel: bool = False) -> int:
    """seq_len rounded up to the split's multiple (the padding never counts in the loss)."""
    m = split_multiple(cp, tp, sequence_parallel) if cp > 1 else 1
    return -(-seq_len // m) * m


def chunk_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions held by CP rank `rank` of a (padded) sequence of seq_len: chunks rank and 2·CP-1-rank."""
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


def gathered_positions(seq_len: int, cp: int) -> torch.Tensor:
    """Global positions of the keys after the all-gather over CP: every rank's chunks, in rank order."""
    return torch.cat([chunk_positions(seq_len, cp, r) for r in range(cp)])


def causal_mask(seq_len: int, cp: int, rank: int, device=None, window: tuple[int, int] | None = None) -> torch.Tensor:
    """[sq, sk] True where masked: a key after the query in the whole sequence, or with a sliding
    window (megatron-core's (left, 0): the query and `left` keys before it) a key further back."""
    q = chunk_positions(seq_len, cp, rank).to(device)
    k = gathered_positions(seq_len, cp).to(device)
    distance = q[:, None] - k[None, :]
    masked = distance < 0
    if window is not None:
        masked |= distance > window[0]
    return masked


def split_batch(batch: dict, cp: int, rank: int) -> dict:
    """This CP rank's part of a collated batch (toolkit.train.data.collate) of whole rows: tokens,
    labels, loss mask and padding at its positions, `positions` (global), and for packed rows the
    attention mask of its queries over the gathered keys (same document and causal)."""
    b, s = batch["tokens"].shape
    mine = chunk_positions(s, cp, rank)
    out = {k: v for k, v in batch.items() if k not in ("tokens", "labels", "loss_mask", "padding", "attention_mask")}
    for key in ("tokens", "labels", "loss_mask", "padding"):
        out[key] = batch[key][:, mine]
    out["positions"] = mine[None].expand(b, -1)
    if "attention_mask" in batch:
        keys = gathered_positions(s, cp)
        out["attention_mask"] = batch["attention_mask"][:, :, mine][:, :, :, keys]
    return out


def pad_batch(batch: dict, length: int, pad_id: int = 0) -> dict:
    """Rows of a collated batch extended to `length` with padding that never counts in the loss
    and that no real token attends to (packed: a document of its own; unpacked: after every token)."""
    b, s = batch["tokens"].shape
    n = length - s
    if n == 0:
        return batch
    out = dict(batch)
    out["tokens"] = torch.nn.functional.pad(batch["tokens"], (0, n), value=pad_id)
    out["labels"] = torch.nn.functional.pad(batch["labels"], (0, n), value=pad_id)
    out["loss_mask"] = torch.nn.functional.pad(batch["loss_mask"], (0, n), value=0.0)
    out["padding"] = torch.nn.functional.pad(batch["padding"], (0, n), value=True)
    if "attention_mask" in batch:  # True = masked; the new positions see only themselves and each other
        mask = torch.ones(b, 1, length, length, dtype=torch.bool)
        mask[:, :, :s, :s] = batch["attention_mask"]
        mask[:, :, s:, s:] = ~torch.ones(n, n, dtype=torch.bool).tril()
        out["attention_mask"] = mask
    return out


def _local_attention_class():
    from toolkit.blocks.attention_sdpa import SdpaAttention  # the local spec's (toolkit.model.layer_spec_module)

    return SdpaAttention


class ContextParallelAttention(torch.nn.Module):
    """The local spec's attention (toolkit.blocks.attention_sdpa) over K/V gathered from the CP group, with the
    causal mask (and the layer's sliding window, where it has one) over global positions. Built by
    SelfAttention in place of DotProductAttention (same arguments)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.utils import is_layer_window_attention

        # The window of this layer (Gemma 3 alternates windowed and full layers). DotProductAttention's
        # softmax builds its own window mask over local positions, [sq, sk] from 0, ignoring the mask
        # it is given (fused_softmax.py:321): wrong for a rank's two chunks against the gathered keys,
        # so the window goes into the mask over global positions here and the local copy has none.
        self.window = config.window_size if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number) else None
        local = copy.copy(config)  # DotProductAttention asserts CP 1: it computes one rank's queries
        local.context_parallel_size = 1
        local.window_size = None
        self.attention = _local_attention_class()(local, layer_number, attn_mask_type, attention_type,
                                                  attention_dropout, softmax_scale, None, pg_collection)
        self.group = ps.get_context_parallel_group()
        self.cp = self.group.size()
        self._mask = None  # (sequence length, device, the causal mask): the same for every micro-batch

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        # [s/cp, b, ng, hn] -> [s, b, ng, hn] in rank order; backward: dK/dV reduce-scattered to their rank
        key = gather_from_sequence_parallel_region(key, True, group=self.group)
        value = gather_from_sequence_parallel_region(value, True, group=self.group)
        if self._mask is None or self._mask[:2] != (key.shape[0], query.device):
            built = causal_mask(key.shape[0], self.cp, self.group.rank(), query.device, self.window)
            self._mask = (key.shape[0], query.device, built)
        mask = self._mask[2][None, None]
        if attention_mask is not None:  # packed rows: [b, 1, sq, sk] in the same orders (split_batch)
            mask = mask | attention_mask
        return self.attention(query, key, value, mask, attn_mask_type, attention_bias, packed_seq_params)


def with_context_parallel_attention(spec):
    """A local layer spec (ModuleSpec or TransformerBlockSubmodules) with every DotProductAttention (or
    the toolkit's SdpaAttention that replaces it) replaced by ContextParallelAttention."""
    from dataclasses import replace

    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from toolkit.blocks.attention_sdpa import with_sdpa_core_attention

    if isinstance(spec, TransformerBlockSubmodules):
        return replace(spec, layer_specs=[with_context_parallel_attention(one) for one in spec.layer_specs])
    attention = with_sdpa_core_attention(spec).submodules.self_attention  # a stock local spec's too
    if attention.submodules.core_attention is not _local_attention_class():
        raise NotImplementedError(f"context parallelism with {attention.submodules.core_attention.__name__}")
    attention = replace(attention, submodules=replace(attention.submodules, core_attention=ContextParallelAttention))
    return replace(spec, submodules=replace(spec.submodules, self_attention=attention))
