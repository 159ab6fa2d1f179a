"""Nemotron-H (NemotronHForCausalLM: Nemotron-H-8B / 47B / 56B, NVIDIA-Nemotron-Nano-9B-v2 / 12B-v2) and Nemotron 3
(NVIDIA-Nemotron-3-Nano-30B-A3B): Mamba-2, attention-only, MLP-only and Mixture-of-Experts layers in the order of a
layer pattern, built as megatron-core's HybridModel (MambaModel
before 0.18: toolkit/runtime/megatron_versions.py hybrid_model_class) of the toolkit's local stack spec
(toolkit/blocks/hybrid_spec.py), read through transformers 5.24's NemotronHConfig. Each piece of HF's
models/nemotron_h/modeling_nemotron_h.py against megatron-core 0.19.2 (0.16.1 where it differs):

  HF (modeling_nemotron_h.py)             megatron-core / the toolkit
  layers_block_type (the config class     the hybrid layer pattern, one symbol per layer as transformers'
  turns a file's hybrid_override_pattern  _list_to_pattern writes it (M linear_attention, * full_attention,
  into it): NemotronHBlock's mixer by     - mlp): HybridModel's hybrid_layer_pattern (0.16.1 MambaModel's
  type (MIXER_TYPES :926)                 hybrid_override_pattern), ModelSpec.linear_layers keying the rows
  NemotronHBlock (:934): x + mixer(       MambaLayer (ssm/mamba_layer.py:147-161) / TransformerLayer / MLPLayer
  norm(x)), one RMSNorm per layer (:954)  (ssm/mlp_layer.py:13): each a pre-norm and a residual add. The norm
                                          is stored by the TE names: mixer.in_proj.layer_norm_weight,
                                          self_attention.linear_qkv.layer_norm_weight, mlp.linear_fc1.layer_norm_
                                          weight (the local spec's sharded_state_dict_keys_map), locally norm,
                                          input_layernorm, pre_mlp_layernorm (toolkit/convert/naming.py)
  NemotronHMamba2Mixer (:390)             MambaMixer (ssm/mamba_mixer.py): toolkit/blocks/mixer_mamba.py maps
                                          in_proj (Split.MAMBA_IN_PROJ), conv1d (Split.MAMBA_CONV; torch names
                                          conv1d_weight / conv1d_bias from 0.19, megatron_versions.mamba_conv_names),
                                          dt_bias, A_log, D, the gated norm, out_proj
  NemotronHAttention (:871): q/k/v/o      SelfAttention, linear_qkv per query group (Split.QKV), no RoPE: the
  without bias whatever attention_bias    model's position_embedding_type 'none' (hybrid_model.py:246-260);
  says (:883-886), no rotary embedding,   softmax scale 1/sqrt(kv_channels), causal
  scaling head_dim ** -0.5 (:880)
  NemotronHMLP (:639): down(relu2(up x))  MLP without a GLU, megatron-core's squared_relu (activations.py:9)
  NemotronHRMSNorm (:617), eps            RMSNorm (toolkit/blocks/norms.py), layernorm_epsilon; the final norm
  layer_norm_epsilon; norm_f (:1083)      decoder.final_norm (hybrid_block.py:215; 0.16.1 ssm/mamba_block.py:166)
  embeddings (:1080), lm_head (:1165),    embedding.word_embeddings, output_layer (VOCAB splits)
  never tied (_tied_weights_keys {} :1159)
  NemotronHMoE (:715), pattern symbol E: MoELayer (local spec: SequentialMLP, TopKRouter, SharedExpertMLP) in a
  experts(x) + shared_experts(x)          TransformerLayer of pre_mlp_layernorm and the MoE only (toolkit/blocks/
                                          hybrid_spec.py), its norm keyed as an MLP layer's
  NemotronHTopkRouter (:759): sigmoid     DeepSeek-V3's router (toolkit/families/sigmoid_router.py): sigmoid scores,
  of fp32 logits, e_score_correction_     the expert bias buffer (float32 as HF keeps it, _keep_in_fp32_modules_strict
  bias for the choice, group top-k,       :1012), group-limited top-k, renormalised where norm_topk_prob, times
  norm_topk_prob, routed_scaling_factor   routed_scaling_factor; the router in fp32 (moe_router_dtype)
  NemotronHExperts (:654): per expert     SequentialMLP's local_experts.#.linear_fc1 / linear_fc2 without a GLU
  down(relu2(up x)), stored per expert    (squared_relu, as the MLP layers), split over expert TP as column / row;
  (experts.#.up_proj / down_proj)         EP numbering local, the converter maps it to the global expert
  shared_experts: NemotronHMLP of width   SharedExpertMLP of moe_shared_expert_intermediate_size, ungated (HF reads
  moe_shared_expert_intermediate_size     no n_shared_experts: one shared MLP of that width)
  mtp.* ignored on load (:1013)           left out, and said (Family.mtp_prefix)

Pipeline stages: the pattern (without '|') split evenly, as Layout.stage_layers splits layers: 0.19.2
models/hybrid/hybrid_layer_allocation.py select_pipeline_segment (:435-443), 0.16.1 ssm/mamba_block.py
_select_layers_for_pipeline_parallel (:172); torch_dist keys every layer by its global number
(hybrid_block.py sharded_state_dict :429-443; 0.16.1 mamba_block.py :390-402), never stacked.

Refused in one line: moe_latent_size (the latent projections around the experts, fc1/fc2_latent_proj: not mapped),
what the sigmoid router cannot reproduce (toolkit/families/sigmoid_router.py), mlp_bias, use_bias
(MambaMixer asserts no bias), use_conv_bias false (it asserts a conv bias), mamba_hidden_act other than silu,
mlp_hidden_act other than relu2, tie_word_embeddings (HF never ties them: its export would not be the model),
layer_norm_epsilon other than 1e-5 (megatron-core's gated norm has eps 1e-5 whatever the config says,
mamba_mixer.py:417-419, while HF's takes layer_norm_epsilon, :442), Mamba heads not a multiple of n_groups.
Not refused: attention_bias, sliding_window, residual_in_fp32, which HF's modules read nowhere.

LoRA adapts what PEFT adapts on NemotronHForCausalLM: in_proj, q/k/v/o_proj, up_proj / down_proj (the MLP layers' and
the shared experts'); out_proj and conv1d are refused as PEFT refuses them on Mamba models, and so is all-linear,
which takes out_proj (PEFT_REFUSED, toolkit/lora/targets.py).

Exact only where HF's dt clamp at time_step_min does not bite and for unpadded or right-padded sequences
(toolkit/blocks/mixer_mamba.py)."""

