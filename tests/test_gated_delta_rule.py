"""The torch gated delta rule (toolkit/blocks/kernels/gated_delta_rule.py) that stands in for `fla`'s kernels in
megatron-core's GatedDeltaNet where `fla` is missing: equal to transformers' own torch paths for
Qwen3-Next (the chunked one its model runs on CPU, and the token-by-token one), with the inputs chosen
so that each gate matters (a guard drops it and the comparison fails)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from toolkit.runtime import cpu_compat
from toolkit.blocks.kernels.gated_delta_rule import chunk_gated_delta_rule, l2norm

TOLERANCE = 1e-5  # fp32, sums reordered (HF's chunks of 64 against one token at a time)


def _inputs(seed: int = 0, batch: int = 2, steps: int = 70, heads: int = 3, d_k: int = 8, d_v: int = 5):
    """70 tokens: more than one of HF's 64-token chunks, so its inter-chunk state passing is compared too."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, steps, heads, d_k, generator=gen) for _ in range(2))
    v = torch.randn(batch, steps, heads, d_v, generator=gen)
    # g = -exp(A_log) * softplus(a + dt_bias): strongly negative (decays of 0.3-0.9), as the model makes them
    g = -torch.nn.functional.softplus(torch.randn(batch, steps, heads, generator=gen)) - 0.1
    beta = torch.rand(batch, steps, heads, generator=gen)
    return q, k, v, g, beta


