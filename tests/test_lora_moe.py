"""LoRA on a Mixture-of-Experts model at expert parallelism matches HF PEFT itself, step for step,
and exports as an HF PEFT adapter that PeftModel.from_pretrained loads.

Mixtral (6 experts, top-2) at DP2 x EP2, the adapter on the attention (target_modules) and on
every routed expert (target_parameters gate_up_proj and down_proj: one rank-r LoRA per expert, PEFT's
ParamWrapper on transformers 5's fused expert weights; toolkit/lora/experts.py), the router and
the base experts frozen. The reference is peft.get_peft_model with the same LoraConfig and initial
weights (an adapter PEFT saved, B non-zero) on the HF model, trained single-process with AdamW
(tests/finetune_harness.py), with megatron-core's aux loss and the routers in fp64 on both sides
(tests/moe_reference.py), so every token is routed as the reference routes it. One launch; the
rest (export, PeftModel logits, --merge, guards) runs in this process. A second launch trains
Qwen2-MoE's attention, shared expert and dense layers with the experts frozen; one launch each
trains GLM-4.5's and DeepSeek-V3's (multi-latent attention) attention, dense layer, shared and routed
experts (the sigmoid router with its expert bias, which stays the base model's on both sides), and
gpt-oss's attention and routed experts (stored transposed, gate and up interleaved), and Qwen3-Next's
and Qwen3.5-MoE's attention and gated delta net (Qwen3.5's four in_proj_* Linears), dense MLP, shared and
routed experts, MiniMax-M2's and Mistral 4's, and Llama 4's (experts x @ W under feed_forward.experts, which
PEFT reads as [experts, out, in]) and Gemma 4's MoE block (experts beside the dense mlp) attention, dense MLPs
and routed experts with fp64 routers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
from transformers import AutoTokenizer

from tests.finetune_harness import (GRAD_NORM_TOLERANCE, LOSS_TOLERANCE_FP32, STEPS, differences, hf_reference, launch,
                                    read_metrics, recipe, write_peft_adapter, write_uneven_data)
from tests.moe_reference import (gemma4_routers_in_fp64, llama4_routers_in_fp64, moe_step_loss, route_in_fp64,
                                 routed_per_document)
from toolkit.convert import hf_to_megatron

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
AUX_LOSS_COEF = 0.1  # raised, so that a wrong aux gradient shows (as tests/test_moe_finetune.py)
# The trained adapter against the PEFT reference's after 10 steps, per tensor: |ours - theirs| / |theirs's change|.
ADAPTER_TOLERANCE = 1e-3
LOGIT_TOLERANCE = 1e-4
# The frontier families' runs: one micro-batch of 2 per DP rank a step (gradient accumulation is
# Mixtral's and Qwen2-MoE's to prove), a quarter of the CI time; every expert still trains (the guards)
SMALL_BATCH = 4


@dataclass(frozen=True)
class Routing:
    """How the reference routes as the run does: the tiny model's extra config, the recipe's `moe`
    keys, the reference's step loss (with `.routing`, per step the tokens per expert) and `prepare`."""

    model: dict = field(default_factory=dict)
    moe: dict = field(default_factory=dict)
    step_loss: Callable = None
    prepare: Callable | None = None


# Softmax routers: the aux loss raised and both sides' routers in fp64 (tests/moe_reference.py)
SOFTMAX = Routing({"router_aux_loss_coef": AUX_LOSS_COEF}, {"router_dtype": "fp64"},
                  lambda hf: moe_step_loss(AutoTokenizer.from_pretrained(hf).pad_token_id, "megatron"), route_in_fp64)


# Routers trained without a load-balancing loss (GLM-4.5's sigmoid router with its expert bias,
# gpt-oss's with router_aux_loss_coef 0), in fp32 on both sides
UNBALANCED = Routing({"router_aux_loss_coef": 0.0}, step_loss=lambda hf: routed_per_document())
# Llama 4's top-1 sigmoid router (applied to the expert's input) and Gemma 4's scaled softmax router, trained without
# a load-balancing loss, in fp64 on both sides (tests/moe_reference.py)
LLAMA4_FP64 = Routing({"router_aux_loss_coef": 0.0}, {"router_dtype": "fp64"}, lambda hf: routed_per_document(),
                      llama4_routers_in_fp64)