from toolkit.errors import ConversionError
from toolkit.families.experts import LOCAL_EXPERT, SHARED_EXPERT
from toolkit.families.hf_values import positive_ints
from toolkit.families.router import Router, positive
from toolkit.families.sigmoid_router import read_sigmoid_routing
from toolkit.families.table import EXPERTS_LAYER, FULL_ATTENTION, MAMBA_LAYER, MLP_LAYER, MOE_LAYER, Family, row
from toolkit.splits import Split

L = "backbone.layers.*."  # as published and as transformers 5.24 saves it (its conversion mapping reads it as model.)
M = "decoder.layers.*."
X = L + "mixer."

# transformers' _pattern_to_list / _list_to_pattern (configuration_nemotron_h.py): each layer type's symbol, as
# megatron-core's hybrid pattern names them too (LayerSymbols)
SYMBOLS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
# NemotronHConfig's fields of the Mamba-2 mixer, as ModelSpec.mamba's keys
MAMBA_KEYS = {"heads": "mamba_num_heads", "head_dim": "mamba_head_dim", "groups": "n_groups", "state": "ssm_state_size",
              "conv_kernel": "conv_kernel", "chunk_size": "chunk_size"}
# PEFT 0.21's _check_lora_target_modules_mamba (tuners/tuners_utils.py:145-163) raises for these target names on
# model_type nemotron_h (its fused Mamba kernels read out_proj.weight and conv1d.weight themselves)
PEFT_MAMBA = "PEFT refuses LoRA on it for Mamba-based models ('incompatible with Mamba-based models')"
PEFT_REFUSED = {"out_proj": PEFT_MAMBA, "conv1d": PEFT_MAMBA}
# megatron-core's MambaMixer gated norm: ExtendedRMSNorm(eps=1e-5) (ssm/mamba_mixer.py:417-419)
MAMBA_GATED_NORM_EPS = 1e-5

