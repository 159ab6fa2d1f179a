"""The pieces recipes/finetune.py assembles: checks, model, DeepSpeed config, each DP rank's batches
(from the rows toolkit.train.recipe_data reads)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.convert.metadata import CheckpointMeta
from toolkit.layouts import RECIPE_NAMES, Layout
from toolkit import model as model_builder
from toolkit.blocks.context_parallel import TE_CP_COMM_TYPE, padded_length
from toolkit.runtime.distributed import ParallelInfo
from toolkit.errors import ConfigError, ConversionError
from toolkit.train import virtual
from toolkit.train.config import TrainConfig
from toolkit.train.data import BatchSource
from toolkit.train.recipe_data import DataRows

# precision=fp8 builds the model in bf16: FP8 is the decoder GEMMs' (toolkit.fp8), not the weights'.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.bfloat16}
# torch's AdamW (foreach kernels on a GPU) rather than DeepSpeed's FusedAdam, which deepspeed.initialize
# JIT-builds and which needs nvcc and CUDA_HOME on the node (MissingCUDAException otherwise).
# benchmarks/finetune_bench.py's HF + DeepSpeed baseline uses the same.
TORCH_ADAM = True


def read_checkpoint_meta(cfg: TrainConfig) -> CheckpointMeta:
    if not Path(cfg.model.checkpoint).exists():
        raise ConfigError(f"model.checkpoint {cfg.model.checkpoint} does not exist: give the directory `toolkit convert "
                          "hf-to-megatron HF_MODEL OUT` wrote (as model.checkpoint=OUT)")
    meta = CheckpointMeta.read(Path(cfg.model.checkpoint))
    spec = meta.model_spec
    expected = {"family": cfg.model.family, "num_layers": cfg.model.num_layers, "hidden_size": cfg.model.hidden_size}
    for key, value in expected.items():
        if value is not None and getattr(spec, key) != value:
            raise ConfigError(f"checkpoint {cfg.model.checkpoint} has {key}={getattr(spec, key)}, the recipe expects {value}")
    if cfg.data.seq_len > spec.max_position_embeddings:
        raise ConfigError(f"data.seq_len {cfg.data.seq_len} exceeds the model's max_position_embeddings {spec.max_position_embeddings}")
    if spec.exact_seq_len is not None and cfg.data.seq_len > spec.exact_seq_len:
        raise ConfigError(f"data.seq_len {cfg.data.seq_len} exceeds {spec.exact_seq_len}, the longest sequence {spec.family} "
                          "trains exactly as HF computes it (its Llama-4 query scale, 1 up to rope_parameters."
                          "original_max_position_embeddings, has no megatron-core counterpart)")
    if cfg.data.pack and spec.window_size:
        raise ConfigError("packing is not supported with a sliding window: megatron-core's windowed attention ignores the document mask")
    if cfg.data.pack and spec.hybrid_pattern and "M" in spec.hybrid_pattern:
        raise ConfigError(f"data.pack=true with {spec.family}'s Mamba-2 layers is not supported: megatron-core's MambaLayer "
                          "takes no document mask, so its scan would carry one document's state into the next; set "
                          "data.pack=false")
    if cfg.data.pack and model_builder.layer_spec_choice(cfg.peft.enabled, spec)[0] == "te":
        raise ConfigError("packing is not supported on the Transformer Engine path: it needs per-document cu_seqlens, "
                          "which this trainer does not build, and TE would silently ignore the document mask; set data.pack=false")
    check_fp8(cfg, spec)
    return meta


def fp8_line(cfg: TrainConfig, spec) -> str:
    """What precision=fp8 runs, in one line for the log."""
    layer_spec = model_builder.layer_spec_choice(cfg.peft.enabled, spec)[0]
    ends = ", the first and last decoder layers in bf16" if cfg.fp8.first_last_bf16 else ""
    if layer_spec == "te":
        return f"fp8: recipe {cfg.fp8.recipe}, Transformer Engine's (megatron-core's fp8_recipe){ends}"
    return (f"fp8: recipe {cfg.fp8.recipe}, torchao's FP8 GEMMs in the decoder layers' linears{ends}; the embedding, "
            "output layer, router and experts in bf16 (toolkit/fp8/local.py)")


def check_fp8(cfg: TrainConfig, spec) -> None:
    """precision=fp8's recipe against this machine and the layer spec it runs (toolkit.fp8.recipes)."""
    if cfg.precision != "fp8":
        return
    from toolkit.fp8 import recipes

    layer_spec, why = model_builder.layer_spec_choice(cfg.peft.enabled, spec)
    problem = recipes.refusal(cfg.fp8, recipes.this_device(layer_spec, why))
    if problem:
        raise ConfigError(problem)
    if spec.is_moe and layer_spec == "te" and cfg.moe.dispatcher == "allgather":
        # transformer_config.py: moe_router_padding_for_quantization refuses the allgather dispatcher
        raise ConfigError("precision=fp8 with moe.dispatcher=allgather on the Transformer Engine spec is not supported: "
                          "megatron-core pads each expert's tokens to FP8's GEMM multiple with the alltoall dispatcher "
                          "only; use moe.dispatcher=alltoall")