GEMMA4_FP64 = Routing(moe={"router_dtype": "fp64"}, step_loss=lambda hf: routed_per_document(),
                      prepare=gemma4_routers_in_fp64)


def train_against_peft(root: Path, variant: str, modules: list[str], parameters: list[str] | None,
                       routing: Routing = SOFTMAX, layer_spec: str = "te", model: dict | None = None, **settings):
    """A DP2 x EP2 LoRA run of `variant` (`model`: its config changes) from an adapter PEFT saved (target_modules
    `modules`, target_parameters `parameters`), and the PEFT reference of the same recipe."""
    from toolkit.tinymodels import make_tiny_model

    hf = make_tiny_model(variant, root / "hf", dtype="float32", vocab_size=250, **routing.model, **(model or {}))
    mc = hf_to_megatron(hf, root / "mc", fmt="torch_dist", progress=False, layer_spec=layer_spec)
    source = write_peft_adapter(hf, root / "adapter", modules, r=2, alpha=4.0, target_parameters=parameters)
    data = write_uneven_data(root / "data.jsonl", 300)
    cfg = recipe(root, mc, data, parallel={"tp": 1, "pp": 1, "ep": 2, "zero_stage": 1}, moe=routing.moe,
                 peft={"enabled": True, "init_from": str(source)}, **settings)
    launch(2, cfg)

    step_loss = routing.step_loss(hf)

    def keep(step, model):
        if step == STEPS:
            model.save_pretrained(root / "reference-adapter")

    losses, norms = hf_reference(hf, data, cfg, STEPS, adapter=source, step_loss=step_loss, on_step=keep,
                                 prepare=routing.prepare)
    return dict(root=root, hf=hf, source=source, cfg=cfg, run=root / "run", losses=losses, norms=norms,
                routing=step_loss.routing, reference_adapter=root / "reference-adapter")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Mixtral: LoRA on attention and every routed expert."""
    return train_against_peft(tmp_path_factory.mktemp("lora-moe"), "mixtral", ATTENTION, EXPERTS, save_every=STEPS)


def assert_matches_peft_training(trained) -> None:
    """Routing, losses and gradient norms as PEFT's training; the export holds PEFT's keys, trained
    as PEFT trained them, and PeftModel.from_pretrained on it gives the reference's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    metrics = read_metrics(trained["run"])
    for m, routing in zip(metrics, trained["routing"], strict=True):
        moe_layers = [layer for layer in m["tokens_per_expert"] if any(layer)]  # a dense layer logs zeros
        assert moe_layers == routing, f"step {m['step']} routed otherwise than the reference"
    loss, norm = differences(metrics, trained["losses"], trained["norms"])
    print(f"max |loss - PEFT reference| {loss:.1e}, grad norm relative {norm:.1e}")
    assert loss < LOSS_TOLERANCE_FP32 and norm < GRAD_NORM_TOLERANCE, (loss, norm)
    exported = trained["run"] / "adapter"
    assert_adapter_trained_as_reference(tensors(exported), tensors(trained["reference_adapter"]),
                                        tensors(trained["source"]))
    tokens = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(7)).tolist()
    logits = [hf_logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trained["hf"], dtype=torch.float32),
                                                  adapter).eval(), tokens)
              for adapter in (exported, trained["reference_adapter"])]
    worst = float((logits[0] - logits[1]).abs().max())
    print(f"PeftModel.from_pretrained(our adapter) vs the PEFT reference's trained model: max |logit diff| {worst:.1e}")
    assert worst < LOGIT_TOLERANCE, worst


def tensors(adapter_dir):
    from safetensors.torch import load_file

    return load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))


def adapter_difference(ours: dict, theirs: dict, start: dict) -> dict[str, float]:
    """Per tensor: |ours - theirs| / |theirs - start| (L2): how far from the reference's training."""
    assert sorted(ours) == sorted(theirs), (sorted(set(ours) ^ set(theirs)))[:4]
    return {k: float((ours[k] - theirs[k]).norm() / (theirs[k] - start[k]).norm()) for k in ours}


