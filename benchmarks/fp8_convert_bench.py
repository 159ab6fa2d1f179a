"""Conversion of a DeepSeek-V3-shaped checkpoint with FP8 weights and 128 x 128 block scales, as published:
peak anonymous memory against the largest tensor (toolkit/convert/fp8.py dequantizes while reading).

    python benchmarks/fp8_convert_bench.py [--workdir DIR] [--layers 3] [--experts 16] [--bf16]

DeepSeek-V3's per-layer sizes (hidden 7168, 128 heads of 128 + 64 query / key dims and 128 value dims,
q_lora_rank 1536, kv_lora_rank 512, dense FFN 18432, experts of 2048, one shared expert) with fewer layers
and experts and a small vocabulary, written straight to safetensors (random float8_e4m3fn bytes, float32
scales, no model instantiated), one file per layer; converted by the CLI at TP2 x PP1 x EP2 (torch) in a
subprocess while /proc is sampled (benchmarks/convert_bench.py run_sampled). The expert bias is stored in
bf16 (the published files' is float32, a few KiB: no difference to memory).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from convert_bench import largest_file, run_sampled  # noqa: E402

MIB = 1 << 20
BLOCK = 128
V3 = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
          num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
          v_head_dim=128, n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1,
          routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6, vocab_size=8192, max_position_embeddings=163840,
          tie_word_embeddings=False, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], torch_dtype="bfloat16",
          rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                        "original_max_position_embeddings": 4096, "type": "yarn"}, rope_theta=10000,
          quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                               "weight_block_size": [BLOCK, BLOCK]})


def fp8(shape, bf16: bool = False) -> dict[str, torch.Tensor]:
    if bf16:  # the comparison: the same checkpoint already in bf16
        return {"": torch.randn(shape, dtype=torch.bfloat16)}
    weight = torch.randint(0, 0x7E, shape, dtype=torch.uint8).view(torch.float8_e4m3fn)  # finite, positive
    return {"": weight, "_scale_inv": torch.rand(*(math.ceil(n / BLOCK) for n in shape)) * 1e-2}


def layer_tensors(cfg: dict, layer: int, bf16: bool) -> dict[str, torch.Tensor]:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    p = f"model.layers.{layer}."
    projections = {
        "self_attn.q_a_proj": (cfg["q_lora_rank"], h),
        "self_attn.q_b_proj": (heads * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]), cfg["q_lora_rank"]),
        "self_attn.kv_a_proj_with_mqa": (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], h),
        "self_attn.kv_b_proj": (heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"]),
        "self_attn.o_proj": (h, heads * cfg["v_head_dim"]),
    }
    if layer < cfg["first_k_dense_replace"]:
        mlps = {"mlp": cfg["intermediate_size"]}
    else:
        mlps = {f"mlp.experts.{e}": cfg["moe_intermediate_size"] for e in range(cfg["n_routed_experts"])}
        mlps["mlp.shared_experts"] = cfg["moe_intermediate_size"] * cfg["n_shared_experts"]
    for mlp, ffn in mlps.items():
        projections.update({f"{mlp}.gate_proj": (ffn, h), f"{mlp}.up_proj": (ffn, h), f"{mlp}.down_proj": (h, ffn)})
    out = {f"{p}{name}.weight{suffix}": t for name, shape in projections.items() for suffix, t in fp8(shape, bf16).items()}
    out.update({f"{p}{n}.weight": torch.rand(size, dtype=torch.bfloat16) + 0.5 for n, size in (
        ("input_layernorm", h), ("post_attention_layernorm", h), ("self_attn.q_a_layernorm", cfg["q_lora_rank"]),
        ("self_attn.kv_a_layernorm", cfg["kv_lora_rank"]))})
    if layer >= cfg["first_k_dense_replace"]:
        out[f"{p}mlp.gate.weight"] = torch.randn(cfg["n_routed_experts"], h, dtype=torch.bfloat16) * 0.02
        out[f"{p}mlp.gate.e_score_correction_bias"] = torch.randn(cfg["n_routed_experts"], dtype=torch.bfloat16) * 0.1
    return out


def write_checkpoint(directory: Path, layers: int, experts: int, bf16: bool = False) -> tuple[dict, int]:
    from safetensors.torch import save_file

    cfg = dict(V3, num_hidden_layers=layers, n_routed_experts=experts)
    if bf16:
        del cfg["quantization_config"]
    directory.mkdir(parents=True)
    weight_map, largest = {}, 0
    embeddings = {"model.embed_tokens.weight": torch.randn(cfg["vocab_size"], cfg["hidden_size"], dtype=torch.bfloat16),
                  "lm_head.weight": torch.randn(cfg["vocab_size"], cfg["hidden_size"], dtype=torch.bfloat16),
                  "model.norm.weight": torch.ones(cfg["hidden_size"], dtype=torch.bfloat16)}
    for i, tensors in enumerate([embeddings] + [layer_tensors(cfg, n, bf16) for n in range(layers)]):
        name = f"model-{i:05d}.safetensors"
        save_file(tensors, directory / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        largest = max([largest] + [t.numel() * (2 if t.dtype == torch.float8_e4m3fn else t.element_size())
                                   for t in tensors.values()])  # as bf16 once dequantized
        del tensors
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    return cfg, largest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--bf16", action="store_true", help="the same checkpoint stored in bf16, for comparison")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        src, out = Path(tmp) / "hf", Path(tmp) / "megatron"
        _, largest = write_checkpoint(src, args.layers, args.experts, args.bf16)
        source_bytes = sum(f.stat().st_size for f in src.iterdir())
        run = run_sampled([sys.executable, "-m", "toolkit", "convert", "hf-to-megatron", str(src), str(out), "--tp", "2",
                           "--ep", "2", "--layer-spec", "local", "--no-progress"])
        print(f"source {source_bytes / MIB:.0f} MiB ({'bf16' if args.bf16 else 'FP8 + scales'}), output {sum(f.stat().st_size for f in out.rglob('*') if f.is_file()) / MIB:.0f} MiB "
              f"(bf16), largest output file {largest_file(out) / MIB:.0f} MiB, largest tensor as bf16 {largest / MIB:.0f} MiB; "
              f"converted in {run.wall:.1f} s, peak anonymous memory {run.peak_anon / MIB:.0f} MiB, peak RSS {run.peak_total / MIB:.0f} MiB")


if __name__ == "__main__":
    main()