def check_trains(spec) -> None:
    """Refuse a model the recipe does not yet train as HF does, whatever the layout."""
    if spec.dsa:  # tests/test_family_deepseek_v32.py: the first step's loss 4.1e-4 off HF's in a tiny model
        raise ConfigError(f"fine-tuning {spec.family} (DeepSeek Sparse Attention) is not supported yet: "
                          "megatron-core's sparse attention does not yet train as HF computes it; convert, "
                          "convert verify and megatron-to-hf work")


def check_layout(cfg: TrainConfig, world_size: int, meta: CheckpointMeta) -> int:
    """Refuse layouts that don't fit, before any heavy work, with the converter's own model x
    layout check (Layout.check, which also refuses EP on a dense model or not dividing the
    experts); returns DP."""
    check_trains(meta.model_spec)
    tp, pp, ep = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep
    try:
        Layout(tp, pp, meta.vocab_divisor, ep).check(meta.model_spec, RECIPE_NAMES)
    except ConversionError as e:
        named = f"parallel.tp={tp} parallel.pp={pp}" + (f" parallel.ep={ep}" if ep > 1 else "")
        raise ConfigError(f"{named} does not fit {cfg.model.checkpoint}: {e}") from None
    dp = data_parallel_size(cfg, world_size)
    virtual.check_virtual_layout(meta.model_spec.num_layers, pp, cfg.parallel.vpp, cfg.global_batch // (cfg.micro_batch * dp),
                                 meta.model_spec.is_moe)
    if meta.model_spec.is_moe and cfg.parallel.dp_engine == "fsdp":
        raise ConfigError(f"parallel.dp_engine=fsdp with a Mixture-of-Experts model ({meta.model_spec.family}) is not "
                          "supported: the experts' expert-data-parallel group is wired for DeepSpeed only")
    if cfg.parallel.cp > 1:
        check_context_parallel_family(cfg, meta.model_spec)
    if meta.model_spec.is_moe:
        check_expert_layout(cfg, dp, meta.model_spec.family, meta.model_spec.expert_tp(cfg.parallel.tp))
        recipe_aux_loss(cfg, meta.model_spec).check(pp)
    return dp