NORM = L + "norm.weight"
MAMBA_ROWS = tuple(row(*r, attention=MAMBA_LAYER) for r in (
    (M + "mixer.in_proj.layer_norm_weight", NORM, Split.REPLICATED, ("hidden",)),
    (M + "mixer.in_proj.weight", X + "in_proj.weight", Split.MAMBA_IN_PROJ, ("mamba_in_proj", "hidden")),
    (M + "mixer.conv1d.weight", X + "conv1d.weight", Split.MAMBA_CONV, ("mamba_conv", "one", "mamba_kernel")),
    (M + "mixer.conv1d.bias", X + "conv1d.bias", Split.MAMBA_CONV, ("mamba_conv",)),
    (M + "mixer.dt_bias", X + "dt_bias", Split.COLUMN, ("mamba_heads",)),
    (M + "mixer.A_log", X + "A_log", Split.COLUMN, ("mamba_heads",)),
    (M + "mixer.D", X + "D", Split.COLUMN, ("mamba_heads",)),
    (M + "mixer.norm.weight", X + "norm.weight", Split.COLUMN, ("mamba_inner",)),
    (M + "mixer.out_proj.weight", X + "out_proj.weight", Split.ROW, ("hidden", "mamba_inner")),
))
ATTENTION_ROWS = tuple(row(*r, attention=FULL_ATTENTION) for r in (
    (M + "self_attention.linear_qkv.layer_norm_weight", NORM, Split.REPLICATED, ("hidden",)),
    (M + "self_attention.linear_qkv.weight", tuple(X + f"{p}_proj.weight" for p in "qkv"), Split.QKV,
     ("q_size", "hidden"), ("kv_size", "hidden"), ("kv_size", "hidden")),
    (M + "self_attention.linear_proj.weight", X + "o_proj.weight", Split.ROW, ("hidden", "q_size")),
))
MLP_ROWS = tuple(row(*r, attention=MLP_LAYER) for r in (
    (M + "mlp.linear_fc1.layer_norm_weight", NORM, Split.REPLICATED, ("hidden",)),
    (M + "mlp.linear_fc1.weight", X + "up_proj.weight", Split.COLUMN, ("ffn", "hidden")),
    (M + "mlp.linear_fc2.weight", X + "down_proj.weight", Split.ROW, ("hidden", "ffn")),
))
EXPERTS_ROWS = tuple(row(*r, kind=MOE_LAYER, attention=EXPERTS_LAYER, **extra) for *r, extra in (
    (M + "mlp.linear_fc1.layer_norm_weight", NORM, Split.REPLICATED, ("hidden",), {}),
    # transformers >= 5.24 keeps the router weight in float32 too (_keep_in_fp32_modules_strict `gate.weight`)
    (M + "mlp.router.weight", X + "gate.weight", Split.REPLICATED, ("experts", "hidden"), {"float32_parameter": True}),
    (M + "mlp.router.expert_bias", X + "gate.e_score_correction_bias", Split.REPLICATED, ("experts",),
     {"float32_buffer": True}),
    (LOCAL_EXPERT + "linear_fc1.weight", X + "experts.#.up_proj.weight", Split.COLUMN, ("moe_ffn", "hidden"), {}),
    (LOCAL_EXPERT + "linear_fc2.weight", X + "experts.#.down_proj.weight", Split.ROW, ("hidden", "moe_ffn"), {}),
    (SHARED_EXPERT + "linear_fc1.weight", X + "shared_experts.up_proj.weight", Split.COLUMN, ("shared_ffn", "hidden"), {}),
    (SHARED_EXPERT + "linear_fc2.weight", X + "shared_experts.down_proj.weight", Split.ROW, ("hidden", "shared_ffn"), {}),
))
ROWS = (
    row("embedding.word_embeddings.weight", "backbone.embeddings.weight", Split.VOCAB, ("vocab", "hidden")),
    *MAMBA_ROWS, *ATTENTION_ROWS, *MLP_ROWS, *EXPERTS_ROWS,
    row("decoder.final_norm.weight", "backbone.norm_f.weight", Split.REPLICATED, ("hidden",)),
    row("output_layer.weight", "lm_head.weight", Split.VOCAB, ("vocab", "hidden")),
)