def assert_adapter_trained_as_reference(ours: dict, theirs: dict, start: dict) -> None:
    worst = adapter_difference(ours, theirs, start)
    name = max(worst, key=worst.get)
    print(f"adapter vs PEFT reference's after {STEPS} steps: worst relative {worst[name]:.1e} ({name})")
    assert worst[name] < ADAPTER_TOLERANCE, (name, worst[name])


def with_expert_untrained(adapter: dict, start: dict, expert: int, experts: int = 6, r: int = 2) -> dict:
    """`adapter` with one expert's A and B (toolkit.lora.experts.expert_rows) back at `start`."""
    from toolkit.lora.experts import expert_rows

    rows, cols = expert_rows(expert, experts, r)
    out = {}
    for key, tensor in adapter.items():
        out[key] = tensor.clone()
        if ".experts." in key and ".lora_A." in key:  # the routed experts' (not shared_expert(s).*)
            out[key][rows] = start[key][rows]
        elif ".experts." in key:
            out[key][:, cols] = start[key][:, cols]
    return out


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.tensor(tokens)).logits


@pytest.mark.multiprocess
def test_lora_on_attention_and_experts_at_ep2_matches_peft_and_exports_its_adapter(trained):
    """Mixtral: every expert of both EP ranks trained as PEFT's; the router and base experts frozen."""
    assert_matches_peft_training(trained)
    exported = trained["run"] / "adapter"
    config = json.loads((exported / "adapter_config.json").read_text())
    assert config["target_parameters"] == EXPERTS and sorted(config["target_modules"]) == sorted(ATTENTION)

    assert_guards_fail(trained, experts=6)

    # Only LoRA tensors trained: the router and the experts' base weights are not in the checkpoint's module states.
    step = trained["run"] / "checkpoints" / f"step_{STEPS:07d}"
    for states in (step / "ds").glob("*model_states.pt"):
        module = torch.load(states, map_location="cpu", weights_only=False)["module"]
        names = [k for k, v in module.items() if isinstance(v, torch.Tensor)]
        assert names and all(".lora_" in k for k in names), sorted(k for k in names if ".lora_" not in k)[:3]


@pytest.mark.multiprocess
def test_lora_on_attention_shared_expert_and_dense_layers_with_experts_frozen_at_ep2(tmp_path):
    """Qwen2-MoE with a shared expert and a dense MLP every other layer, the experts frozen (no
    expert parameter trains: DeepSpeed gets no expert group): attention, shared experts and dense
    MLPs train as PEFT's."""
    modules = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
    trained = train_against_peft(tmp_path, "qwen2-moe-sparse-step", modules, None)
    assert_matches_peft_training(trained)
    keys = tensors(trained["run"] / "adapter")
    assert any("shared_expert.gate_proj" in k for k in keys) and any("layers.0.mlp.gate_proj" in k for k in keys)
    assert not any(".mlp.experts." in k for k in keys)


