"""The torch Mamba-2 scan (toolkit/blocks/kernels/mamba2_ssd.py) that stands in for `mamba_ssm`'s kernels in
megatron-core's MambaMixer where `mamba_ssm` is missing: equal to transformers' own torch path for Nemotron-H
(modeling_nemotron_h.py mamba2_chunk_scan, the function its NemotronHMamba2Mixer runs without the kernels)
at sequences longer than the chunk, and megatron-core's MambaMixer on it equal to HF's whole mixer at TP 1
and TP 2 with the shards the converter's splits build (Split.MAMBA_IN_PROJ, MAMBA_CONV, COLUMN, ROW).

TP 2 in one process, as tests/test_gated_delta_net_shapes.py does it: a TP rank of MambaMixer computes only
from its own heads and groups until out_proj's row-parallel all-reduce, so rank r is the mixer built at TP 1
with the rank's head and group counts on rank r's shards, and the output is the sum over ranks.

Guards (each a deliberately broken variant that must differ from HF far past the tolerance): the heads
served by each B/C group tiled rather than contiguous, each chunk scanned from a zero state (no state passed
between chunks), D dropped, in_proj split over TP as one column rather than part by part."""

from __future__ import annotations

import pytest
import torch
from transformers.models.nemotron_h import modeling_nemotron_h as hf

from toolkit.blocks.kernels.mamba2_ssd import mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined

# fp32: our einsums against HF's, the same chunked sums (seen: 0 for the scan, ~1e-7 for the whole mixer)
TOLERANCE = 1e-5
CHUNK = 8  # the scans run 37 tokens: four whole chunks and a partial one
# the mixer's sizes: 8 heads of 6 in 4 groups of state 5, so that TP 2 holds 4 heads in 2 groups
HIDDEN, HEADS, HEAD_DIM, GROUPS, STATE, KERNEL, SEQ = 48, 8, 6, 4, 5, 4, 37


def _scan_inputs(seed: int = 0, batch: int = 2, steps: int = SEQ, heads: int = 4, headdim: int = 3, groups: int = 2,
                 state: int = 5):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, steps, heads, headdim, generator=gen)
    dt = torch.randn(batch, steps, heads, generator=gen)
    A = -torch.rand(heads, generator=gen) * 2 - 0.1  # decays exp(dt A) of 0.1 to 0.95 per token
    B, C = (torch.randn(batch, steps, groups, state, generator=gen) for _ in range(2))
    D, dt_bias = torch.randn(heads, generator=gen), torch.randn(heads, generator=gen)
    initial = torch.randn(batch, heads, headdim, state, generator=gen)
    return x, dt, A, B, C, D, dt_bias, initial


def _hf_scan(x, dt, A, B, C, D, dt_bias, initial, chunk=CHUNK):
    return hf.mamba2_chunk_scan(x, dt, A, B, C, chunk_size=chunk, D=D, dt_bias=dt_bias, dt_softplus=True,
                                initial_states=initial, return_final_states=True)


def test_scan_equals_transformers_torch_scan_past_the_chunk():
    x, dt, A, B, C, D, dt_bias, initial = _scan_inputs()
    ours, ours_state = mamba_chunk_scan_combined(x, dt, A, B, C, CHUNK, D=D, dt_bias=dt_bias, dt_softplus=True,
                                                 initial_states=initial, return_final_states=True)
    reference, reference_state = _hf_scan(x, dt, A, B, C, D, dt_bias, initial)
    assert ours.shape == reference.shape == x.shape
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(ours_state, reference_state, rtol=0, atol=TOLERANCE)


