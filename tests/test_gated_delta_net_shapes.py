"""Qwen3-Next's gated delta net over the shapes a published config can take (issue 40): key heads
serving 1, 2 or 4 value heads each, key head dims below, equal to and above the value head dims,
conv kernels 2-4, and TP 1 and 2. Each case is transformers' own Qwen3NextGatedDeltaNet (its torch
chunked rule, 70 tokens: two of its 64-token chunks) against megatron-core's GatedDeltaNet holding the
shards our converter writes (the family's rows, Split.GDN_IN_PROJ / GDN_CONV / COLUMN / ROW).

One process: a TP rank of megatron-core's GatedDeltaNet computes only from its own shards (its key
heads and the value heads they serve, gated_delta_net.py:289-421) until out_proj's row-parallel
all-reduce, so TP rank r is the layer built at TP 1 with the rank's head counts on rank r's shards,
and the layer's output is the sum over ranks. The end-to-end check at the issue's shape (real TP2 x
PP2 x EP2 processes, `convert verify`'s code) is in the launch of tests/test_published_parity.py.

Guards, on the issue's shape (2 key heads of 16, 4 value heads of 16): value heads taken in the other
grouping order (per value index, not per key head: the same tensor where a key head serves one value
head, so a sweep of ratio 1 alone could not see it), and the input projection split over TP as one
column-parallel tensor rather than part by part; each differs from HF far past the tolerance."""

from __future__ import annotations

import pytest
import torch

HIDDEN, SEQ, BATCH = 48, 70, 2
# (key heads, value heads, key head dim, value head dim, conv kernel)
SHAPES = [
    (2, 2, 16, 16, 4),  # one value head per key head
    (2, 4, 16, 16, 4),  # the issue's: two per key head, equal head dims
    (2, 8, 8, 16, 4),   # four per key head, value heads wider
    (4, 8, 16, 8, 2),   # two key heads per TP 2 rank, key heads wider
    (2, 4, 8, 12, 3),   # the tiny test model's dims (toolkit/tinymodels.py QWEN3_NEXT)
]
TPS = (1, 2)
ISSUE_SHAPE = SHAPES[1]
GUARDS = {"value-heads-by-value-index": 1, "in-proj-split-as-one-column": 2}  # guard: the TP it runs at
# fp32, outputs of order 1: our rule sums token by token, HF's in chunks of 64 (seen: ~1e-6)
TOLERANCE = 1e-5