def assert_merge_equals_merge_and_unload(trained, out: Path, changed: tuple[str, ...]) -> dict:
    """`convert megatron-to-hf --adapter --merge` of the last step gives PEFT's merge_and_unload() of
    the exported adapter, and changes the `changed` weights; returns the merged and base state dicts."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from toolkit.cli import main as cli

    step = trained["run"] / "checkpoints" / f"step_{STEPS:07d}"
    assert cli(["convert", "megatron-to-hf", "--adapter", "--merge", str(step), str(out)]) == 0
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trained["hf"], dtype=torch.float32),
                                     trained["run"] / "adapter")
    expected = peft.merge_and_unload().state_dict()  # with the persistent buffers (GLM-4.5's expert bias)
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    base = AutoModelForCausalLM.from_pretrained(trained["hf"], dtype=torch.float32).state_dict()
    assert sorted(ours) == sorted(expected)
    worst = max(float((ours[k] - expected[k]).abs().max()) for k in ours)
    print(f"max |merged - merge_and_unload()|: {worst:.1e}")
    assert worst < 1e-6, worst
    for name in changed:
        assert not torch.equal(ours[name], base[name]), f"the merge left {name} unchanged"
    return ours, base


@pytest.mark.multiprocess
def test_merged_export_equals_peft_merge_and_unload_on_experts(trained, tmp_path):
    assert_merge_equals_merge_and_unload(trained, tmp_path / "merged", (
        "model.layers.0.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.down_proj",
        "model.layers.1.self_attn.q_proj.weight"))


# DeepSeek-V3's multi-latent attention, megatron-core's linear_q_down_proj, linear_q_up_proj, linear_kv_down_proj
# (kv_a_proj_with_mqa: the latent and the shared rotary key in one weight), linear_kv_up_proj, linear_proj
MLA = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant, attention, layer_spec", [("glm4-moe", ATTENTION, "te"),
                                                           ("deepseek-v3", MLA, "local")])  # MLA converts for it only
def test_lora_on_sigmoid_routed_attention_routed_and_shared_experts_at_ep2_keeps_the_expert_bias(
        tmp_path, variant, attention, layer_spec):
    """GLM-4.5 and DeepSeek-V3 (sigmoid router with a random expert bias, 12 experts in 4 groups, a dense
    first layer, shared experts; GLM's q/k/v biases and q/k norms, DeepSeek's multi-latent attention):
    LoRA on attention, the dense MLP, the shared experts and every routed expert trains as PEFT's, every
    step routed as HF routes it (the bias selects experts: a bias that moved would route otherwise); the
    adapter loads in PeftModel and --merge is merge_and_unload(), the expert bias the base model's."""
    mlp = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]  # as PEFT keeps them (toolkit.lora.peft_rewrites)
    trained = train_against_peft(tmp_path, variant, attention, EXPERTS + mlp, routing=UNBALANCED, layer_spec=layer_spec,
                                 save_every=STEPS, global_batch=SMALL_BATCH)
    assert_matches_peft_training(trained)
    config = json.loads((trained["run"] / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(attention) and config["target_parameters"] == EXPERTS + mlp
    keys = tensors(trained["run"] / "adapter")
    assert any("shared_experts.gate_proj" in k for k in keys) and any("layers.0.mlp.gate_proj" in k for k in keys)
    ours, base = assert_merge_equals_merge_and_unload(trained, tmp_path / "merged", (
        "model.layers.1.mlp.experts.gate_up_proj", "model.layers.2.mlp.shared_experts.down_proj.weight",
        "model.layers.0.mlp.up_proj.weight", *(f"model.layers.3.self_attn.{name}.weight" for name in attention)))
    biases = [k for k in base if k.endswith("e_score_correction_bias")]
    assert biases and all(torch.equal(ours[k], base[k]) and base[k].any() for k in biases)
    assert_guards_fail(trained, experts=12, untrained=("shared_experts.up_proj", "layers.0.mlp.down_proj"))


def assert_guards_fail(trained, experts: int, untrained: tuple[str, ...] = ()) -> None:
    """The comparison with PEFT's trained adapter fails with the last expert (on EP rank 1) left at its
    initial values, and with each of the `untrained` linears' LoRA left so."""
    ours, start, theirs = (tensors(d) for d in (trained["run"] / "adapter", trained["source"],
                                                trained["reference_adapter"]))
    guards = [with_expert_untrained(ours, start, expert=experts - 1, experts=experts)]
    guards += [{k: start[k] if f".{name}.lora_" in k else v for k, v in ours.items()} for name in untrained]
    for guard in guards:
        with pytest.raises(AssertionError):
            assert_adapter_trained_as_reference(guard, theirs, start)


@pytest.mark.multiprocess
def test_lora_on_gpt_oss_attention_and_interleaved_experts_at_ep2_matches_peft(tmp_path):
    """gpt-oss (sinks, alternating windows, biases, the clamped SwiGLU; experts stored transposed
    with gate and up interleaved, which PEFT's ParamWrapper adapts as is_transposed): LoRA on the
    attention and every routed expert trains as PEFT's, every step routed as HF routes it; the adapter
    loads in PeftModel and --merge is merge_and_unload(). With B's rows added to megatron-core's [gate; up]
    rows as if not interleaved (the code before), the first step already routed otherwise than PEFT's."""
    trained = train_against_peft(tmp_path, "gpt-oss", ATTENTION, EXPERTS, routing=UNBALANCED, save_every=STEPS,
                                 global_batch=SMALL_BATCH)
    assert_matches_peft_training(trained)
    assert_merge_equals_merge_and_unload(trained, tmp_path / "merged", (
        "model.layers.1.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
        "model.layers.2.self_attn.o_proj.weight"))
    assert_guards_fail(trained, experts=8, untrained=("self_attn.v_proj",))


# The gated-delta-net families: (target_modules, target_parameters, modules the saved adapter must hold, merged
# tensors that must change, linears whose LoRA left untrained must fail the comparison)
_QWEN35_IN_PROJ = [f"in_proj_{p}" for p in ("qkv", "z", "b", "a")]
GATED_DELTA_LORA = {
    # a dense first layer; PEFT rewrites gate/up/down_proj onto the experts here, so they are `.weight` parameters
    "qwen3-next": (
        ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"],
        EXPERTS + ["gate_proj.weight", "up_proj.weight", "down_proj.weight"],
        ("layers.1.self_attn.o_proj", "layers.0.linear_attn.out_proj", "layers.2.mlp.shared_expert.gate_proj",
         "layers.0.mlp.down_proj", "layers.3.mlp.experts", "layers.1.self_attn.q_proj",
         "layers.0.linear_attn.in_proj_qkvz", "layers.2.linear_attn.in_proj_ba"),
        ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.2.linear_attn.out_proj.weight",
         "model.layers.3.self_attn.o_proj.weight", "model.layers.1.mlp.shared_expert.up_proj.weight",
         "model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight",
         "model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.2.linear_attn.in_proj_ba.weight"),
        ("linear_attn.out_proj", "shared_expert.down_proj", "self_attn.q_proj", "linear_attn.in_proj_qkvz")),
    # every layer MoE; PEFT rewrites nothing for qwen3_5_moe_text, so the shared expert's linears are target_modules
    "qwen3.5-moe": (
        ["q_proj", "k_proj", "v_proj", "o_proj", *_QWEN35_IN_PROJ, "out_proj", "gate_proj", "up_proj", "down_proj"],
        EXPERTS,
        ("layers.1.self_attn.o_proj", "layers.0.linear_attn.out_proj", "layers.2.mlp.shared_expert.gate_proj",
         "layers.0.mlp.experts", "layers.3.mlp.experts", "layers.1.self_attn.q_proj",
         *(f"layers.{layer}.linear_attn.{p}" for layer in (0, 2) for p in _QWEN35_IN_PROJ)),
        ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.down_proj",
         "model.layers.2.linear_attn.out_proj.weight", "model.layers.3.self_attn.o_proj.weight",
         "model.layers.1.mlp.shared_expert.up_proj.weight", "model.layers.1.self_attn.q_proj.weight",
         *(f"model.layers.0.linear_attn.{p}.weight" for p in _QWEN35_IN_PROJ)),
        ("linear_attn.out_proj", "shared_expert.down_proj", "self_attn.q_proj",
         *(f"linear_attn.{p}" for p in _QWEN35_IN_PROJ))),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", GATED_DELTA_LORA)
def test_lora_on_qwen3_next_attention_gated_delta_net_and_experts_at_ep2_matches_peft(tmp_path, variant):
    """Qwen3-Next (gated delta net layers alternating with output-gated attention, a dense first layer,
    a gated shared expert) and Qwen3.5-MoE (the same layers with the gated delta net's four in_proj_* Linears,
    every layer MoE): LoRA on every linear — the attention's q/k/v_proj (megatron-core holds q_proj's
    query and output gate re-laid, Split.GATED_QKV) and o_proj, the gated delta net's in_proj_qkvz /
    in_proj_ba (re-laid per key head, Split.GDN_IN_PROJ) or in_proj_qkv / _z / _b / _a (PEFT's four LoRAs as
    four (A, B) pairs inside megatron-core's one in_proj, B's rows on each tensor's rows, Split.GDN_IN_PROJ_CAT)
    and out_proj, the dense MLP, the shared expert and every routed expert — trains as PEFT's, every step routed
    as HF routes it; the adapter loads in PeftModel and --merge is merge_and_unload(). Guards: each in_proj_*,
    q_proj, out_proj or the shared expert's down_proj left untrained fails it."""
    modules, parameters, saved, changed, untrained = GATED_DELTA_LORA[variant]
    trained = train_against_peft(tmp_path, variant, modules, parameters, save_every=STEPS, global_batch=SMALL_BATCH)
    assert_matches_peft_training(trained)
    keys = tensors(trained["run"] / "adapter")
    for module in saved:
        assert any(f"{module}.lora_" in k for k in keys), module
    assert_merge_equals_merge_and_unload(trained, tmp_path / "merged", changed)
    assert_guards_fail(trained, experts=6, untrained=untrained)


# The 2026 families' MoE layers: (target_modules, target_parameters, layer spec, experts, merged tensors that must
# change, linears whose LoRA left untrained must fail the comparison)
FRONTIER_LORA = {
    # MiniMax-M2: the sigmoid router with a random expert bias, whole-projection q/k norms, partial RoPE; no shared
    # expert or dense layer
    "minimax-m2": (ATTENTION, EXPERTS, "te", 8,
                   ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.down_proj",
                    "model.layers.2.self_attn.q_proj.weight"), ("self_attn.v_proj",)),
    # Mistral 4: multi-latent attention (the local spec), a dense first layer, 2 shared experts, routed scaling;
    # PEFT rewrites nothing for mistral4, so the MLPs' linears are target_modules
    "mistral4": ([*MLA, "gate_proj", "up_proj", "down_proj"], EXPERTS, "local", 8,
                 ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.2.mlp.shared_experts.down_proj.weight",
                  "model.layers.0.mlp.up_proj.weight", "model.layers.3.self_attn.kv_b_proj.weight"),
                 ("shared_experts.up_proj", "layers.0.mlp.down_proj", "self_attn.kv_a_proj_with_mqa")),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", FRONTIER_LORA)