def check_context_parallel_family(cfg: TrainConfig, spec) -> None:
    """The attention the CP path covers (toolkit.blocks.context_parallel): causal attention with
    megatron-core's RoPE, sliding windows included on the local spec; Mixture-of-Experts layers
    (their expert groups span DP x CP). LongRoPE's own rotary module is refused, before any
    process group; so are, on the Transformer Engine spec, packing (its CP attention takes only the
    causal mask) and sliding windows (its ring, TE_CP_COMM_TYPE, asserts it takes none)."""
    cp = cfg.parallel.cp
    recurrent = spec.linear_layers and ("Mamba-2" if spec.hybrid_pattern and "M" in spec.hybrid_pattern
                                        else "gated delta net" if "1" in spec.linear_layers else None)
    if recurrent:
        # a gated delta net or a Mamba-2 scan carries its state along the whole sequence; megatron-core 0.16.1's CP for
        # the former (gated_delta_net_context_parallel) is not wired in (gated_delta_net.py:37), nor its Mamba CP
        raise ConfigError(f"parallel.cp={cp} with {spec.family}'s {recurrent} layers is not supported: their "
                          "recurrent state runs along the whole sequence, which CP splits; use parallel.cp=1")
    if spec.longrope:
        raise ConfigError(f"parallel.cp={cp} with {spec.family}'s LongRoPE is not supported yet (the toolkit's rotary "
                          "module takes no CP chunks); use parallel.cp=1")
    if model_builder.layer_spec_choice(cfg.peft.enabled, spec)[0] != "te":
        return
    if cfg.data.pack:
        raise ConfigError(f"parallel.cp={cp} with data.pack=true on the Transformer Engine spec is not supported: "
                          "TE's context-parallel attention takes a causal mask only, not the documents' mask")
    if spec.window_size:
        # transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py, attn_forward_func_with_cp:
        # "The context parallel running configs cannot support sliding window attetnion!" for p2p
        raise ConfigError(f"parallel.cp={cp} with {spec.family}'s sliding-window attention on the Transformer Engine "
                          f"spec is not supported: TE's {TE_CP_COMM_TYPE} ring takes no window; use parallel.cp=1")


def master_dtype(cfg: TrainConfig) -> torch.dtype:
    """The dtype the model is built in: under FSDP the fp32 masters (FSDP casts to bf16 for compute),
    under DeepSpeed the compute dtype (DeepSpeed keeps its own fp32 masters)."""
    return torch.float32 if cfg.parallel.dp_engine == "fsdp" else DTYPES[cfg.precision]


def check_expert_layout(cfg: TrainConfig, dp: int, family: str, expert_tp: int | None = None) -> None:
    """megatron-core carves the expert groups out of TP x CP x DP with expert TP `expert_tp` (by default TP;
    parallel_state.py:786-812): EP x TP must divide TP x CP x DP, i.e. EP divides CP x DP, and the
    expert-data-parallel size is CP x DP / EP (under CP an EP group may hold a sequence's chunks). At
    expert TP 1 (experts with biases, ModelSpec.expert_tp) the EP group holds the TP ranks, each with
    experts of its own, only where EP is a multiple of TP: otherwise TP ranks share experts that each
    trains on its own tokens, which neither megatron-core's expert layers at expert TP 1 without EP (their
    sequence-parallel output is an in-place-modified view) nor DeepSpeed's gradient norm (shared
    parameters counted on TP rank 0 only) handle."""
    tp, ep, cp = cfg.parallel.tp, cfg.parallel.ep, cfg.parallel.cp
    if expert_tp == 1 and tp > 1 and ep % tp:
        raise ConfigError(f"parallel.tp={tp} with parallel.ep={ep}: {family}'s experts have biases, which megatron-core "
                          f"runs at expert TP 1 only, so each TP rank must hold experts of its own: set parallel.ep to a "
                          f"multiple of {tp}")
    if (dp * cp) % ep:
        ranks, named = (f"TP x CP x DP = {tp} x {cp} x {dp}", f"CP x DP ({cp * dp})") if cp > 1 else \
            (f"TP x DP = {tp} x {dp}", f"DP ({dp})")
        raise ConfigError(f"parallel.ep={ep} x parallel.tp={tp} does not fit the {ranks} ranks of each "
                          f"pipeline stage: EP must divide {named}; use a world size of TP x PP x a multiple of EP")
    if tp > 1 and not cfg.parallel.sequence_parallel:
        # moe_layer.py:379: megatron-core refuses MoE training with TP > 1 without sequence parallelism
        raise ConfigError(f"parallel.tp={tp}: fine-tuning a Mixture-of-Experts model ({family}) with TP > 1 needs "
                          "sequence parallelism, as in megatron-core: set parallel.sequence_parallel=true")
    if ep > 1 and cfg.parallel.zero_stage == 3:
        raise ConfigError(f"parallel.ep={ep} with zero_stage=3: DeepSpeed's ZeRO-3 does not partition expert "
                          "parameters over the expert-data-parallel group; use zero_stage=1 or 2")