def test_scan_result_does_not_depend_on_the_chunk_size():
    """The chunks only order the sums: 1, 8 and all 37 tokens in one chunk agree."""
    x, dt, A, B, C, D, dt_bias, initial = _scan_inputs(seed=1)
    runs = [mamba_chunk_scan_combined(x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, dt_softplus=True,
                                      initial_states=initial) for chunk in (1, CHUNK, SEQ)]
    for other in runs[1:]:
        torch.testing.assert_close(other, runs[0], rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("broken", ["groups-tiled", "no-state-between-chunks", "no-D"])
def test_guard_each_piece_of_the_scan_matters(broken):
    x, dt, A, B, C, D, dt_bias, initial = _scan_inputs()
    reference, _ = _hf_scan(x, dt, A, B, C, D, dt_bias, initial)
    if broken == "groups-tiled":  # head h served by group h % groups instead of h // (heads / groups)
        tiled = [t.repeat(1, 1, x.shape[2] // t.shape[2], 1) for t in (B, C)]
        other = mamba_chunk_scan_combined(x, dt, A, *tiled, CHUNK, D=D, dt_bias=dt_bias, dt_softplus=True,
                                          initial_states=initial)
    elif broken == "no-state-between-chunks":
        pieces = [mamba_chunk_scan_combined(*(t[:, s:s + CHUNK] for t in (x, dt)), A,
                                            *(t[:, s:s + CHUNK] for t in (B, C)), CHUNK, D=D, dt_bias=dt_bias,
                                            dt_softplus=True, initial_states=initial if s == 0 else None)
                  for s in range(0, SEQ, CHUNK)]
        other = torch.cat(pieces, dim=1)
    else:
        other = mamba_chunk_scan_combined(x, dt, A, B, C, CHUNK, dt_bias=dt_bias, dt_softplus=True,
                                          initial_states=initial)
    assert (other - reference).abs().max() > 100 * TOLERANCE


def _hf_mixer(seed: int = 0, dt_bias: float | None = None):
    """transformers' NemotronHMamba2Mixer with weights drawn so that every piece moves the output."""
    from transformers import NemotronHConfig

    config = NemotronHConfig(hidden_size=HIDDEN, layers_block_type=["linear_attention"], mamba_num_heads=HEADS,
                             mamba_head_dim=HEAD_DIM, n_groups=GROUPS, ssm_state_size=STATE, conv_kernel=KERNEL,
                             chunk_size=CHUNK, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                             vocab_size=64, intermediate_size=32)
    torch.manual_seed(seed)
    mixer = hf.NemotronHMamba2Mixer(config, layer_idx=0).eval()
    with torch.no_grad():
        for linear in (mixer.in_proj, mixer.out_proj):
            linear.weight.normal_(0.0, linear.in_features ** -0.5)
        mixer.conv1d.weight.uniform_(-0.6, 0.6)
        mixer.conv1d.bias.uniform_(-0.3, 0.3)
        mixer.A_log.copy_(torch.empty(HEADS).uniform_(0.05, 1.0).log())
        mixer.D.normal_(1.0, 0.5)
        if dt_bias is None:
            mixer.dt_bias.normal_(0.0, 0.5)
        else:
            mixer.dt_bias.fill_(dt_bias)
        mixer.norm.weight.uniform_(0.5, 1.5)
    return config, mixer


def test_split_kernel_equals_transformers_mixer():
    """The fused call (conv, scan, gated RMSNorm, out_proj from one in_proj output) against HF's whole mixer."""
    _, mixer = _hf_mixer()
    x = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        reference = mixer(x)
        ours = mamba_split_conv1d_scan_combined(
            mixer.in_proj(x), mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.dt_bias,
            -torch.exp(mixer.A_log.float()), mixer.D, CHUNK, rmsnorm_weight=mixer.norm.weight,
            rmsnorm_eps=mixer.norm.variance_epsilon, outproj_weight=mixer.out_proj.weight, headdim=HEAD_DIM,
            ngroups=GROUPS, norm_before_gate=False)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)


def _geometry():
    from toolkit.splits.kinds import Geometry

    return Geometry(num_heads=4, num_kv_heads=2, head_dim=12, vocab_size=64, padded_vocab_size=64,
                    mamba_heads=HEADS, mamba_head_dim=HEAD_DIM, mamba_groups=GROUPS, mamba_state=STATE)


# megatron-core MambaMixer tensor -> (HF NemotronHMamba2Mixer tensor, split)
def _rows():
    from toolkit.runtime.megatron_versions import mamba_conv_names
    from toolkit.splits import Split

    conv_weight, conv_bias = mamba_conv_names()
    return {"in_proj.weight": ("in_proj.weight", Split.MAMBA_IN_PROJ), conv_weight: ("conv1d.weight", Split.MAMBA_CONV),
            conv_bias: ("conv1d.bias", Split.MAMBA_CONV), "dt_bias": ("dt_bias", Split.COLUMN),
            "A_log": ("A_log", Split.COLUMN), "D": ("D", Split.COLUMN), "norm.weight": ("norm.weight", Split.COLUMN),
            "out_proj.weight": ("out_proj.weight", Split.ROW)}


def _shards(mixer, tp: int, guard: str | None) -> list[dict[str, torch.Tensor]]:
    from toolkit.convert.stages import TensorSource
    from toolkit.splits.kinds import build_shard

    src, geo = TensorSource({n: p.detach() for n, p in mixer.named_parameters()}), _geometry()
    out = []
    for rank in range(tp):
        shards = {}
        for name, (hf_name, split) in _rows().items():
            if guard == "in-proj-split-as-one-column" and name == "in_proj.weight":
                shards[name] = build_shard(split, src, (hf_name,), 1, 0, geo).chunk(tp)[rank]
            else:
                shards[name] = build_shard(split, src, (hf_name,), tp, rank, geo)
        out.append(shards)
    return out


def _megatron_mixer_output(shards: list[dict], x: torch.Tensor, mem_eff: bool = True) -> torch.Tensor:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from toolkit.blocks.mixer_mamba import mamba_mixer_spec

    tp, total = len(shards), 0
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
                               mamba_state_dim=STATE, mamba_head_dim=HEAD_DIM, mamba_num_groups=GROUPS // tp,
                               mamba_num_heads=HEADS // tp, hidden_dropout=0.0, attention_dropout=0.0,
                               use_mamba_mem_eff_path=mem_eff)
    for rank_shards in shards:
        module = build_module(mamba_mixer_spec(KERNEL, CHUNK), config, d_model=HIDDEN, layer_number=1,
                              pg_collection=ProcessGroupCollection.use_mpu_process_groups()).eval()
        missing, unexpected = module.load_state_dict(rank_shards, strict=False)
        assert not unexpected and all(m.endswith("_extra_state") for m in missing), (missing, unexpected)
        with torch.no_grad():
            out, bias = module(x.transpose(0, 1).contiguous())
        assert bias is None
        total = total + out.transpose(0, 1)
    return total


def sweep() -> dict:
    """Worker (one rank): {case: max |ours - HF| / max(1, max |HF|)} at TP 1 and 2 (the training path and, at
    TP 1, the prefill path), the guard, and the gap where HF clamps dt (see the test)."""
    from toolkit.runtime.distributed import init_parallel

    init_parallel(1, 1)
    results = {}
    x = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(7))
    # (case, TP, guard, dt_bias, megatron-core's memory-efficient (training) path, else its prefill path)
    cases = [("tp1", 1, None, None, True), ("tp2", 2, None, None, True), ("tp1-prefill-path", 1, None, None, False),
             ("tp2-prefill-path", 2, None, None, False),
             ("in-proj-split-as-one-column", 2, "in-proj-split-as-one-column", None, True),
             ("dt-below-time-step-min", 1, None, -12.0, True)]
    for name, tp, guard, dt_bias, mem_eff in cases:
        _, mixer = _hf_mixer(dt_bias=dt_bias)
        with torch.no_grad():
            reference = mixer(x)
        ours = _megatron_mixer_output(_shards(mixer, tp, guard), x, mem_eff)
        results[name] = ((ours - reference).abs().max() / reference.abs().max().clamp(min=1.0)).item()
    return results