def read(cfg: dict) -> dict:
    """The layer pattern, Mamba-2's sizes, the norms' epsilon; no RoPE (NemotronHAttention applies none)."""
    types = cfg.get("layers_block_type") or []
    for i, t in enumerate(types):
        if t not in SYMBOLS:
            raise ConversionError(f"nemotron_h with layers_block_type[{i}]={t!r} cannot be mapped exactly to "
                                  f"megatron-core (accepted: {', '.join(map(repr, SYMBOLS))})")
    if not types:
        raise ConversionError("config.json has no layers_block_type (nor hybrid_override_pattern): Nemotron-H's "
                              "layer pattern is needed")
    mamba = positive_ints(cfg, MAMBA_KEYS)
    if mamba["heads"] % mamba["groups"]:
        raise ConversionError(f"config.json has mamba_num_heads={mamba['heads']} not a multiple of "
                              f"n_groups={mamba['groups']}: each B/C group serves whole heads")
    return {"num_layers": len(types), "linear_layers": "".join(SYMBOLS[t] for t in types), "mamba": mamba,
            "norm_eps": float(cfg.get("layer_norm_epsilon")), "rope_theta": None}


def has_experts(cfg: dict) -> bool:
    """Nemotron 3: a 'moe' layer (E) in the pattern; NemotronHConfig's expert fields size nothing otherwise."""
    return "moe" in (cfg.get("layers_block_type") or [])


def read_routing(cfg: dict) -> dict:
    """DeepSeek-V3's sigmoid routing, with NemotronHMoE's one shared expert of moe_shared_expert_intermediate_size
    (:733; DeepSeek's is n_shared_experts x moe_intermediate_size, which HF's NemotronHMoE never reads)."""
    return {**read_sigmoid_routing(cfg), "shared_ffn_hidden_size": positive(cfg, "moe_shared_expert_intermediate_size")}


ROUTER = Router(experts_keys=("n_routed_experts",), ffn_key="moe_intermediate_size", renormalise_key="norm_topk_prob",
                read=read_routing, when=has_experts)

NEMOTRON_H = Family(
    name="nemotron_h", model_types=("nemotron_h",), architecture="NemotronHForCausalLM", rows=ROWS, read=read,
    refuse_flags=("mlp_bias", "use_bias", "tie_word_embeddings", "moe_latent_size"),
    accepted={"use_conv_bias": (True,), "mamba_hidden_act": ("silu",), "layer_norm_epsilon": (MAMBA_GATED_NORM_EPS,)},
    activation=("mlp_hidden_act", "relu2"),
    megatron={"is_hybrid_model": True},
    router=ROUTER,
    peft_refused=PEFT_REFUSED,
    mtp_prefix="mtp.",  # NemotronHPreTrainedModel._keys_to_ignore_on_load_unexpected = [r"mtp.*"]
    module_prefix=("backbone.", "model."),  # transformers 5.24's conversion mapping reads backbone.* as model.*
)