def test_lora_on_minimax_m2_and_mistral4_attention_and_experts_at_ep2_matches_peft(tmp_path, variant):
    """MiniMax-M2 and Mistral 4 at DP2 x EP2: LoRA on the attention (Mistral 4's multi-latent projections),
    Mistral 4's dense and shared MLPs and every routed expert trains as PEFT's, every step routed as HF
    routes it; the adapter loads in PeftModel and --merge is merge_and_unload(). Guards: the last expert
    (on EP rank 1) or one adapted linear left untrained fails the comparison."""
    modules, parameters, layer_spec, experts, changed, untrained = FRONTIER_LORA[variant]
    trained = train_against_peft(tmp_path, variant, modules, parameters, routing=UNBALANCED, layer_spec=layer_spec,
                                 save_every=STEPS, global_batch=SMALL_BATCH)
    assert_matches_peft_training(trained)
    assert_merge_equals_merge_and_unload(trained, tmp_path / "merged", changed)
    assert_guards_fail(trained, experts=experts, untrained=untrained)


# PEFT's target_parameters on each family's experts module, as adapter_config.json names them
LLAMA4_EXPERTS = ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"]
GEMMA4_EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("variant, parameters", [("llama4", LLAMA4_EXPERTS), ("gemma4-moe", GEMMA4_EXPERTS),
                                                 ("mixtral", EXPERTS), ("gpt-oss", EXPERTS)])