def recipe_aux_loss(cfg: TrainConfig, spec):
    """The router's load-balancing loss the recipe trains with: moe.aux_loss's formula, with the HF
    config's router_aux_loss_coef (toolkit/blocks/router_losses.py)."""
    from toolkit.blocks.router_losses import AuxLoss

    return AuxLoss(cfg.moe.aux_loss, spec.moe_aux_loss_coeff)


def data_parallel_size(cfg: TrainConfig, world_size: int) -> int:
    """DP for this world size, refusing a world or batch that doesn't divide."""
    tp, pp, cp = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp
    if world_size % (tp * pp * cp):
        named = f"TP*PP*CP = {tp}*{pp}*{cp}" if cp > 1 else f"TP*PP = {tp}*{pp}"
        raise ConfigError(f"world size {world_size} is not divisible by {named}; {valid_world_sizes(cfg)}")
    dp = world_size // (tp * pp * cp)
    if cfg.global_batch % (cfg.micro_batch * dp):
        raise ConfigError(f"global_batch {cfg.global_batch} is not divisible by micro_batch {cfg.micro_batch} x DP {dp} "
                          f"(world size {world_size}); {valid_world_sizes(cfg)}")
    return dp


def valid_world_sizes(cfg: TrainConfig) -> str:
    """The world sizes that keep the global batch at this TP x PP and micro-batch."""
    tp, pp, cp, micro = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp, cfg.micro_batch
    per_step = cfg.global_batch // micro if cfg.global_batch % micro == 0 else 0
    dps = [d for d in range(1, per_step + 1) if per_step % d == 0]
    if not dps:
        return f"global_batch {cfg.global_batch} is not a multiple of micro_batch {micro} at any world size"
    sizes = ", ".join(f"{d * tp * pp * cp} (DP {d})" for d in dps)
    cp_named = f" x CP {cp}" if cp > 1 else ""
    return f"world sizes keeping global_batch {cfg.global_batch} at TP {tp} x PP {pp}{cp_named}, micro_batch {micro}: {sizes}"


def model_config(spec, cfg: TrainConfig, layout: Layout, layer_spec: str):
    """The TransformerConfig the recipe builds for the model `spec` (a ModelSpec) with `layer_spec`
    ("te" or "local"), and the routers' aux loss of a MoE model."""
    from toolkit.model import transformer_config

    settings = {}  # TransformerConfig settings the recipe chooses
    if cfg.parallel.recompute == "full":
        settings = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif cfg.parallel.recompute == "selective":
        settings = dict(recompute_granularity="selective")
    settings.update(virtual.schedule_settings(cfg.parallel.pp, cfg.parallel.vpp))
    if cfg.parallel.overlap_p2p_comm:  # the interleaved schedule only (config refuses it otherwise)
        settings.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    if cfg.parallel.cp > 1:  # TE's attention takes the CP settings; the local spec's is swapped (toolkit.model)
        settings.update(context_parallel_size=cfg.parallel.cp, cp_comm_type=TE_CP_COMM_TYPE)
    dtype, aux_loss = master_dtype(cfg), None
    if spec.is_moe:
        aux_loss = recipe_aux_loss(cfg, spec)
        settings.update(moe_token_dispatcher_type=cfg.moe.dispatcher)
        if cfg.moe.router_dtype:  # otherwise the family's: fp32 where HF routes in fp32 (the sigmoid routers)
            settings.update(moe_router_dtype=cfg.moe.router_dtype)
    if cfg.precision == "fp8" and layer_spec == "te":  # TE's FP8 through megatron-core's own fields
        from toolkit.fp8.recipes import te_fields

        settings.update(te_fields(cfg.fp8))
        if spec.is_moe:  # each expert's tokens padded to FP8's GEMM multiple (megatron-core's moe_utils / dispatcher)
            settings.update(moe_router_padding_for_quantization=True)
    config = transformer_config(spec, layout, dtype, aux_loss, layer_spec, sequence_parallel=cfg.parallel.sequence_parallel,
                                **settings)
    return config, aux_loss


