"""toolkit.blocks.attention_sdpa: the local spec's attention through torch's fused SDPA, against an
independent float64 attention written out here (scores, mask, softmax, values) and against
megatron-core's own DotProductAttention, outputs and the gradients of q, k and v.

Cases: causal with grouped-query heads; packed rows (a given mask, True = masked); a sliding
window; a window together with packed rows (where DotProductAttention's softmax drops the given
mask, fused_softmax.py:321-322, so only the float64 reference judges); attention sinks, which SDPA
cannot take (left to DotProductAttention: the same numbers); bfloat16. One launch (megatron-core's
attention needs its process group); on a GPU the same worker runs on CUDA (tests/test_gpu.py),
with the flash kernel forced where it applies."""

from __future__ import annotations

import math

import pytest
import torch

SEQ, BATCH, HEADS, GROUPS, DIM, WINDOW = 12, 2, 4, 2, 8, 4
FP32_TOLERANCE = 1e-5
BF16_TOLERANCE = 3e-2


def reference_attention(q, k, v, masked: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 attention, [s, b, heads, dim] in, [s, b, heads·dim] out; `masked` [b or 1, 1, s, s], True = masked."""
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    probs = torch.softmax(scores.masked_fill(masked, -math.inf), dim=-1)
    return (probs @ v).permute(2, 0, 1, 3).reshape(q.shape[2], q.shape[0], -1)


def masks(device):
    """Causal, the window's, packed rows' (two documents in row 0, three in row 1), and context
    parallelism's (rank 0 of 2: queries at positions 0-2 and 9-11 over all the keys); True = masked."""
    i = torch.arange(SEQ, device=device)
    causal = (i[None, :] > i[:, None])[None, None]
    window = causal | (i[:, None] - i[None, :] > WINDOW - 1)[None, None]
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 3 + [1] * 4 + [2] * 5], device=device)
    packed = causal | (docs[:, None, :, None] != docs[:, None, None, :])
    return causal, window, packed, causal[:, :, CP_RANK0_QUERIES]


CP_RANK0_QUERIES = [0, 1, 2, 9, 10, 11]


