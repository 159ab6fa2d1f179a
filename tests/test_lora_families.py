"""LoRA on each family against HF PEFT where the delta enters: megatron-core with an imported adapter
at TP2 must give PeftModel's logits, and export the adapter back as PEFT saved it. Gemma 3 and OLMo 2
put a norm after o_proj and down_proj, and PEFT adds the adapter's delta to the linear's output
before that norm; the 2026 families bring their own layers (Gemma 4's shared [q; k], Qwen3.5's gated
delta net in_proj, Mistral 4's multi-latent attention). tests/test_lora.py covers training;
tests/test_lora_moe.py the experts at EP."""

from __future__ import annotations


import pytest
import torch

from tests.finetune_harness import write_peft_adapter
from tests.test_lora import adapter_tensors, held_out_tokens, peft_logits
from toolkit.convert import hf_to_megatron

LOGIT_TOLERANCE = 1e-4  # fp32


# variant -> the adapter's target_modules: every Linear of the dense families; the attention (and the gated
# delta net's in_proj) of the Mixture-of-Experts ones, whose experts take LoRA at EP only (tests/test_lora_moe.py)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLA = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
FAMILIES = {
    "gemma3": "all-linear", "olmo2": "all-linear",  # a norm after o_proj and down_proj: the delta enters before it
    "gemma4": "all-linear",  # and its global layers' [q; k]
    "olmo3": "all-linear", "smollm3": "all-linear", "ministral3": "all-linear",
    "qwen3.5": "all-linear",  # the four in_proj_* Linears onto megatron-core's one in_proj
    "olmo-hybrid": "all-linear",  # its gated delta net's six Linears (q_proj as its attention layers') likewise
    "mistral4": MLA, "minimax-m2": ATTENTION,
    "llama4": [*ATTENTION, "gate_proj", "up_proj", "down_proj"],  # its dense layers' MLPs and the shared experts
    # Nemotron-H: Mamba-2's in_proj (its z, x, B, C, dt rows each split over TP), the attention and relu^2 MLP layers;
    # PEFT refuses out_proj and conv1d on Mamba models (its fused kernel reads out_proj.weight itself)
    "nemotron-h": ["in_proj", *ATTENTION, "up_proj", "down_proj"],
    # and Nemotron 3's MoE layer: the shared expert's up_proj / down_proj (the routed experts take none: they have no gate)
    "nemotron-3": ["in_proj", *ATTENTION, "up_proj", "down_proj"],
}
# Nemotron-H as its tiny variant, and with a Nemotron 3 MoE layer (E: routed experts and the shared expert's up_proj,
# down_proj Linears)
NEMOTRON_PATTERNS = {"nemotron-h": {}, "nemotron-3": {"hybrid_override_pattern": "M-*E", "n_routed_experts": 4,
                                                      "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                                      "moe_shared_expert_intermediate_size": 48}}
# FAMILIES' names that are a tiny variant with other settings: (the variant, its overrides)
TINY_OF = {"nemotron-3": ("nemotron-h", NEMOTRON_PATTERNS["nemotron-3"])}


@pytest.mark.multiprocess
def test_families_with_an_adapter_give_peft_logits_at_tp2_and_export_it_back_as_peft_saved_it(tmp_path):
    """One launch for every family: its tiny model converted, an adapter PEFT saved (B non-zero) imported
    at TP2, the logits against PeftModel.from_pretrained's, and the adapter exported back untouched
    (import -> 0 steps -> export) with PEFT's tensors, loading in PeftModel.from_pretrained."""
    from toolkit.runtime.launch import run_on_processes
    from toolkit.tinymodels import make_tiny_model

    tokens, jobs, dirs = held_out_tokens(), [], {}
    for variant, targets in FAMILIES.items():
        tiny, overrides = TINY_OF.get(variant, (variant, {}))
        hf = make_tiny_model(tiny, tmp_path / variant / "hf", dtype="float32", vocab_size=250, **overrides)
        megatron = hf_to_megatron(hf, tmp_path / variant / "mc", fmt="torch_dist", progress=False)
        adapter = write_peft_adapter(hf, tmp_path / variant / "adapter", targets, r=4, alpha=8.0)
        exported = tmp_path / variant / "exported"
        jobs.append((str(megatron), tokens, [{"adapter": str(adapter), "tp": 2, "export": str(exported)}]))
        dirs[variant] = hf, adapter, exported
    results, _ = run_on_processes("tests.mp_workers:lora_logits_of_each", 2, jobs)
    worst, moved = {}, {}
    for (variant, (hf, adapter, exported)), [(ours, _)] in zip(dirs.items(), results):
        theirs = peft_logits(hf, adapter, tokens)
        worst[variant] = float((torch.tensor(ours) - theirs).abs().max())
        moved[variant] = float((base_logits(hf, tokens) - theirs).abs().max())  # the guard: what a dropped adapter misses
        theirs, back = adapter_tensors(adapter), adapter_tensors(exported)
        assert back.keys() == theirs.keys() and all(torch.equal(back[k], theirs[k]) for k in theirs), variant
        assert torch.equal(peft_logits(hf, exported, tokens), peft_logits(hf, adapter, tokens)), variant
    print("max |logit difference| vs PeftModel.from_pretrained at TP2 (the adapter's own effect): "
          + ", ".join(f"{v} {w:.1e} ({moved[v]:.1e})" for v, w in worst.items()))
    assert max(worst.values()) < LOGIT_TOLERANCE, worst
    assert min(moved.values()) > 100 * LOGIT_TOLERANCE, moved


def base_logits(hf_dir, tokens):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(input_ids=torch.tensor(tokens)).logits


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


MAMBA_TARGETS = ("all-linear", ("out_proj",), ("conv1d",), ("in_proj", *ATTENTION, "up_proj", "down_proj"))


def _peft_targets(config, target_modules, target_parameters=()):
    """The modules (and parameters) real PEFT (get_peft_model on HF's model) adapts, or its refusal."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    try:
        peft = get_peft_model(model, LoraConfig(r=2, target_modules=target_modules,
                                                target_parameters=list(target_parameters) or None))
    except ValueError as refused:
        return refused
    return set(peft.base_model.targeted_module_names) | set(getattr(peft.base_model, "targeted_parameter_names", []))


def test_lora_on_nemotron_h_trains_what_peft_trains_and_refuses_in_one_line_what_peft_refuses():
    """PEFT refuses out_proj and conv1d on Mamba-based models (nemotron_h), and so all-linear, our default, which takes
    every Linear and out_proj among them: each refused in one line naming the module and the fix (the old code trained
    all-linear and out_proj). What PEFT accepts adapts the very modules PEFT adapts, layer by layer, the MoE layer's
    shared expert included. LoRA on Nemotron 3's routed experts (PEFT's target_parameters on their fused up_proj) is
    refused: they have no gate, which this adapter's experts need."""
    from toolkit.errors import AdapterError
    from toolkit.families import family_named
    from toolkit.families.spec import read_spec
    from toolkit.lora import adapter, targets
    from toolkit.lora.peft_dir import LoraSettings
    from toolkit.tinymodels import make_config

    family = family_named("nemotron_h")
    for variant, overrides in NEMOTRON_PATTERNS.items():
        config = make_config("nemotron-h", **overrides)
        spec = read_spec(config.to_dict(), family)
        for modules in MAMBA_TARGETS:
            theirs = _peft_targets(config, modules)
            wanted = [modules] if isinstance(modules, str) else list(modules)
            if isinstance(theirs, ValueError):
                assert "incompatible with Mamba-based models" in str(theirs), theirs
                with pytest.raises(AdapterError, match=r"^(LoRA on (out_proj|conv1d) of nemotron_h is not supported: "
                                   r"PEFT refuses .*leave it out of peft.target_modules|peft.target_modules=all-linear on "
                                   r"nemotron_h takes out_proj: .*name the others instead: peft.target_modules=in_proj,q_proj,)") as refused:
                    targets.resolve(family, spec, wanted)
                assert "\n" not in str(refused.value), (variant, modules)
                continue
            ours = {part.module_at(layer) for linear in targets.resolve(family, spec, wanted)
                    for layer in linear.layers(spec) for part in linear.parts if part.name in linear.chosen}
            assert ours == theirs, (variant, modules, sorted(ours ^ theirs))
            assert any(".shared_experts." in m for m in ours) == (variant == "nemotron-3"), variant
    config = make_config("nemotron-h", **NEMOTRON_PATTERNS["nemotron-3"])
    assert any(m.endswith("mixer.experts.up_proj") for m in _peft_targets(config, ["q_proj"], ["mixer.experts.up_proj"]))
    spec = read_spec(config.to_dict(), family)
    with pytest.raises(AdapterError, match=r"^peft.target_parameters \(mixer.experts.up_proj\) on nemotron_h's routed "
                       r"experts is not supported: they have no gate .*leave peft.target_parameters out") as refused:
        adapter.resolve_settings(family, spec, LoraSettings(2, 4.0, 0.0, ("q_proj",), False, ("mixer.experts.up_proj",)))
    assert "\n" not in str(refused.value)