def _hf_layer(shape, seed: int):
    """transformers' gated delta net of `shape`, its weights drawn so that every piece moves the output."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    from toolkit.tinymodels import make_config

    k_heads, v_heads, k_dim, v_dim, kernel = shape
    config = make_config("qwen3-next", hidden_size=HIDDEN, linear_num_key_heads=k_heads, linear_num_value_heads=v_heads,
                         linear_key_head_dim=k_dim, linear_value_head_dim=v_dim, linear_conv_kernel_dim=kernel)
    torch.manual_seed(seed)
    layer = hf.Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        for linear in (layer.in_proj_qkvz, layer.in_proj_ba, layer.out_proj):
            linear.weight.normal_(0.0, linear.in_features ** -0.5)
        layer.conv1d.weight.uniform_(-0.6, 0.6)
        layer.A_log.copy_(torch.empty(v_heads).uniform_(0.1, 2.0).log())  # decays of 0.1 to 0.95 per token
        layer.dt_bias.normal_(0.0, 0.5)
        layer.norm.weight.uniform_(0.5, 1.5)
    return config, layer


def _shards(config, layer, tp: int, guard: str | None) -> list[dict[str, torch.Tensor]]:
    """Each TP rank's gated delta net tensors as the converter builds them from the family's rows."""
    from toolkit.convert.stages import TensorSource, stage_rows
    from toolkit.families import spec_from_config
    from toolkit.layouts import Layout
    from toolkit.splits.kinds import build_shard

    family, spec = spec_from_config(config.to_dict())
    layout = Layout(tp)
    geo = layout.geometry(spec)
    src = TensorSource({f"model.layers.0.linear_attn.{n}": p.detach() for n, p in layer.named_parameters()})
    prefix = "decoder.layers.0.self_attention."
    rows = [(name[len(prefix):], row, hf_layer) for name, row, hf_layer, _ in stage_rows(family, spec, layout, 0)
            if name.startswith(prefix) and "layer_norm" not in name]  # the input norm is the decoder layer's
    out = []
    for rank in range(tp):
        shards = {}
        for name, row, hf_layer in rows:
            if guard == "in-proj-split-as-one-column" and name == "in_proj.weight":  # the TP 1 tensor in TP chunks
                shards[name] = build_shard(row.split, src, row.hf_names(hf_layer), 1, 0, geo).chunk(tp)[rank]
            else:
                shards[name] = build_shard(row.split, src, row.hf_names(hf_layer), tp, rank, geo)
        if guard == "value-heads-by-value-index":
            shards["in_proj.weight"] = _by_value_index(shards["in_proj.weight"], geo)
        out.append(shards)
    return out


def _by_value_index(in_proj: torch.Tensor, geo) -> torch.Tensor:
    """The TP 1 input projection with its value heads (v, z, beta, alpha) reordered from per key head
    (key head g serves value heads g*r .. g*r + r-1, HF's and megatron-core's repeat_interleave) to per
    value index (value head j served by key head j % key heads)."""
    from toolkit.splits import Split

    nk, r = geo.linear_k_heads, geo.linear_v_heads // geo.linear_k_heads
    q, k, v, z, b, a = in_proj.split(Split.GDN_IN_PROJ.parts(in_proj.shape[0], geo))
    regroup = lambda t: t.reshape(nk, r, -1, t.shape[-1]).transpose(0, 1).reshape(t.shape)  # noqa: E731
    return torch.cat([q, k, regroup(v), regroup(z), regroup(b), regroup(a)])


def _megatron_output(config, shards: list[dict], x: torch.Tensor) -> torch.Tensor:
    """megatron-core's GatedDeltaNet, TP rank by TP rank (see the module docstring), summed over the ranks."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from toolkit.families import spec_from_config
    from toolkit.blocks.mixer_gated_delta_net import gated_delta_net_spec
    from toolkit.layouts import Layout
    from toolkit.model import transformer_config

    spec = spec_from_config(config.to_dict())[1]
    tp = len(shards)
    rank_config = transformer_config(spec, Layout(1), torch.float32, layer_spec="local",
                                     linear_num_key_heads=spec.linear_attention["k_heads"] // tp,
                                     linear_num_value_heads=spec.linear_attention["v_heads"] // tp)
    total = 0
    for rank_shards in shards:
        module = build_module(gated_delta_net_spec(), config=rank_config, layer_number=1,
                              pg_collection=ProcessGroupCollection.use_mpu_process_groups()).eval()
        missing, unexpected = module.load_state_dict(rank_shards, strict=False)
        assert not unexpected and all(m.endswith("_extra_state") for m in missing), (missing, unexpected)
        with torch.no_grad():
            out, bias = module(x.transpose(0, 1).contiguous(), attention_mask=None)
        assert bias is None
        total = total + out.transpose(0, 1)
    return total


def sweep() -> dict:
    """Worker (one rank): {case: max |ours - HF| / max(1, max |HF|)} for every shape x TP, and the guards."""
    from toolkit.runtime.distributed import init_parallel

    init_parallel(1, 1)
    results = {}
    cases = [(shape, tp, None) for shape in SHAPES for tp in TPS] + [(ISSUE_SHAPE, tp, g) for g, tp in GUARDS.items()]
    for seed, (shape, tp, guard) in enumerate(cases):
        config, layer = _hf_layer(shape, seed)
        x = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            reference = layer(x)
        ours = _megatron_output(config, _shards(config, layer, tp, guard), x)
        name = f"{guard or 'tp' + str(tp)} k{shape[0]}xv{shape[1]} dk{shape[2]} dv{shape[3]} conv{shape[4]}"
        results[name] = ((ours - reference).abs().max() / reference.abs().max().clamp(min=1.0)).item()
    return results


@pytest.mark.multiprocess
def test_gated_delta_net_equals_transformers_over_head_counts_dims_and_tp():
    """One process: every shape at TP 1 and TP 2 within 1e-5 of HF's layer; the guards far outside it."""
    from toolkit.runtime.launch import run_on_processes

    results = run_on_processes("tests.test_gated_delta_net_shapes:sweep", 1, cpu=True)[0]
    print("\n".join(f"{name}: {diff:.2e}" for name, diff in results.items()))
    assert len(results) == len(SHAPES) * len(TPS) + len(GUARDS)
    for name, diff in results.items():
        if name.split()[0] in GUARDS:
            assert diff > 100 * TOLERANCE, (name, diff)
        else:
            assert diff < TOLERANCE, (name, diff)