def compare_attention() -> dict:
    """Worker (one rank): every case's largest differences from the float64 reference and from
    DotProductAttention, for the output and for the gradients of q, k and v."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from toolkit.runtime.distributed import init_parallel
    from toolkit.blocks.attention_sdpa import SdpaAttention

    info = init_parallel(1, 1)
    device = info.device
    causal, window, packed, cp_queries = masks(device)
    cases = {  # name: (dtype, window, softmax type, given mask, the mask the reference applies, megatron comparable)
        "causal-gqa": (torch.float32, None, "vanilla", None, causal, True),
        "packed": (torch.float32, None, "vanilla", packed, packed, True),
        "window": (torch.float32, (WINDOW - 1, 0), "vanilla", None, window, True),
        "window-packed": (torch.float32, (WINDOW - 1, 0), "vanilla", packed, window | packed, False),
        "cp-queries-over-all-keys": (torch.float32, None, "vanilla", cp_queries, cp_queries, True),
        "sinks": (torch.float32, None, "learnable", None, None, True),
        "causal-bf16": (torch.bfloat16, None, "vanilla", None, causal, True),
        "guard-window-one-short": (torch.float32, (WINDOW - 2, 0), "vanilla", None, window, True),
    }
    out = {}
    for name, (dtype, win, softmax_type, given, reference_mask, comparable) in cases.items():
        queries = len(CP_RANK0_QUERIES) if name.startswith("cp") else SEQ
        config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                                   num_query_groups=GROUPS, kv_channels=DIM, attention_dropout=0.0,
                                   window_size=win, softmax_type=softmax_type, params_dtype=dtype,
                                   bf16=dtype == torch.bfloat16, use_cpu_initialization=device.type == "cpu")
        generator = torch.Generator().manual_seed(0)
        shapes = [(queries, BATCH, HEADS, DIM), (SEQ, BATCH, GROUPS, DIM), (SEQ, BATCH, GROUPS, DIM)]
        inputs = [torch.randn(s, generator=generator).to(device, dtype) for s in shapes]
        grad_out = torch.randn(queries, BATCH, HEADS * DIM, generator=generator).to(device, dtype)
        results = {}
        for cls in (SdpaAttention, DotProductAttention):
            module = cls(config, 1, AttnMaskType.causal, "self").to(device)
            if softmax_type == "learnable":
                with torch.no_grad():
                    module.softmax_offset.copy_(torch.linspace(-1, 1, HEADS, device=device, dtype=dtype))
            q, k, v = (t.clone().requires_grad_() for t in inputs)
            output = module(q, k, v, given)
            output.backward(grad_out)
            results[cls.__name__] = [output.detach(), q.grad, k.grad, v.grad]
            if cls is SdpaAttention:  # the fused kernel ran (DotProductAttention's would be a BmmBackward)
                row_kernel = output.grad_fn.next_functions[0][0].next_functions[0][0].name()
        row = {}
        if reference_mask is not None:
            q, k, v = (t.double().requires_grad_() for t in inputs)
            reference = reference_attention(q, k, v, reference_mask, 1 / math.sqrt(DIM))
            reference.backward(grad_out.double())
            expected = [reference.detach(), q.grad, k.grad, v.grad]
            row["vs_reference"] = max((a.double() - b).abs().max().item()
                                      for a, b in zip(results["SdpaAttention"], expected))
        if comparable:
            row["vs_megatron"] = max((a.double() - b.double()).abs().max().item()
                                     for a, b in zip(results["SdpaAttention"], results["DotProductAttention"]))
        row["device"] = str(results["SdpaAttention"][0].device)
        row["kernel"] = row_kernel
        out[name] = row
    if device.type == "cuda":  # the flash kernel itself takes the bf16 causal case
        from torch.nn.attention import SDPBackend, sdpa_kernel

        config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                                   num_query_groups=GROUPS, kv_channels=DIM, attention_dropout=0.0,
                                   params_dtype=torch.bfloat16, bf16=True)
        module = SdpaAttention(config, 1, AttnMaskType.causal, "self").to(device)
        q, k, v = (torch.randn(SEQ, BATCH, n, DIM, device=device, dtype=torch.bfloat16) for n in (HEADS, GROUPS, GROUPS))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            flash = module(q, k, v, None)
        out["flash"] = {"vs_reference": (flash.double() - reference_attention(q, k, v, causal, 1 / math.sqrt(DIM))).abs().max().item(),
                        "device": str(flash.device)}
    return out


def tolerance(name: str) -> float:
    return BF16_TOLERANCE if "bf16" in name or name == "flash" else FP32_TOLERANCE


def check(results: dict, device_type: str) -> None:
    print("\n".join(f"{name}: {row}" for name, row in results.items()))
    for name, row in results.items():
        assert row["device"].startswith(device_type), (name, row)
        if name.startswith("guard"):  # a window one key short is far outside the bar: the bar can fail
            assert row["vs_reference"] > 100 * FP32_TOLERANCE, row
            continue
        for key in ("vs_reference", "vs_megatron"):
            if key in row:
                assert row[key] < tolerance(name), (name, key, row)
    assert results["sinks"]["vs_megatron"] == 0.0  # left to DotProductAttention: the same numbers
    fused = {name for name, row in results.items() if "kernel" in row and "Attention" in row["kernel"]}
    assert fused == set(results) - {"sinks", "flash"}, {name: row.get("kernel") for name, row in results.items()}


def core_attentions() -> dict:
    """Worker (one rank): the core attention classes of each variant's local layer spec."""
    from toolkit.families import spec_from_config
    from toolkit.layouts import Layout
    from toolkit.model import layer_spec_module, transformer_config
    from toolkit.runtime.distributed import init_parallel
    from toolkit.tinymodels import make_config

    init_parallel(1, 1)
    found = {}
    for variant in ("llama", "gemma3", "qwen3", "deepseek-v3"):
        _, spec = spec_from_config(make_config(variant).to_dict())
        built = layer_spec_module("local", transformer_config(spec, Layout(1, 1), torch.float32), spec)
        layers = getattr(built, "layer_specs", [built])
        found[variant] = sorted({getattr(layer.submodules.self_attention.submodules, "core_attention", type(None)).__name__
                                 for layer in layers})
    return found


def both_workers() -> dict:
    return {"attention": compare_attention(), "specs": core_attentions()}


@pytest.mark.multiprocess
def test_sdpa_attention_matches_a_float64_reference_and_megatron_core_and_is_the_local_specs():
    """One launch: the comparisons above, and every layer with megatron-core's DotProductAttention gets
    SdpaAttention: the stock local spec (Llama, Qwen 3), a family's own block (Gemma 3); multi-latent
    attention (DeepSeek-V3) keeps its own class."""
    from toolkit.runtime.launch import run_on_processes

    result = run_on_processes("tests.test_sdpa_attention:both_workers", 1, cpu=True)[0]
    check(result["attention"], "cpu")
    assert result["specs"] == {"llama": ["SdpaAttention"], "gemma3": ["SdpaAttention"], "qwen3": ["SdpaAttention"],
                               "deepseek-v3": ["MLACoreAttention"]}, result["specs"]