@pytest.mark.multiprocess
def test_megatron_mamba_mixer_equals_transformers_at_tp1_and_tp2():
    """megatron-core's MambaMixer on the stand-in, holding the converter's shards, within 1e-5 of HF's mixer at
    TP 1 and TP 2; in_proj split as one column far off. Where softplus(dt + dt_bias) falls below
    time_step_min, HF clamps dt there (modeling_nemotron_h.py:415, time_step_limit = (time_step_min, inf))
    and megatron-core does not (mamba_mixer.py:755 passes no dt_limit: mamba_ssm's (0, inf)): that case is
    shown to differ, the one place the two layers are not the same function."""
    from toolkit.runtime.launch import run_on_processes

    results = run_on_processes("tests.test_mamba2_ssd:sweep", 1, cpu=True)[0]
    print("\n".join(f"{name}: {diff:.2e}" for name, diff in results.items()))
    for name in ("tp1", "tp2", "tp1-prefill-path", "tp2-prefill-path"):
        assert results[name] < TOLERANCE, (name, results)
    assert results["in-proj-split-as-one-column"] > 100 * TOLERANCE, results
    assert results["dt-below-time-step-min"] > 100 * TOLERANCE, results


def test_megatron_mamba_mixer_runs_the_stand_in_without_mamba_ssm():
    """megatron-core refuses to build MambaMixer without `mamba_ssm` (mamba_mixer.py:202); once a Mamba layer's
    spec is made its module holds the torch kernels and a real ExtendedRMSNorm (upstream's subclasses a
    MagicMock)."""
    from megatron.core.ssm import mamba_mixer

    from toolkit.blocks import mixer_mamba, norms
    from toolkit.blocks.kernels import mamba2_ssd

    mixer_mamba.mamba_mixer_spec(4, 8)
    assert mamba_mixer.HAVE_MAMBA_SSM
    if getattr(mamba_mixer, "TOOLKIT_MAMBA_SSD", False):
        for name in ("mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined", "RMSNormGated"):
            assert getattr(mamba_mixer, name) is getattr(mamba2_ssd, name)
        assert mamba_mixer.ExtendedRMSNorm is norms.ExtendedRMSNorm