def build_model(meta: CheckpointMeta, cfg: TrainConfig, wrapper: Path | None = None):
    """This rank's model: GPTModel (VirtualStages of them with parallel.vpp), or with a vision-language checkpoint's
    `wrapper` (vision_language_wrapper) the VisionLanguageModel around it, vlm.freeze's parts frozen."""
    from toolkit.convert.load import load_converted
    from toolkit.model import build_gpt_model

    layout = Layout(cfg.parallel.tp, cfg.parallel.pp, meta.vocab_divisor, cfg.parallel.ep)
    layer_spec = model_builder.layer_spec_choice(cfg.peft.enabled, meta.model_spec)[0]
    config, aux_loss = model_config(meta.model_spec, cfg, layout, layer_spec)
    spec, dtype = meta.model_spec, master_dtype(cfg)
    if cfg.parallel.vpp == 1:
        model = build_gpt_model(spec, layout, dtype, config=config, layer_spec=layer_spec, aux_loss=aux_loss)
    else:  # interleaved pipeline: this rank's chunks, one module for DeepSpeed (MoE is refused with VPP)
        model = virtual.VirtualStages(build_gpt_model(spec, layout, dtype, config=config, layer_spec=layer_spec, vp_stage=v)
                                      for v in range(cfg.parallel.vpp))
    load_converted(virtual.chunks(model), cfg.model.checkpoint, meta=meta)  # read and checked in `prepare`
    if cfg.precision == "fp8" and layer_spec == "local":  # torchao's FP8 GEMMs in megatron-core's linears
        from toolkit.fp8.local import apply_fp8

        apply_fp8(virtual.chunks(model), cfg.fp8.recipe, cfg.fp8.first_last_bf16, spec.num_layers)
    if wrapper is not None:  # parallel.vpp=1 (check_vision_language)
        from toolkit.vlm.freeze import freeze
        from toolkit.vlm.model import around_language_model, wrapper_config

        model = around_language_model(model, wrapper, wrapper_config(wrapper, spec, cfg.model.checkpoint), spec, dtype)
        freeze(model, cfg.vlm.freeze)
    return model, layout


def vision_language_wrapper(cfg: TrainConfig, meta: CheckpointMeta) -> Path | None:
    """The published checkpoint of a vision-language model (vlm.wrapper, else the HF model model.checkpoint was
    converted from): its config, vision tower and processor; None for a text model. The recipe's settings that do
    not run with images yet are refused here, in one line each."""
    from toolkit.vlm.vision_tower import TOWERS

    if meta.model_spec.family not in TOWERS:
        return None
    wrapper = cfg.vlm.wrapper or meta.hf_source
    if not wrapper or not (Path(wrapper) / "config.json").is_file():
        raise ConfigError(f"{cfg.model.checkpoint} is a vision-language model ({meta.model_spec.family}) whose published "
                          f"checkpoint (config, vision tower, processor) is not at {wrapper or 'a recorded path'}: give "
                          "its directory as vlm.wrapper=DIR")
    check_vision_language(cfg)
    return Path(wrapper)


# Recipe settings not run with images yet: (is it set, the line that refuses it)
NOT_WITH_IMAGES = (
    (lambda cfg: cfg.parallel.vpp > 1, "parallel.vpp > 1 (the tower on the first of several chunks): use parallel.vpp=1"),
    (lambda cfg: cfg.parallel.cp > 1, "parallel.cp > 1 (MRoPE takes no CP chunks): use parallel.cp=1"),
    (lambda cfg: cfg.parallel.recompute == "full", "parallel.recompute=full (DeepStack's recomputed layers would miss "
     "the visual features, toolkit.vlm.deepstack): use parallel.recompute=selective or none"),
    (lambda cfg: cfg.parallel.dp_engine == "fsdp", "parallel.dp_engine=fsdp: use parallel.dp_engine=deepspeed"),
    (lambda cfg: cfg.data.pack, "data.pack=true (images in packed rows): set data.pack=false"),
    (lambda cfg: cfg.data.truncation == "left" or cfg.data.overlong == "drop",
     "data.truncation=left or data.overlong=drop (an image sample keeps its first seq_len + 1 tokens, "
     "toolkit.train.vlm_data): leave data.truncation=right and data.overlong=truncate"),
    (lambda cfg: cfg.method == "dpo", "method=dpo: use method=sft"),
    (lambda cfg: cfg.peft.enabled, "peft.enabled=true (LoRA around the tower): set peft.enabled=false"),
    (lambda cfg: cfg.wandb.sample_generations > 0, "wandb.sample_generations (greedy decoding with images): set it to 0"),
    (lambda cfg: cfg.parallel.pp > 1 and "language" in cfg.vlm.freeze,
     "vlm.freeze=language at parallel.pp > 1: the later stages would hold nothing to train (DeepSpeed's ZeRO "
     "optimizer needs parameters on every rank); use parallel.pp=1, or train the language model"),
    (lambda cfg: cfg.parallel.zero_stage > 1 and not {"vision", "projector"} <= set(cfg.vlm.freeze),
     "parallel.zero_stage > 1 with the tower trained (vlm.freeze without vision or projector): ZeRO-2/3 reduce "
     "gradients in the order the backward makes them, which a micro-batch without images changes; use "
     "parallel.zero_stage=1 or vlm.freeze=vision,projector"),
    (lambda cfg: cfg.export_hf and not {"vision", "projector"} <= set(cfg.vlm.freeze),
     "export_hf=true with the tower trained (vlm.freeze without vision or projector): the HF export carries the tower "
     "as published, not its trained weights; set export_hf=false or vlm.freeze=vision,projector"),
)


