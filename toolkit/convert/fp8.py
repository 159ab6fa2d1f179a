"""Checkpoints published with FP8 weights and block scales (DeepSeek-V3 / R1, Kimi-K2: config.json
`quantization_config` {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
"activation_scheme": "dynamic"}), read as bf16 one tensor slice at a time.

A quantized linear's `<name>.weight` is float8_e4m3fn [rows, cols] beside `<name>.weight_scale_inv`, float32
[ceil(rows / 128), ceil(cols / 128)]: block (i, j) covers rows [128 i, 128 i + 128) and columns
[128 j, 128 j + 128), cut at the tensor's edge. The reference dequantization is DeepSeek's
`weight_dequant` (deepseek-ai/DeepSeek-V3 inference/kernel.py, used by inference/fp8_cast_bf16.py with
bf16 as the default dtype): y = bf16(float32(x) * s) with s the block's scale, the last blocks partial;
transformers' `_dequantize_fp8_weight` (integrations/finegrained_fp8.py:285-303) computes the same
(scales repeated over rows then cut, columns in whole blocks plus the remainder). Fp8View does it for
the rows and columns a split asks for, reading only the scales of the blocks they touch, so memory
stays bounded by a tensor. The other tensors (embeddings, norms, routers, the head) are read as stored.

The converted checkpoint is bf16 and its config.json has no quantization_config (the copy beside it is
written without one): exported back to HF it is a bf16 checkpoint, as fp8_cast_bf16.py writes.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import torch

from toolkit.convert.hf_source import HFCheckpoint, TensorEntry
from toolkit.errors import ConversionError

SCALE_SUFFIX = "_scale_inv"
FP8 = "F8_E4M3"
# The dtype the weights are dequantized to (DeepSeek's fp8_cast_bf16.py: torch.set_default_dtype(bfloat16))
DEQUANTIZED = "BF16"
ACCEPTED = {"fmt": "e4m3", "activation_scheme": "dynamic"}
# The same format under torch's name, as MiniMax-M2's config.json writes it (its weights F8_E4M3, the scales
# float32 `weight_scale_inv` per 128 x 128 block, as DeepSeek-V3's)
FMT_ALIASES = {"float8_e4m3fn": "e4m3"}


def is_fp8(cfg: dict) -> bool:
    """config.json declares FP8 weights (gpt-oss's MXFP4 is toolkit/convert/fused_experts.py's)."""
    quantization = cfg.get("quantization_config")
    return isinstance(quantization, dict) and quantization.get("quant_method") == "fp8"


def block_size(cfg: dict) -> tuple[int, int]:
    """The (rows, columns) of a scale block, refusing a quantization this module does not read."""
    q = cfg["quantization_config"]
    for key, value in ACCEPTED.items():
        if FMT_ALIASES.get(q.get(key), q.get(key, value)) != value:
            raise ConversionError(f"config.json quantization_config.{key}={q.get(key)!r} is not supported: only FP8 "
                                  f"weights with block scales (quant_method='fp8', {', '.join(f'{k}={v!r}' for k, v in ACCEPTED.items())}) are "
                                  "dequantized on conversion")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise ConversionError(f"config.json quantization_config.weight_block_size={block!r}: expected two positive "
                              "integers (rows, columns), e.g. [128, 128]")
    return block[0], block[1]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], row0: int = 0,
               col0: int = 0) -> torch.Tensor:
    """bf16(float32(weight) * scale of its block) for `weight`, the FP8 slice starting at (row0, col0)
    of its tensor, and `scale`, the scale rows and columns of the blocks from row0 // rows and
    col0 // columns on. One block row at a time, so the float32 temporaries stay a block row's."""
    rows, cols = weight.shape
    out = torch.empty(rows, cols, dtype=torch.bfloat16)
    col_blocks = (torch.arange(col0, col0 + cols) // block[1]) - col0 // block[1]
    start = 0
    while start < rows:
        stop = min(rows, start + block[0] - (row0 + start) % block[0])  # to the end of this block row
        row_scale = scale[(row0 + start) // block[0] - row0 // block[0]].to(torch.float32)[col_blocks]
        out[start:stop] = (weight[start:stop].to(torch.float32) * row_scale).to(torch.bfloat16)
        start = stop
    return out


class Fp8View:
    """An HFCheckpoint whose FP8 weights read as bf16 (HFCheckpoint's interface): the scales are not
    tensors of the view, each quantized weight is a BF16 entry marked `stored` FP8 (never byte-copied)."""

    def __init__(self, src: HFCheckpoint):
        self.whole, self.dir = src, src.dir
        self.block = block_size(src.config)
        self.config = {k: v for k, v in src.config.items() if k != "quantization_config"}
        self.config_bytes = (json.dumps(self.config, indent=2, sort_keys=True) + "\n").encode()
        self.tensors: dict[str, TensorEntry] = {}
        for name, entry in src.tensors.items():
            if name.endswith(SCALE_SUFFIX):
                if name.removesuffix(SCALE_SUFFIX) not in src.tensors:
                    raise ConversionError(f"{entry.file}: {name!r} scales no tensor of the checkpoint")
                continue
            scale = src.tensors.get(name + SCALE_SUFFIX)
            if entry.dtype == FP8 and scale is None:
                raise ConversionError(f"{entry.file}: tensor {name!r} is FP8 without its {name + SCALE_SUFFIX!r}")
            if scale is not None:
                self._check(name, entry, scale)
                entry = replace(entry, dtype=DEQUANTIZED, stored=FP8)
            self.tensors[name] = entry

    def _check(self, name: str, entry: TensorEntry, scale: TensorEntry) -> None:
        grid = tuple(math.ceil(n / b) for n, b in zip(entry.shape, self.block)) if len(entry.shape) == 2 else None
        if entry.dtype != FP8 or scale.dtype != "F32" or scale.shape != grid:
            raise ConversionError(f"{entry.file}: {name!r} ({entry.dtype} {list(entry.shape)}) with scales ({scale.dtype} "
                                  f"{list(scale.shape)}) is not an FP8 weight with float32 scales per "
                                  f"{self.block[0]} x {self.block[1]} block (expected scales {list(grid or ())})")

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        if self.tensors[name].stored is None:
            return self.whole.read(name, rows, cols)
        height, width = self.tensors[name].shape
        r = slice(*(rows or slice(None)).indices(height)[:2])
        c = slice(*(cols or slice(None)).indices(width)[:2])
        weight = self.whole.read(name, r, c)
        scale_rows = slice(r.start // self.block[0], -(-r.stop // self.block[0]))
        scale_cols = slice(c.start // self.block[1], -(-c.stop // self.block[1]))
        scale = self.whole.read(name + SCALE_SUFFIX, scale_rows, scale_cols)
        return dequantize(weight, scale, self.block, r.start, c.start)

    def tokenizer_files(self) -> list[Path]:
        return self.whole.tokenizer_files()
