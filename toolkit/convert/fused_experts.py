"""Experts stored fused per layer (Family.fused_experts: gpt-oss; Qwen3.5-MoE where a checkpoint holds them so),
read and written one expert at a time, in either layout of FusedExperts.layout (toolkit/families/table.py:
gpt-oss's interleaved x @ W, with biases; transformers 5's [gate; up] halves as nn.Linear, without; Llama 4's
[gate | up] halves as x @ W, without).

Import: `FusedExpertsView` shows an HF checkpoint (HFCheckpoint's interface) with each layer's fused
expert tensors replaced by per-expert ones under the names the family's rows use
(`...experts.<e>.gate_proj.weight` [ffn, hidden] and so on), each read from the fused tensor by
slicing out one expert: memory holds one expert's weights, never a layer's. Per-expert tensors in the
checkpoint (as transformers saves Qwen3.5-MoE) are passed through as stored. MXFP4 weights (the
published gpt-oss checkpoints, quantization_config.quant_method 'mxfp4') are dequantized to bf16 as
they are read: `dequantize_mxfp4` below, exact (every FP4 value times a power of two fits bf16).
Those per-expert tensors have no bytes in a file, so the converter builds them (never range-copies).

Export (where FusedExperts.export_fused): `fuse_experts` collects a layer's per-expert tensors from the
megatron checkpoint and writes the fused HF tensors in the family's layout (bf16 or the checkpoint's dtype;
never requantized).
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
    """Where one layer's experts are: the fused weight names, their biases' (None: none), whether MXFP4."""

    gate_up: str
    down: str
    gate_up_bias: str | None
    down_bias: str | None
    mxfp4: bool
    # Stored for x @ W ([experts, in, out]); else [out, in] as nn.Linear (FusedExperts.either_orientation: per tensor, by shape)
    gate_up_t: bool = False
    down_t: bool = False


class FusedExpertsView:
    """An HF checkpoint with its fused experts shown per expert (HFCheckpoint's interface)."""

    def __init__(self, src, fused: FusedExperts):
        self.whole, self.fused, self.dir = src, fused, src.dir
        quant = src.config.get("quantization_config") if fused.mxfp4 else None  # others: read by the view below
        if quant is not None and (not isinstance(quant, dict) or quant.get("quant_method") != QUANT_METHOD):
            raise ConversionError(f"{src.dir / 'config.json'} has quantization_config {quant!r}: only MXFP4 expert "
                                  f"weights (quant_method '{QUANT_METHOD}') are read, dequantized to bf16")
        self.config = src.config if quant is None else {k: v for k, v in src.config.items()
                                                         if k != "quantization_config"}
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

    def _stored(self, name: str) -> str:
        """A tensor's name in the files (a wrapper's language model: model.language_model.*), for messages."""
        stored = getattr(self.whole, "stored_name", None)
        return name if stored is None else stored(name)

    def _layer(self, layer: int, names: set[str]) -> _Fused:
        f = self.fused
        quantized = {f.gate_up + BLOCKS, f.gate_up + SCALES, f.down + BLOCKS, f.down + SCALES}
        mxfp4 = f.mxfp4 and quantized <= names
        biases = {f.gate_up_bias, f.down_bias} if f.biases else set()
        wanted = biases | (quantized if mxfp4 else {f.gate_up, f.down})
        if names != wanted:
            odd = sorted(names - wanted) or sorted(wanted - names)
            holds = (f"{f.gate_up}, {f.down}" + (f" or their MXFP4 {BLOCKS}/{SCALES}" if f.mxfp4 else "")
                     + (", and both biases" if f.biases else ", without biases"))
            odd_name = self._stored(self._name(layer, odd[0]))
            raise ConversionError(f"layer {layer}'s fused experts are incomplete or mixed: "
                                  f"{'unexpected' if names - wanted else 'missing'} {odd_name!r} "
                                  f"(a layer holds {holds})")

        def weight(n):
            return self._name(layer, n + (BLOCKS if mxfp4 else ""))

        def bias(n):
            return None if n is None else self._name(layer, n)

        gate_up, down = weight(f.gate_up), weight(f.down)
        gate_up_t = down_t = f.transposed and not mxfp4
        if f.either_orientation and not mxfp4:  # as transformers' Transpose(check_dims): as stored iff the module's shape
            gate_up_t, down_t = self._transposed(gate_up, "gate_up"), self._transposed(down, "down")
        return _Fused(gate_up, down, bias(f.gate_up_bias), bias(f.down_bias), mxfp4=mxfp4, gate_up_t=gate_up_t,
                      down_t=down_t)

    def _transposed(self, name: str, which: str) -> bool:
        """Whether a tensor of FusedExperts.either_orientation is stored for x @ W: not where its shape is the module's
        ([experts, 2 x ffn, hidden] / [experts, hidden, ffn], the config's hidden_size and moe_intermediate_size)."""
        shape = self.whole.shape(name)
        hidden, ffn = self.config.get("hidden_size"), self.config.get("moe_intermediate_size")
        module = (2 * ffn, hidden) if which == "gate_up" else (hidden, ffn)
        return not (len(shape) == 3 and tuple(shape[1:]) == module)

    def _sizes(self, layer: int, where: _Fused) -> tuple[int, int, int]:
        """(experts, 2 x ffn, hidden) as the layer's fused gate_up holds them (its layout, or MXFP4's)."""
        shape = self.whole.shape(where.gate_up)
        rank = 4 if where.mxfp4 else 3
        if len(shape) == rank:
            experts, a, b = shape[:3]
            two_ffn, hidden = ((a, b * MXFP4_BLOCK) if where.mxfp4 else (b, a) if where.gate_up_t else (a, b))
            if two_ffn % 2 == 0:
                return experts, two_ffn, hidden
        laid = ("[experts, 2 x ffn, hidden / 32, 16] (MXFP4)" if where.mxfp4 else
                "[experts, hidden, 2 x ffn]" if where.gate_up_t else "[experts, 2 x ffn, hidden]")
        raise ConversionError(f"tensor {self._stored(where.gate_up)!r} has shape {list(shape)}; layer {layer}'s fused "
                              f"gate and up projections are {laid}, 2 x ffn even")

    def _add_entries(self, layer: int, where: _Fused) -> None:
        """Per expert: gate / up [ffn, hidden], down [hidden, ffn] and their biases, in the fused dtype
        (bf16 where MXFP4)."""
        src = self.whole
        experts, two_ffn, hidden = self._sizes(layer, where)
        self._check_shapes(layer, where, experts, two_ffn, hidden)
        dtype = "BF16" if where.mxfp4 else src.tensors[where.gate_up].dtype
        bias_dtype = src.tensors[where.gate_up_bias].dtype if where.gate_up_bias else None
        shapes = {GATE: (two_ffn // 2, hidden), UP: (two_ffn // 2, hidden), DOWN: (hidden, two_ffn // 2)}
        kinds = ("weight", "bias") if where.gate_up_bias else ("weight",)
        for e in range(experts):
            base = self.fused.per_expert.replace("*", str(layer)).replace("#", str(e))
            for part, shape in shapes.items():
                weight = f"{base}{part}.weight"
                if weight in self.tensors:
                    raise ConversionError(f"layer {layer} holds its experts both fused ({self._stored(where.gate_up)!r})"
                                          f" and per expert ({self._stored(weight)!r}): not a checkpoint transformers "
                                          "loads")
                self.tensors[weight] = TensorEntry(None, dtype, shape, 0)
                if where.gate_up_bias:
                    self.tensors[f"{base}{part}.bias"] = TensorEntry(None, bias_dtype, shape[:1], 0)
                self._virtual.update({f"{base}{part}.{kind}": (where, e, part, kind) for kind in kinds})

    def _check_shapes(self, layer: int, where: _Fused, experts: int, two_ffn: int, hidden: int) -> None:
        ffn = two_ffn // 2
        if where.mxfp4:
            expected = {where.gate_up: (experts, two_ffn, hidden // MXFP4_BLOCK, MXFP4_BLOCK // 2),
                        where.gate_up.replace(BLOCKS, SCALES): (experts, two_ffn, hidden // MXFP4_BLOCK),
                        where.down: (experts, hidden, ffn // MXFP4_BLOCK, MXFP4_BLOCK // 2),
                        where.down.replace(BLOCKS, SCALES): (experts, hidden, ffn // MXFP4_BLOCK)}
        else:  # x @ W, or nn.functional.linear: [out, in]
            expected = {where.gate_up: (experts, hidden, two_ffn) if where.gate_up_t else (experts, two_ffn, hidden),
                        where.down: (experts, ffn, hidden) if where.down_t else (experts, hidden, ffn)}
        if where.gate_up_bias:
            expected[where.gate_up_bias] = (experts, two_ffn)
            expected[where.down_bias] = (experts, hidden)
        for name, shape in expected.items():
            if self.whole.shape(name) != shape:
                raise ConversionError(f"tensor {self._stored(name)!r} has shape {list(self.whole.shape(name))} but "
                                      f"layer {layer}'s {where.gate_up.rsplit('.', 1)[-1]} implies {list(shape)} "
                                      f"(experts = {experts}, 2 x ffn = {two_ffn}, hidden = {hidden})")

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
            return bias if part == DOWN else self._gate_or_up(bias, part)
        # Stored [out, in] as nn.Linear where MXFP4 or in the halves layout; transposed (x @ W) in gpt-oss's bf16
        # and Llama 4's, Qwen3-VL-MoE's (per tensor: FusedExperts.either_orientation)
        if part == DOWN:  # [hidden, ffn]
            down = self._one(where.down, e, where.mxfp4)
            return down.T if where.down_t else down
        gate_up = self._one(where.gate_up, e, where.mxfp4)  # [2 ffn, hidden] or transposed
        return self._gate_or_up(gate_up.T if where.gate_up_t else gate_up, part)

    def _gate_or_up(self, rows: torch.Tensor, part: str) -> torch.Tensor:
        """The gate's or the up projection's rows of a [2 ffn, ...] tensor: interleaved (gate at the even
        places) or [gate; up] halves."""
        if self.fused.interleaved:
            return rows[0::2] if part == GATE else rows[1::2]
        half = rows.shape[0] // 2
        return rows[:half] if part == GATE else rows[half:]

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
        target = ((fused.down_bias if part == DOWN else fused.gate_up_bias) if kind == "bias" else
                  fused.down if part == DOWN else fused.gate_up)
        slot = pending.setdefault((layer, target), {})
        slot[(expert, part)] = tensor
        if len(slot) == num_experts * (1 if part == DOWN else 2):
            yield fused.prefix.replace("*", str(layer)) + target, _fused_tensor(fused, pending.pop((layer, target)),
                                                                               num_experts, kind == "bias")
    if pending:
        raise ConversionError(f"the checkpoint holds only some experts of {sorted(pending)[0]}: not a complete model")


def _fused_tensor(fused: FusedExperts, parts: dict[tuple[int, str], torch.Tensor], experts: int,
                  bias: bool) -> torch.Tensor:
    """The fused HF tensor in `fused.layout`, filled expert by expert as each expert's tensors are let go."""
    down = (0, DOWN) in parts
    first = parts[(0, DOWN if down else GATE)]  # [hidden] / [ffn] biases, [hidden, ffn] / [ffn, hidden] weights
    transposed = fused.transposed and not bias  # gpt-oss, Llama 4, Qwen3-VL-MoE: x @ W; the halves layout as nn.Linear, [out, in]
    if bias:
        shape = (experts, first.shape[0] * (1 if down else 2))
    elif down:
        shape = (experts, *(first.shape[::-1] if transposed else first.shape))
    else:
        shape = (experts, first.shape[1], 2 * first.shape[0]) if transposed else (experts, 2 * first.shape[0],
                                                                                  first.shape[1])
    out = torch.empty(shape, dtype=first.dtype)
    for e in range(experts):
        if down:  # [experts, hidden] biases, or each [hidden, ffn] as it is or transposed
            t = parts.pop((e, DOWN))
            out[e] = t.T if transposed else t
            continue
        gate, up = parts.pop((e, GATE)), parts.pop((e, UP))
        if transposed and fused.interleaved:  # [hidden, 2 ffn], interleaved: gate at the even places
            out[e, :, 0::2], out[e, :, 1::2] = gate.T, up.T
        elif transposed:  # [hidden, 2 ffn]: [gate | up] halves of the last dimension
            out[e] = torch.cat((gate, up)).T
        elif fused.interleaved:  # biases
            out[e, 0::2], out[e, 1::2] = gate, up
        else:  # [gate; up]
            out[e] = torch.cat((gate, up))
    return out
