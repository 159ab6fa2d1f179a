"""Experts stored fused per layer (gpt-oss, Family.fused_experts), read and written one expert at a time.

Import: `FusedExpertsView` shows an HF checkpoint (HFCheckpoint's interface) with each layer's fused
expert tensors replaced by per-expert ones under the names the family's rows use
(`...experts.<e>.gate_proj.weight` [ffn, hidden] and so on), each read from the fused tensor by
slicing out one expert: memory holds one expert's weights, never a layer's. MXFP4 weights (the
published gpt-oss checkpoints, quantization_config.quant_method 'mxfp4') are dequantized to bf16 as
they are read: `dequantize_mxfp4` below, exact (every FP4 value times a power of two fits bf16).
Those per-expert tensors have no bytes in a file, so the converter builds them (never range-copies).

Export: `fuse_experts` collects a layer's per-expert tensors from the megatron checkpoint and writes
the fused HF tensors (bf16 or the checkpoint's dtype; never requantized).
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import Iterator

import torch

from toolkit.convert.hf_source import TensorEntry
from toolkit.errors import ConversionError
from toolkit.families.table import FusedExperts

# MXFP4 (OCP Microscaling, E2M1 elements): the 16 values of a 4-bit code, sign bit highest
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # elements sharing one scale
SCALE_BIAS = 127  # a scale byte s means 2 ** (s - 127) (E8M0)
BLOCKS, SCALES = "_blocks", "_scales"
QUANT_METHOD = "mxfp4"
# The per-expert names (after Family.fused_experts.per_expert) and what each is cut from
GATE, UP, DOWN = "gate_proj", "up_proj", "down_proj"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """[..., G, 16] uint8 codes (two per byte, the low nibble first) and [..., G] uint8 scales ->
    [..., G * 32] values: FP4_VALUES[code] * 2 ** (scale - 127)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ConversionError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match "
                              f"(expected [..., G, {MXFP4_BLOCK // 2}] and [..., G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., G, 16, 2]: the low nibble first
    values = lut[codes].reshape(*scales.shape, MXFP4_BLOCK)
    return (values * torch.exp2(scales.float() - SCALE_BIAS)[..., None]).reshape(*scales.shape[:-1], -1).to(dtype)


@dataclass(frozen=True)
class _Fused:
    """Where one layer's experts are: the fused weight names, and whether they are MXFP4."""

    gate_up: str
    down: str
    gate_up_bias: str
    down_bias: str
    mxfp4: bool


