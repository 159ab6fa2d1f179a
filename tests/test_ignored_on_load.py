"""The tensors HF's model ignores on load, one list per checkpoint (toolkit/convert/ignored.py): stored
rotary buffers (transformers' own rule, any family, a wrapper's tensors too) and multi-token-prediction
layers (after the decoder layers, Family.mtp_key; under a prefix, Family.mtp_prefix). Each kind is left
out of the conversion with a line, and the export neither writes it nor keeps quiet about it."""

from __future__ import annotations

import re

import pytest
import torch

from tests.test_convert_bad_input import edit_config, edit_tensors
from tests.test_convert_roundtrip import load_all
from toolkit.convert import hf_to_megatron, megatron_to_hf
from toolkit.convert.ignored import MTP, ignored_on_load
from toolkit.convert.wrapper import WRAPPERS
from toolkit.families import FAMILIES
from toolkit.tinymodels import make_tiny_gemma3_multimodal, make_tiny_model

# A name of a published checkpoint's tensor each of transformers' ignore patterns names
_LAYER_PATTERN = re.compile(r"^\^?model\\\.layers\\\.(\d+)\.\*$")


def test_the_family_rules_cover_what_the_installed_class_ignores_on_load():
    """Every pattern of the installed class's `_keys_to_ignore_on_load_unexpected` (GLM-4.5's and DeepSeek-V3's
    MTP layer of the published sizes, Qwen3-Next's `mtp.*`) names tensors the family's rules leave out, in a
    config of the size it names with one MTP layer; a class that lists a pattern of another shape fails here."""
    import transformers

    covered = {}
    for family in FAMILIES:
        patterns = getattr(getattr(transformers, family.architecture), "_keys_to_ignore_on_load_unexpected", None) or ()
        for pattern in patterns:
            layer = _LAYER_PATTERN.match(pattern)
            if pattern == "^model.visual.*":  # a VL checkpoint's vision tower, which its text class leaves out:
                assert family.name in {w.model_type for w in WRAPPERS}, family.name  # the wrapper route keeps it
                continue  # (toolkit/convert/wrapper.py other_tensors; tests/test_family_qwen3_5.py)
            if layer:
                cfg = {"num_hidden_layers": int(layer.group(1)), family.mtp_key: 1}
                name = f"model.layers.{layer.group(1)}.mlp.gate.weight"
            else:
                assert pattern in ("^mtp.*", "mtp.*"), (family.name, pattern)  # Nemotron-H's without the anchor
                cfg, name = {"num_hidden_layers": 4}, "mtp.fc.weight"
            assert re.search(pattern, name)  # as transformers matches (_adjust_missing_and_unexpected_keys)
            assert ignored_on_load([name, "model.embed_tokens.weight"], cfg, family) == {MTP: [name]}, (family.name, pattern)
            covered[family.name] = covered.get(family.name, 0) + 1
    assert set(covered) == {"glm4_moe", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "qwen3_next", "qwen3_5", "qwen3_5_moe", "glm4v_moe",
                            "olmo_hybrid", "nemotron_h"}, covered


def _add_mtp_after_layers(src, layers: int) -> list[str]:
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    layer = {k.replace(last, mtp): v.clone() for k, v in load_all(src).items() if k.startswith(last)}
    edit_tensors(src, lambda t: t.update(layer))
    edit_config(src, num_nextn_predict_layers=1)
    return sorted(layer)


def _case(kind: str, root):
    """(HF dir, the tensors added that HF ignores, convert kwargs, the conversion's line, the export's, wrapper)."""
    if kind == "rotary":
        src = make_tiny_model("llama", root, dtype="bfloat16", seed=3)
        added = [f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in (0, 1)]
        edit_tensors(src, lambda t: t.update({n: torch.ones(8) for n in added}))
        return (src, added, {}, f"2 stored rotary frequency buffer(s) (e.g. {added[0]!r}) are left out",
                "2 stored rotary frequency buffer(s)", None)
    if kind == "rotary-in-wrapper":  # the language model's and one beside it, which the export copies otherwise
        src = make_tiny_gemma3_multimodal(root, dtype="bfloat16", seed=3)
        added = ["language_model.model.layers.0.self_attn.rotary_emb.inv_freq", "vision_tower.rotary_emb.inv_freq"]
        edit_tensors(src, lambda t: t.update({n: torch.ones(8) for n in added}))
        return (src, added, {}, "2 stored rotary frequency buffer(s)", "2 stored rotary frequency buffer(s)", src)
    if kind == "mtp-after-layers":
        src = make_tiny_model("glm4-moe", root, dtype="bfloat16", seed=3)
        added = _add_mtp_after_layers(src, 4)
        return (src, added, {"ep": 2}, f"(num_nextn_predict_layers=1, {len(added)} tensors from model.layers.4.) are "
                "left out", f"{len(added)} multi-token-prediction tensor(s)", None)
    src = make_tiny_model("qwen3-next", root, dtype="bfloat16", seed=3)
    added = ["mtp.fc.weight", "mtp.norm.weight"]
    edit_tensors(src, lambda t: t.update({added[0]: torch.zeros(8, 16, dtype=torch.bfloat16),
                                          added[1]: torch.ones(8, dtype=torch.bfloat16)}))
    return src, added, {}, "(2 tensors mtp.*) are left out", "2 multi-token-prediction tensor(s)", None


@pytest.mark.parametrize("kind", ["rotary", "rotary-in-wrapper", "mtp-after-layers", "mtp-prefix"])
def test_each_ignored_kind_is_left_out_both_ways_and_reported(tmp_path, capfd, kind):
    """Converted, the kind is left out with a line and the metadata counts it; exported (into the wrapper
    where there is one), every other tensor comes back bit for bit, none of the kind, with a line naming
    them. Before: the export wrote them or not without a word (no `not written` line)."""
    src, added, convert, converted_line, exported_line, wrapper = _case(kind, tmp_path / "hf")
    original = load_all(src)
    out = hf_to_megatron(src, tmp_path / "m", progress=False, **convert)
    assert converted_line in capfd.readouterr().err
    back = load_all(megatron_to_hf(out, tmp_path / "back", progress=False, wrapper=wrapper))
    err = capfd.readouterr().err
    assert f"note: not written, as HF's model ignores them on load: {exported_line} of the HF checkpoint" in err, err
    kept = {k: v for k, v in original.items() if k not in added}
    assert back.keys() == kept.keys() and all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in kept.items())