def _hf(rule, q, k, v, g, beta, state=None):
    return rule(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("rule", [hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule],
                         ids=["hf-chunked", "hf-recurrent"])
def test_equals_transformers_torch_gated_delta_rule(rule):
    q, k, v, g, beta = _inputs()
    state = torch.randn(2, 3, 8, 5, generator=torch.Generator().manual_seed(1))
    ours, ours_state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
    ref, ref_state = _hf(rule, q, k, v, g, beta, state)
    assert ours.shape == ref.shape == v.shape
    torch.testing.assert_close(ours, ref, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(ours_state, ref_state, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("drop", ["decay", "beta", "delta", "scale", "l2norm"])
def test_guard_each_piece_of_the_rule_matters(drop):
    """The reference fed the inputs with one piece removed differs from ours past the tolerance: the
    comparison above sees every piece (a rule that ignored it would fail)."""
    q, k, v, g, beta = _inputs()
    ours, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    if drop == "decay":
        g = torch.zeros_like(g)
    elif drop == "beta":
        beta = torch.ones_like(beta)
    elif drop == "scale":
        q = q * 2.0  # after the L2 norm, a scale other than 1/sqrt(d_k)
        q, k = l2norm(q) * 2.0, l2norm(k)
    elif drop == "l2norm":
        q, k = q * 1.5, k * 0.5
    if drop == "delta":  # plain gated linear attention: S <- g S + k v^T, without subtracting what k recalls
        qn, kn = l2norm(q).transpose(1, 2) * 8**-0.5, l2norm(k).transpose(1, 2)
        decay = g.transpose(1, 2).exp()
        state, outs = torch.zeros(2, 3, 8, 5), []
        for t in range(q.shape[1]):
            state = state * decay[:, :, t, None, None] + kn[:, :, t, :, None] * (
                beta.transpose(1, 2)[:, :, t, None] * v.transpose(1, 2)[:, :, t])[:, :, None, :]
            outs.append(torch.einsum("bhkv,bhk->bhv", state, qn[:, :, t]))
        other = torch.stack(outs, 2).transpose(1, 2)
    else:
        use_l2 = drop not in ("scale", "l2norm")
        other, _ = hf.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=use_l2)
    assert (ours - other).abs().max() > 100 * TOLERANCE


def test_l2norm_is_fla_s():
    x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(l2norm(x), hf.l2norm(x), rtol=0, atol=1e-7)
    x = x.to(torch.bfloat16)
    assert l2norm(x).dtype == torch.bfloat16


def test_megatron_gated_delta_net_runs_the_stand_in_without_fla():
    """megatron-core refuses to build GatedDeltaNet without `fla` (0.16.1 gated_delta_net.py:103; 0.19
    gated_delta_net/common.py:141); after cpu_compat every module that holds the kernels by name holds the
    torch ones (0.19 imports them into gdn.py too). (Where `fla` is installed, nothing changes.)"""
    import importlib

    from toolkit.blocks.kernels import gated_delta_rule
    from toolkit.runtime import megatron_versions

    cpu_compat.apply()
    homes = [importlib.import_module(name) for name in megatron_versions.gated_delta_net_modules()]
    assert homes[0].HAVE_FLA
    if getattr(homes[0], "TOOLKIT_GATED_DELTA_RULE", False):
        assert homes[0].l2norm is gated_delta_rule.l2norm  # 0.16.1 leaves it undefined without fla
        for module in homes:
            for name in ("l2norm", "chunk_gated_delta_rule", "causal_conv1d"):
                if hasattr(module, name):
                    assert getattr(module, name) is getattr(gated_delta_rule, name), (module.__name__, name)


@pytest.mark.parametrize("width", [2, 4])
def test_causal_conv_equals_a_causal_depthwise_conv1d(width):
    """The conv megatron-core 0.18+ calls from `fla` (x [batch, time, channels], weight [channels, width])
    against torch's own depthwise nn.Conv1d, left-padded and cut to the sequence as transformers' Qwen3-Next
    runs it (modeling_qwen3_next.py: self.conv1d(...)[..., :seq_len], then SiLU)."""
    from toolkit.blocks.kernels.gated_delta_rule import causal_conv1d

    torch.manual_seed(0)
    x = torch.randn(2, 9, 6, dtype=torch.float64)
    conv = torch.nn.Conv1d(6, 6, width, groups=6, padding=width - 1, bias=True, dtype=torch.float64)
    expected = torch.nn.functional.silu(conv(x.transpose(1, 2))[..., :9]).transpose(1, 2)
    got, state = causal_conv1d(x=x, weight=conv.weight.squeeze(1), bias=conv.bias, activation="silu")
    assert state is None and torch.allclose(got, expected, atol=1e-12)
    shifted, _ = causal_conv1d(x=x, weight=conv.weight.squeeze(1).flip(-1), bias=conv.bias, activation="silu")
    assert not torch.allclose(shifted, expected, atol=1e-3), "guard: the taps reversed (an anti-causal conv) differ"


@pytest.mark.parametrize("k_heads, v_heads, d_k, d_v", [(2, 2, 16, 16), (2, 4, 16, 16), (2, 8, 8, 16), (4, 8, 16, 8)])
def test_equals_transformers_with_key_heads_serving_several_value_heads(k_heads, v_heads, d_k, d_v):
    """As megatron-core calls it (gated_delta_net.py:349-355: q and k L2-normed per key head, then each
    repeated to the value heads it serves), against HF's chunked rule given the key heads as they are:
    ratios 1, 2 and 4, equal and unequal head dims. Guard: the repeat in the other order (tiled) is far off."""
    q, k, _, _, _ = _inputs(seed=3, heads=k_heads, d_k=d_k)
    _, _, v, g, beta = _inputs(seed=4, heads=v_heads, d_v=d_v)
    reference, _ = _hf(hf.torch_chunk_gated_delta_rule, q, k, v, g, beta)
    ratio = v_heads // k_heads
    ours, _ = chunk_gated_delta_rule(l2norm(q).repeat_interleave(ratio, 2), l2norm(k).repeat_interleave(ratio, 2),
                                     v, g, beta)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    if ratio > 1:
        tiled, _ = chunk_gated_delta_rule(l2norm(q).repeat(1, 1, ratio, 1), l2norm(k).repeat(1, 1, ratio, 1), v, g, beta)
        assert (tiled - reference).abs().max() > 100 * TOLERANCE
