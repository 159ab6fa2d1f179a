"""LoRA on the families whose layers the toolkit builds itself (toolkit/blocks/): Gemma 3 and
OLMo 2 put a norm after o_proj and down_proj, and PEFT adds the adapter's delta to the linear's
output before that norm. Megatron-core with the imported adapter at TP2 must give PeftModel's
logits (tests/test_lora.py covers training; this covers where the delta enters)."""

from __future__ import annotations


import pytest
import torch

from tests.finetune_harness import write_peft_adapter
from tests.test_lora import held_out_tokens, peft_logits
from toolkit.convert import hf_to_megatron

LOGIT_TOLERANCE = 1e-4  # fp32


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["gemma3", "olmo2", "gemma4"])  # gemma4: its global layers' [q; k] too
def test_post_norm_families_with_an_adapter_give_peft_logits_at_tp2(tmp_path, variant):
    from toolkit.runtime.launch import run_on_processes
    from toolkit.tinymodels import make_tiny_model

    hf = make_tiny_model(variant, tmp_path / "hf", dtype="float32", vocab_size=250)
    megatron = hf_to_megatron(hf, tmp_path / "mc", fmt="torch_dist", progress=False)
    adapter = write_peft_adapter(hf, tmp_path / "adapter", "all-linear", r=4, alpha=8.0)
    tokens = held_out_tokens()
    [(ours, _)], _ = run_on_processes("tests.mp_workers:lora_logits", 2, str(megatron), tokens,
                                      [{"adapter": str(adapter), "tp": 2}])
    worst = float((torch.tensor(ours) - peft_logits(hf, adapter, tokens)).abs().max())
    print(f"{variant}: max |logit difference| vs PeftModel.from_pretrained: {worst:.2e}")
    assert worst < LOGIT_TOLERANCE, worst


REFUSED = {
    # (target_modules, target_parameters, dropout) -> the start of the one-line refusal
    (("gate",), (), 0.0): r"^LoRA on the Mixture-of-Experts router \(gate\) is not supported",
    (("q_proj",), ("mlp.gate.weight",), 0.0): r"^LoRA on the Mixture-of-Experts router \(gate\) is not supported",
    (("q_proj",), ("mlp.experts.w1",), 0.0): r"^target parameter\(s\) mlp.experts.w1 are not fused expert weights of mixtral.*router is not supported",
    (("q_proj",), ("mlp.experts.gate_up_proj",), 0.1): r"^LoRA on the experts \(peft.target_parameters\) needs peft.dropout=0",
}


def test_what_lora_on_a_mixture_of_experts_model_cannot_do_is_refused_in_one_line():
    """The router stays frozen; experts take no dropout (PEFT's ParamWrapper refuses it too); a dense
    family has no target_parameters; experts at TP > 1, and dropout on the MLPs whose names PEFT
    rewrites (GLM-4.5: toolkit.lora.peft_rewrites), are refused before any process starts."""
    from toolkit.errors import AdapterError
    from toolkit.families import family_named
    from toolkit.families.spec import read_spec
    from toolkit.lora import adapter, experts
    from toolkit.lora.peft_dir import LoraSettings
    from toolkit.tinymodels import make_config

    family = family_named("mixtral")
    spec = read_spec(make_config("mixtral").to_dict(), family)
    for (modules, parameters, dropout), message in REFUSED.items():
        with pytest.raises(AdapterError, match=message) as refused:
            adapter.resolve_settings(family, spec, LoraSettings(2, 4.0, dropout, modules, False, parameters))
        assert "\n" not in str(refused.value)
    settings = adapter.resolve_settings(family, spec, LoraSettings(2, 4.0, 0.0, ("all-linear",), False,
                                                                   ("down_proj", "gate_up_proj")))
    assert settings.target_parameters == ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    assert settings.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    with pytest.raises(AdapterError, match=r"^LoRA on the experts \(peft.target_parameters\) at parallel.tp=2"):
        experts.check_layout(2, experts.resolve(family, spec, settings.target_parameters, 0.0))
    glm = read_spec(make_config("glm4-moe").to_dict(), family_named("glm4_moe"))
    with pytest.raises(AdapterError, match=r"^LoRA on gate_proj, up_proj of glm4_moe needs peft.dropout=0: PEFT "):
        adapter.resolve_settings(family_named("glm4_moe"), glm, LoraSettings(2, 4.0, 0.1, ("q_proj", "gate_proj", "up_proj")))
    dense = read_spec(make_config("llama").to_dict(), family_named("llama"))
    with pytest.raises(AdapterError, match=r"^peft.target_parameters \(gate_up_proj\) adapts routed experts"):
        adapter.resolve_settings(family_named("llama"), dense, LoraSettings(2, 4.0, 0.0, ("q_proj",), False,
                                                                            ("gate_up_proj",)))



def test_adapter_on_mlps_peft_would_rewrite_onto_the_experts_loads_as_trained(tmp_path):
    """PEFT with transformers 5 rewrites the target_modules gate_proj / up_proj / down_proj of Qwen3-MoE,
    GLM-4.5, DeepSeek-V3 and OLMoE onto the routed experts' fused weights, on PeftModel.from_pretrained
    too: an adapter on Qwen3-MoE's dense layers listing them so would load as another adapter. Ours lists
    them as `<name>.weight` target_parameters (the same LoRA and keys): PeftModel.from_pretrained on it
    gives the logits of the PEFT model its tensors come from, and read back they are target modules."""
    from toolkit.families import family_named
    from toolkit.families.spec import read_spec
    from toolkit.lora import adapter, peft_dir
    from toolkit.lora.peft_dir import LoraSettings
    from toolkit.tinymodels import make_config, make_tiny_model

    hf = make_tiny_model("qwen3-moe-dense-layers", tmp_path / "hf", dtype="float32", vocab_size=250)
    mlp = ("gate_proj", "up_proj", "down_proj")
    reference = write_peft_adapter(hf, tmp_path / "peft", ["q_proj"], r=2, alpha=4.0,
                                   target_parameters=[f"{n}.weight" for n in mlp])
    family = family_named("qwen3_moe")
    spec = read_spec(make_config("qwen3-moe-dense-layers").to_dict(), family)
    settings = adapter.resolve_settings(family, spec, LoraSettings(2, 4.0, 0.0, ("q_proj", *mlp)))
    ours = tmp_path / "ours"
    peft_dir.write(ours, peft_dir.read_tensors(reference), settings, {"checkpoint": str(hf)}, str(hf))
    assert peft_dir.read_settings(ours).target_modules == tuple(sorted(("q_proj", *mlp)))
    tokens = held_out_tokens()
    worst = float((peft_logits(hf, ours, tokens) - peft_logits(hf, reference, tokens)).abs().max())
    print(f"PeftModel.from_pretrained(ours) vs PEFT's own adapter: max |logit difference| {worst:.1e}")
    assert worst < 1e-6, worst