def check_vision_language(cfg: TrainConfig) -> None:
    for refused, line in NOT_WITH_IMAGES:
        if refused(cfg):
            raise ConfigError(f"a vision-language checkpoint with {line}")


def model_inputs(wrapper: Path | None):
    """What each micro-batch becomes on the way to the model (toolkit.train.model_inputs)."""
    from toolkit.train.model_inputs import image_text_inputs, text_inputs

    return text_inputs if wrapper is None else image_text_inputs


def ds_setup(cfg: TrainConfig, dp: int):
    """The toolkit.dsconfig Setup of this recipe at data-parallel size `dp`: the one place the
    recipe's keys become DeepSpeed's, used by the trainer and by `toolkit plan` to price the
    bundle it writes (toolkit.plan_bundle), so the priced config is the run's."""
    from toolkit.dsconfig import OptimizerSettings, Setup
    from toolkit.dsconfig.settings import SCHEDULE_MEGATRON

    o = cfg.optim
    # Under CP, DeepSpeed's data-parallel group is DP x CP (toolkit.train.parallel.MegatronCoreMPU)
    # and it checks global batch = micro batch x accumulation x its group's size: each CP rank's
    # chunks of a row count as one of its samples.
    cp = cfg.parallel.cp
    return Setup(
        gpus=dp * cp * cfg.parallel.tp * cfg.parallel.pp,
        tp=cfg.parallel.tp,
        pp=cfg.parallel.pp,
        vpp=cfg.parallel.vpp,
        zero=cfg.parallel.zero_stage,
        precision=cfg.precision,
        micro_batch=cfg.micro_batch,
        global_batch=cfg.global_batch * cp,
        schedule=SCHEDULE_MEGATRON,
        gradient_clipping=o.clip_grad,
        steps_per_print=10**9,  # our trainer logs
        optimizer=OptimizerSettings(type="AdamW", lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                                    torch_adam=TORCH_ADAM),
        scheduler=None,
        overlap_comm=cfg.parallel.overlap_comm,
        reduce_bucket_size=cfg.parallel.reduce_bucket_size,
    )


def ds_config(cfg: TrainConfig, spec, dp: int) -> dict:
    """DeepSpeed config from the generator (toolkit.dsconfig), in megatron-core schedule mode: the
    schedule runs the micro-batches and DeepSpeed sees one step per global batch. The LR schedule
    is ours (a client scheduler DeepSpeed steps and checkpoints), so the config has none.
    `spec`: the model's ModelSpec (it sizes the buckets)."""
    from toolkit.dsconfig import build
    from toolkit.train.loss_scale import fp16_ds_settings

    config = build(ds_setup(cfg, dp), spec)
    if cfg.precision == "fp16":
        config["fp16"].update(fp16_ds_settings(cfg))
    return config