class FusedExpertsView:
    """An HF checkpoint with its fused experts shown per expert (HFCheckpoint's interface)."""

    def __init__(self, src, fused: FusedExperts):
        self.whole, self.fused, self.dir = src, fused, src.dir
        self.config = {k: v for k, v in src.config.items() if k != "quantization_config"}
        quant = src.config.get("quantization_config")
        if quant is not None and (not isinstance(quant, dict) or quant.get("quant_method") != QUANT_METHOD):
            raise ConversionError(f"{src.dir / 'config.json'} has quantization_config {quant!r}: only MXFP4 expert "
                                  f"weights (quant_method '{QUANT_METHOD}') are read, dequantized to bf16")
        # The export is bf16 and unquantized: its config.json says nothing of MXFP4
        self.config_bytes = src.config_bytes if quant is None else (json.dumps(self.config, indent=2) + "\n").encode()
        pattern = re.compile("^" + re.escape(fused.prefix).replace(r"\*", r"(\d+)") + r"([^.]+)$")
        self.tensors: dict[str, TensorEntry] = {}
        found: dict[int, set[str]] = {}
        for name, entry in src.tensors.items():
            m = pattern.match(name)
            if m:
                found.setdefault(int(m.group(1)), set()).add(m.group(2))
            else:
                self.tensors[name] = entry
        self.layers: dict[int, _Fused] = {layer: self._layer(layer, names) for layer, names in sorted(found.items())}
        self.dequantized = sorted(n for layer in self.layers.values() if layer.mxfp4 for n in (layer.gate_up, layer.down))
        self._cache = threading.local()  # per thread: the converter writes files on several
        self._virtual: dict[str, tuple[_Fused, int, str, str]] = {}  # name -> (layer, expert, part, weight / bias)
        for layer, where in self.layers.items():
            self._add_entries(layer, where)

    def _name(self, layer: int, suffix: str) -> str:
        return self.fused.prefix.replace("*", str(layer)) + suffix

    def _layer(self, layer: int, names: set[str]) -> _Fused:
        f = self.fused
        mxfp4 = {f.gate_up + BLOCKS, f.gate_up + SCALES, f.down + BLOCKS, f.down + SCALES} <= names
        biases = {f.gate_up_bias, f.down_bias} - {None}
        wanted = biases | ({f.gate_up + BLOCKS, f.gate_up + SCALES, f.down + BLOCKS, f.down + SCALES}
                           if mxfp4 else {f.gate_up, f.down})
        if names != wanted:
            odd = sorted(names - wanted) or sorted(wanted - names)
            raise ConversionError(f"layer {layer}'s fused experts are incomplete or mixed: "
                                  f"{'unexpected' if names - wanted else 'missing'} {self._name(layer, odd[0])!r} (a "
                                  f"layer holds {f.gate_up}, {f.down} or their MXFP4 {BLOCKS}/{SCALES}, and both biases)")
        return _Fused(*(None if n is None else self._name(layer, n + (BLOCKS if mxfp4 and n in (f.gate_up, f.down) else ""))
                        for n in (f.gate_up, f.down, f.gate_up_bias, f.down_bias)), mxfp4=mxfp4)

    def _add_entries(self, layer: int, where: _Fused) -> None:
        """Per expert: gate / up [ffn, hidden], down [hidden, ffn] and their biases, in the fused dtype
        (bf16 where MXFP4)."""
        src = self.whole
        if where.gate_up_bias is None:  # sizes from the weights (Gemma 4: [experts, 2 x ffn, hidden] as linear)
            shape = src.tensors[where.gate_up].shape
            experts, two_ffn, hidden = (shape if self.fused.as_linear else (shape[0], shape[2], shape[1])) \
                if len(shape) == 3 else (0, 0, 0)
            bias_dtype = None
        else:
            bias = src.tensors[where.gate_up_bias]
            experts, two_ffn = bias.shape if len(bias.shape) == 2 else (0, 0)
            hidden = src.tensors[where.down_bias].shape[-1]
            bias_dtype = bias.dtype
        dtype = "BF16" if where.mxfp4 else src.tensors[where.gate_up].dtype
        shapes = {GATE: (two_ffn // 2, hidden), UP: (two_ffn // 2, hidden), DOWN: (hidden, two_ffn // 2)}
        kinds = ("weight",) if bias_dtype is None else ("weight", "bias")
        for e in range(experts):
            base = self.fused.per_expert.replace("*", str(layer)).replace("#", str(e))
            for part, shape in shapes.items():
                self.tensors[f"{base}{part}.weight"] = TensorEntry(None, dtype, shape, 0)
                if bias_dtype is not None:
                    self.tensors[f"{base}{part}.bias"] = TensorEntry(None, bias_dtype, shape[:1], 0)
                self._virtual.update({f"{base}{part}.{kind}": (where, e, part, kind) for kind in kinds})
        self._check_shapes(layer, where, experts, two_ffn, hidden)

    def _check_shapes(self, layer: int, where: _Fused, experts: int, two_ffn: int, hidden: int) -> None:
        ffn = two_ffn // 2
        if where.mxfp4:
            expected = {where.gate_up: (experts, two_ffn, hidden // MXFP4_BLOCK, MXFP4_BLOCK // 2),
                        where.gate_up.replace(BLOCKS, SCALES): (experts, two_ffn, hidden // MXFP4_BLOCK),
                        where.down: (experts, hidden, ffn // MXFP4_BLOCK, MXFP4_BLOCK // 2),
                        where.down.replace(BLOCKS, SCALES): (experts, hidden, ffn // MXFP4_BLOCK)}
        elif self.fused.as_linear:
            expected = {where.gate_up: (experts, two_ffn, hidden), where.down: (experts, hidden, ffn)}
        else:
            expected = {where.gate_up: (experts, hidden, two_ffn), where.down: (experts, ffn, hidden)}
        if where.down_bias is not None:
            expected[where.down_bias] = (experts, hidden)
        for name, shape in expected.items():
            if self.whole.shape(name) != shape:
                raise ConversionError(f"tensor {name!r} has shape {list(self.whole.shape(name))} but layer {layer}'s "
                                      f"biases imply {list(shape)} (experts, 2 x ffn = {two_ffn}, hidden = {hidden})")

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        if self.tensors[name].file is not None:
            return self.whole.read(name, rows, cols)
        t = self._expert_tensor(name)
        t = t if rows is None else t[rows]
        return (t if cols is None else t[:, cols]).contiguous()

    def _expert_tensor(self, name: str) -> torch.Tensor:
        where, e, part, kind = self._virtual[name]
        if kind == "bias":
            bias = self._one(where.down_bias if part == DOWN else where.gate_up_bias, e, None)
            return bias if part == DOWN else bias[0::2] if part == GATE else bias[1::2]
        as_stored = where.mxfp4 or self.fused.as_linear  # [out, in] as stored (MXFP4, Gemma 4), else [in, out] (x @ W)
        if part == DOWN:  # [hidden, ffn]
            return self._one(where.down, e, where.mxfp4) if as_stored else self._one(where.down, e, False).T
        gate_up = self._one(where.gate_up, e, where.mxfp4)  # [2 ffn, hidden] (MXFP4, Gemma 4) or [hidden, 2 ffn]
        gate_up = gate_up if as_stored else gate_up.T
        if not self.fused.interleaved:  # [gate; up] halves
            half = gate_up.shape[0] // 2
            return gate_up[:half] if part == GATE else gate_up[half:]
        return gate_up[0::2] if part == GATE else gate_up[1::2]

    def _one(self, name: str, expert: int, mxfp4: bool | None) -> torch.Tensor:
        """Expert `expert` of fused tensor `name` (dequantized where MXFP4), the last one kept: the
        gate and the up projection are cut from the same tensor."""
        key = (name, expert)
        if getattr(self._cache, "key", None) != key:
            one = slice(expert, expert + 1)
            value = self.whole.read(name, rows=one)[0]
            if mxfp4:
                value = dequantize_mxfp4(value, self.whole.read(name.replace(BLOCKS, SCALES), rows=one)[0])
            self._cache.key, self._cache.value = key, value
        return self._cache.value

    def tokenizer_files(self):
        return self.whole.tokenizer_files()


def fused_view(src, fused: FusedExperts | None):
    return src if fused is None else FusedExpertsView(src, fused)


def _per_expert_pattern(fused: FusedExperts) -> re.Pattern:
    """Matches the per-expert names: groups layer, expert, part (gate_proj / up_proj / down_proj), weight or bias."""
    head, tail = fused.per_expert.split("*")
    return re.compile("^" + re.escape(head) + r"(\d+)" + re.escape(tail.split("#")[0]) + r"(\d+)\.(\w+)\.(weight|bias)$")


def fused_layers(fused: FusedExperts, num_experts: int, names, read) -> Iterator[tuple[str, torch.Tensor]]:
    """The export's tensors: every other tensor first, then each layer's experts fused, read one layer at a
    time (`read(wanted names)` yields (HF name, tensor)), so memory holds one layer's experts."""
    pattern = _per_expert_pattern(fused)
    layers: dict[int, set[str]] = {}
    for name in names:
        if m := pattern.match(name):
            layers.setdefault(int(m.group(1)), set()).add(name)
    yield from read(set(names) - set().union(*layers.values()))
    for layer in sorted(layers):
        yield from fuse_experts(fused, num_experts, read(layers[layer]))


def fuse_experts(fused: FusedExperts, num_experts: int, tensors: Iterator[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs with each layer's per-expert tensors replaced by the fused ones, each
    written once all experts of it have come."""
    pattern = _per_expert_pattern(fused)
    pending: dict[tuple[int, str], dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in tensors:
        m = pattern.match(name)
        if not m:
            yield name, tensor
            continue
        layer, expert, part, kind = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
        target = (fused.down if part == DOWN else fused.gate_up) + ("_bias" if kind == "bias" else "")
        slot = pending.setdefault((layer, target), {})
        slot[(expert, part)] = tensor
        if len(slot) == num_experts * (1 if part == DOWN else 2):
            yield fused.prefix.replace("*", str(layer)) + target, _fused_tensor(pending.pop((layer, target)), num_experts,
                                                                               kind == "bias", fused)
    if pending:
        raise ConversionError(f"the checkpoint holds only some experts of {sorted(pending)[0]}: not a complete model")


def _fused_tensor(parts: dict[tuple[int, str], torch.Tensor], experts: int, bias: bool,
                  fused: FusedExperts | None = None) -> torch.Tensor:
    """The fused HF tensor, filled expert by expert as each expert's tensors are let go."""
    down = (0, DOWN) in parts
    first = parts[(0, DOWN if down else GATE)]  # [hidden] / [ffn] biases, [hidden, ffn] / [ffn, hidden] weights
    if fused is not None and fused.as_linear and not fused.interleaved:  # Gemma 4: [out, in] stacked, [gate; up]
        out = torch.empty((experts, *first.shape) if down else (experts, 2 * first.shape[0], first.shape[1]),
                          dtype=first.dtype)
        for e in range(experts):
            out[e] = parts.pop((e, DOWN)) if down else torch.cat([parts.pop((e, GATE)), parts.pop((e, UP))])
        return out
    if bias:
        shape = (experts, first.shape[0] * (1 if down else 2))
    else:
        shape = (experts, *first.shape[::-1]) if down else (experts, first.shape[1], 2 * first.shape[0])
    out = torch.empty(shape, dtype=first.dtype)
    for e in range(experts):
        if down:  # [experts, hidden] biases, or [experts, ffn, hidden]: each [hidden, ffn] transposed
            t = parts.pop((e, DOWN))
            out[e] = t if bias else t.T
            continue
        gate, up = parts.pop((e, GATE)), parts.pop((e, UP))  # interleaved: gate at the even places
        out[e, ..., 0::2], out[e, ..., 1::2] = (gate, up) if bias else (gate.T, up.T)
    return out