def test_adapter_config_target_parameters_are_what_peft_wraps_on_the_hf_model(tmp_path, variant, parameters):
    """The target_parameters an adapter lists for each family (from `gate_up_proj,down_proj`) are the module path
    PEFT's get_peft_model matches on the HF model: it wraps both fused weights of every MoE layer and nothing else,
    and its LoRA tensors have the keys and shapes the toolkit expects (Llama 4's x @ W experts with lora_A facing
    the output, toolkit/lora/experts.py)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from toolkit.families import family_named, spec_from_config
    from toolkit.lora import adapter, experts
    from toolkit.lora.peft_dir import LoraSettings
    from toolkit.tinymodels import make_tiny_model

    hf = make_tiny_model(variant, tmp_path / "hf", dtype="float32", vocab_size=250)
    spec = spec_from_config(json.loads((hf / "config.json").read_text()))[1]
    family = family_named(spec.family)
    settings = adapter.resolve_settings(family, spec, LoraSettings(2, 4.0, 0.0, ("q_proj",),
                                                                   target_parameters=("gate_up_proj", "down_proj")))
    assert list(settings.target_parameters) == parameters
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32),
                          LoraConfig(r=2, lora_alpha=4.0, target_modules=["q_proj"],
                                     target_parameters=list(settings.target_parameters)))
    module = experts.experts_module(family)
    wrapped = {f"{n.replace('.base_layer', '')}.{m.parameter_name}" for n, m in peft.base_model.model.named_modules()
               if type(m).__name__ == "ParamWrapper"}
    assert wrapped == {f"{module.replace('*', str(layer))}.{name}" for layer in experts.moe_layers(spec)
                       for name in ("gate_up_proj", "down_proj")}
    linears, targets = adapter.resolve_targets(family, spec, settings)
    saved = {k.replace(".default", ""): tuple(v.shape) for k, v in peft.state_dict().items() if ".lora_" in k}
    assert saved == adapter.expected_shapes(linears, spec, 2, targets)


# Llama 4 and Gemma 4, their experts in modules of their own (toolkit.lora.experts.experts_module), LoRA on the attention,
# the dense MLPs and every routed expert: (target_parameters, routing, the tiny model's config changes, experts, merged
# tensors that must change, linears whose LoRA left untrained must fail the comparison)
OWN_EXPERTS_MODULE_LORA = {
    # a dense MLP and a MoE layer (top-1 sigmoid routing on the expert's input, a shared expert) on each side of the
    # NoPE layer; experts stored x @ W, which PEFT's ParamWrapper reads as [experts, out, in]: lora_A faces the output
    "llama4": (LLAMA4_EXPERTS, LLAMA4_FP64, {}, 4,
               ("model.layers.1.feed_forward.experts.gate_up_proj", "model.layers.3.feed_forward.experts.down_proj",
                "model.layers.1.feed_forward.shared_expert.up_proj.weight", "model.layers.2.feed_forward.down_proj.weight",
                "model.layers.0.self_attn.k_proj.weight"), ("shared_expert.down_proj",)),
    # the MoE block: a dense MLP (megatron-core's mlp.dense) and 8 experts top-2 side by side, each with its norms, the
    # router's scale and per-expert scale; sliding and global layers (keys as values), 4 layers
    "gemma4-moe": (GEMMA4_EXPERTS, GEMMA4_FP64,
                   {"num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2}, 8,
                   ("model.layers.0.experts.gate_up_proj", "model.layers.3.experts.down_proj",
                    "model.layers.2.mlp.up_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                    "model.layers.0.self_attn.v_proj.weight"), ("mlp.down_proj",)),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", OWN_EXPERTS_MODULE_LORA)
def test_lora_on_llama4_and_gemma4_moe_attention_dense_mlps_and_experts_at_ep2_matches_peft(tmp_path, variant):
    """Llama 4 and Gemma 4's MoE block at DP2 x EP2: LoRA on the attention, the dense MLPs (Llama 4's shared expert
    too) and every routed expert trains as PEFT's, every step routed as HF routes it (fp64 routers on both sides);
    the adapter names the family's experts module (`feed_forward.experts.*`, `experts.*`), loads in PeftModel, and
    --merge is merge_and_unload(). Guards: the last expert (on EP rank 1) or one adapted linear left untrained fails
    the comparison."""
    parameters, routing, model, experts, changed, untrained = OWN_EXPERTS_MODULE_LORA[variant]
    trained = train_against_peft(tmp_path, variant, ATTENTION + MLP, parameters, routing=routing, layer_spec="local",
                                 model=model, save_every=STEPS, global_batch=SMALL_BATCH)
    assert_matches_peft_training(trained)
    config = json.loads((trained["run"] / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == parameters and sorted(config["target_modules"]) == sorted(ATTENTION + MLP)
    assert_merge_equals_merge_and_unload(trained, tmp_path / "merged", changed)
    assert_guards_fail(trained, experts=experts, untrained=untrained)