def build_data(cfg: TrainConfig, info: ParallelInfo, rows: DataRows):
    """This DP rank's view of the rows, in the deterministic order (toolkit.train.data.BatchSource)."""
    cp = dict(cp=info.cp, cp_rank=info.cp_rank, length=model_length(cfg))
    if cfg.method == "dpo":  # pairs: chosen and rejected of a pair in one micro-batch on one DP rank (CP refused)
        from toolkit.train.preference import PairSource

        def source(rows, seed, shuffle):
            return PairSource(rows, cfg.global_batch, cfg.micro_batch, info.dp, info.dp_rank, seed, shuffle)
    elif rows.images:  # a vision-language checkpoint's rows, with their images (CP and packing refused)
        from toolkit.train.image_rows import ImageBatchSource

        def source(rows, seed, shuffle):
            return ImageBatchSource(rows, cfg.global_batch, cfg.micro_batch, info.dp, info.dp_rank, seed, shuffle, False)
    else:
        def source(rows, seed, shuffle):
            return BatchSource(rows, cfg.global_batch, cfg.micro_batch, info.dp, info.dp_rank, seed, shuffle, cfg.data.pack,
                               **cp)
    train = source(rows.train, cfg.seed, cfg.data.shuffle)
    valid = source(rows.valid, 0, False) if rows.valid is not None else None
    return train, valid, rows.stats


def model_length(cfg: TrainConfig) -> int:
    """Tokens per row the model runs on: data.seq_len, padded under CP to the zig-zag split's multiple."""
    p = cfg.parallel
    return padded_length(cfg.data.seq_len, p.cp, p.tp, p.sequence_parallel)


@dataclass
class LoraPlan:
    """LoRA as checked before any process starts: settings, the adapter to start from, the base."""

    settings: object  # toolkit.lora.peft_dir.LoraSettings
    family: object
    init_from: Path | None
    base: dict  # toolkit.lora.peft_dir.base_reference of model.checkpoint
    base_name: str | None


def lora_plan(cfg: TrainConfig, meta: CheckpointMeta) -> LoraPlan | None:
    """peft.* resolved against the model: targets the family has, r in range, and an init_from
    adapter that fits and was (if it says so) trained on this very base checkpoint."""
    from toolkit.families import family_named
    from toolkit.lora import adapter, experts, peft_dir

    p = cfg.peft
    if not p.enabled:
        return None
    spec, family = meta.model_spec, family_named(meta.model_spec.family)
    if p.init_from:
        settings = peft_dir.read_settings(Path(p.init_from))
        peft_dir.check_base(Path(p.init_from), Path(cfg.model.checkpoint))
    else:
        names = tuple(n.strip() for n in p.target_modules.split(",") if n.strip())
        parameters = tuple(n.strip() for n in p.target_parameters.split(",") if n.strip())
        settings = peft_dir.LoraSettings(p.r, p.alpha, p.dropout, names, p.use_rslora, parameters)
    settings = adapter.resolve_settings(family, spec, settings)
    experts.check_layout(cfg.parallel.tp, experts.resolve(family, spec, settings.target_parameters, settings.dropout))
    if p.init_from:
        adapter.read_initial(Path(p.init_from), family, spec, settings)
    base = peft_dir.base_reference(Path(cfg.model.checkpoint))
    base_name = p.base_model_name_or_path
    if base_name is None and p.init_from:
        base_name = json.loads((Path(p.init_from) / peft_dir.CONFIG).read_text()).get("base_model_name_or_path")
    if base_name is None:  # the HF model the checkpoint was converted from, which PEFT can load
        base_name = meta.hf_source
    return LoraPlan(settings, family, Path(p.init_from) if p.init_from else None, base, base_name)


def apply_lora(model, plan: LoraPlan, meta: CheckpointMeta, layout: Layout, info: ParallelInfo, seed: int):
    """Freeze the base and wrap the targeted linears of this rank (toolkit.lora)."""
    from toolkit.lora import adapter

    initial = None
    if plan.init_from is not None:
        initial = adapter.read_initial(plan.init_from, plan.family, meta.model_spec, plan.settings)
    return adapter.apply_lora(model, plan.family, meta.model_spec, layout, info.tp_rank, info.pp_rank, plan.settings,
                              plan.base, seed, initial, plan.base_name)
