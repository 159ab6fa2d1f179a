"""Fine-tuning configuration: a typed dataclass tree, loaded from a recipe YAML and overridden
from the command line with dotted keys (`optim.lr=1e-4 parallel.tp=2`)."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from toolkit.bounds import Bound
from toolkit.errors import ConfigError


PositiveInt = Annotated[int, Bound(integer=True, ge=1)]
Count = Annotated[int, Bound(integer=True, ge=0)]  # 0 has a stated meaning (off / only at the end)
Beta = Annotated[float, Bound(ge=0.0, lt=1.0)]


@dataclass
class ModelConfig:
    checkpoint: str = ""  # a directory written by `toolkit convert hf-to-megatron` (either format)
    # Optional expectations: a checkpoint of another architecture is refused before training.
    family: str | None = None  # the expected family, e.g. llama or qwen3, as `toolkit convert` recorded it
    num_layers: PositiveInt | None = None  # expected decoder layers
    hidden_size: PositiveInt | None = None  # expected hidden size
    # A Megatron-LM torch_dist training checkpoint (iteration or run directory) whose DistributedOptimizer
    # state, saved fully_reshardable, a fresh run starts from: its fp32 master weights and Adam moments
    # replace model.checkpoint's weights (that checkpoint's own export, converted). A resume ignores it.
    optimizer_state: str | None = None
    # Adam's step count with optimizer_state: "keep" Megatron's, so the bias correction of the carried
    # moments stays what it was (at step 0 AdamW would scale them up as if they were one step old); or "reset"
    optimizer_step: Literal["keep", "reset"] = "keep"


@dataclass
class ParallelConfig:
    tp: PositiveInt = 1  # tensor-parallel size (megatron-core); divides the attention heads
    pp: PositiveInt = 1  # pipeline-parallel size (megatron-core 1F1B); divides the layers
    zero_stage: int = 1  # 1, 2 or 3; only 1 with PP > 1
    # activation recomputation at megatron-core's granularity: the attention core, or every layer
    recompute: Literal["selective", "full"] | None = None
    # megatron-core sequence parallelism (TP > 1): norms and residuals hold seq_len / TP tokens per rank
    sequence_parallel: bool = False
    # context parallelism: the sequence split zig-zag over CP ranks (2·CP chunks), attention across
    # them (toolkit/blocks/context_parallel.py); gradients reduced over DP x CP. World = TP x PP x CP x DP
    cp: PositiveInt = 1
    # expert parallelism (Mixture-of-Experts): each EP rank holds experts / EP experts, carved out of CP x DP
    ep: PositiveInt = 1
    # virtual pipeline stages (interleaved 1F1B): model chunks per pipeline rank (toolkit/train/virtual.py)
    vpp: PositiveInt = 1
    # data parallelism: DeepSpeed ZeRO (zero_stage), or PyTorch FSDP2 (fully_shard; PP = 1, zero_stage unused)
    dp_engine: Literal["deepspeed", "fsdp"] = "deepspeed"
    # ZeRO's gradient reduction overlapped with the backward: null = on at ZeRO-2/3, off at ZeRO-1
    # (DeepSpeed asserts there under megatron-core's schedule)
    overlap_comm: bool | None = None
    reduce_bucket_size: PositiveInt | None = None  # ZeRO's reduce bucket in elements (null: sized from the model)
    # megatron-core's p2p overlap of the interleaved schedule (parallel.vpp > 1; batched p2p off)
    overlap_p2p_comm: bool = False
    # megatron-core's TP communication overlap: refused, it lives in Transformer Engine's layers only
    tp_comm_overlap: bool = False


@dataclass
class MoeConfig:
    """Mixture-of-Experts settings (ignored for a dense model)."""

    # megatron-core's moe_token_dispatcher_type: all-to-all over EP (the GPU default), or every
    # rank all-gathers the TP x EP group's tokens and keeps those routed to its experts
    dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    # the router's load-balancing loss (toolkit/blocks/router_losses.py), with the HF config's router_aux_loss_coef:
    # megatron-core's (per layer, summed) or HF's load_balancing_loss_func (layers pooled; PP 1 only)
    aux_loss: Literal["megatron", "hf"] = "megatron"
    # megatron-core's moe_router_dtype: the router's logits, softmax and top-k in fp32 or fp64 (None:
    # as HF's model routes: fp32 for the sigmoid routers of GLM-4.5 and DeepSeek-V3, the model's dtype
    # for the others). fp64 takes the router's own rounding out of its top-k choices (the tests
    # compare with an HF reference whose router runs in fp64); fp32 keeps bf16 runs' routing in fp32.
    router_dtype: Literal["fp32", "fp64"] | None = None


@dataclass
class DataColumns:
    """The data set's column for each of the toolkit's (data.columns.prompt=question): a record's
    columns are renamed to these before it is read."""

    prompt: str = "prompt"  # masked out of the loss
    response: str = "response"  # trained, with the prompt
    messages: str = "messages"  # a list of {"role", "content"}, rendered with the chat template
    text: str = "text"  # every token trained
    chosen: str = "chosen"  # method=dpo: the preferred completion (text, or messages)
    rejected: str = "rejected"  # method=dpo: the other one


@dataclass
class DataConfig:
    # A file (.jsonl read line by line; .json, .parquet, .arrow, .csv read by `datasets`), a
    # `save_to_disk` directory, a directory of data files, or a Hub dataset name; each record is
    # {"prompt", "response"}, {"messages": [...]} or {"text"} (see data.columns). Several,
    # comma-separated, form a mixture (data.weights).
    train_file: str = ""
    weights: str | None = None  # the mixture's shares, comma-separated, one per train_file entry
    split: str = "train"  # of a saved DatasetDict or a Hub dataset; slices too ("train[:90%]")
    valid_file: str | None = None  # the same formats; its loss is the eval loss
    valid_split: str | None = None  # validate on this split of train_file when valid_file is not given
    columns: DataColumns = field(default_factory=DataColumns)
    chat_template: str | None = None  # a Jinja file, or a name (chatml, llama3): sets or overrides the tokenizer's
    seq_len: PositiveInt = 128  # tokens per sample (longer ones: see overlong)
    pack: bool = False  # concatenate samples, with attention reset at document boundaries
    overlong: Literal["truncate", "drop"] = "truncate"  # samples longer than seq_len + 1 tokens
    truncation: Literal["right", "left"] = "right"  # which end an overlong sample loses
    malformed: Literal["error", "skip"] = "error"  # malformed JSONL lines (skips are counted)
    # Refuse data of which more than this share of tokens is the tokenizer's unknown token (a
    # tokenizer that cannot read it: training would learn <unk>).
    max_unk_share: Annotated[float, Bound(ge=0.0, le=1.0)] = 0.05
    cache_dir: str | None = None  # `datasets`' cache and the prepared data under it (default RUN_DIR/data_cache)
    # Tokenize each source once into memory-mapped arrays under CACHE_DIR/prepared, keyed on
    # everything that changes a token, which every rank maps and every later start reuses (false:
    # tokenized in memory by every rank at every start).
    prepared: bool = True
    num_proc: PositiveInt | None = None  # processes that tokenize while preparing (default: every core this process may use)
    verify_prepared: bool = False  # check every prepared array's BLAKE3 on open (their sizes are always checked)
    shuffle: bool = True  # a seeded order, the same on every layout; its position is checkpointed


@dataclass
class OptimConfig:
    lr: Annotated[float, Bound(gt=0.0)] = 1e-4  # peak learning rate (AdamW)
    min_lr: Annotated[float, Bound(ge=0.0)] = 0.0  # where the cosine schedule ends, at the last step
    weight_decay: Annotated[float, Bound(ge=0.0)] = 0.0  # never applied to norms and biases
    betas: tuple[Beta, Beta] = (0.9, 0.999)  # AdamW's
    eps: Annotated[float, Bound(gt=0.0)] = 1e-8  # AdamW's
    warmup_steps: Count = 0  # linear warmup from 0 to lr
    schedule: Literal["cosine", "constant"] = "cosine"  # after the linear warmup
    clip_grad: Annotated[float, Bound(ge=0.0)] = 1.0  # 0: no clipping


@dataclass
class WandbConfig:
    enabled: bool = False  # log metrics to W&B (the trainer owns the run; set WANDB_MODE=offline without a network)
    project: str = "toolkit-finetune"
    run_id: str | None = None  # default: one id per run_dir, kept across resumes
    mode: str | None = None  # e.g. "offline"; WANDB_MODE from the environment wins
    # At every eval, a table `eval_samples` (step, prompt, reference, output) of the first N validation
    # samples' prompts greedily continued (toolkit.train.generations); 0: off. PP = 1 only (the prompt is
    # a sample's tokens before its first trained token; the reference, the rest of that sample).
    sample_generations: Count = 0
    sample_new_tokens: PositiveInt = 32  # at most this many tokens per output (fewer at eos or at data.seq_len)


@dataclass
class PeftConfig:
    """LoRA (toolkit.lora): the base frozen, only the adapter trained and saved."""

    enabled: bool = False  # train a LoRA adapter instead of every weight
    r: int = 8  # checked against the targets' dimensions once the model is known
    alpha: Annotated[float, Bound(gt=0.0)] = 16.0  # the update is scaled by alpha / r
    dropout: Annotated[float, Bound(ge=0.0, lt=1.0)] = 0.0  # on the adapter's input
    target_modules: str = "all-linear"  # PEFT names, comma-separated: q_proj,v_proj
    # PEFT's target_parameters: a MoE model's fused expert weights, comma-separated (gate_up_proj,down_proj):
    # one rank-r LoRA per routed expert (docs/guide/lora.md); empty: the experts stay frozen
    target_parameters: str = ""
    use_rslora: bool = False  # scale by alpha / sqrt(r) instead of alpha / r
    init_from: str | None = None  # an HF PEFT adapter directory: its config supplies r, alpha, dropout and targets
    # written into the exported adapter_config.json: the HF model AutoPeftModelForCausalLM loads as the base
    base_model_name_or_path: str | None = None


@dataclass
class LossScaleConfig:
    """fp16's dynamic loss scaling (DeepSpeed's DynamicLossScaler; toolkit.train.loss_scale)."""

    initial_scale_power: Annotated[int, Bound(integer=True, ge=0, le=32)] = 16  # the first scale is 2**power
    window: PositiveInt = 1000  # clean steps before the scale doubles
    hysteresis: PositiveInt = 2  # overflows in a row before the scale halves (each one skips its step)
    min_scale: Annotated[float, Bound(gt=0.0)] = 1.0  # the scale never halves below this
    max_consecutive_skips: PositiveInt = 20  # overflowed steps in a row that stop the run


@dataclass
class Fp8Config:
    """precision=fp8 (toolkit.fp8; docs/guide/precision.md): the decoder layers' GEMMs in FP8, the
    weights in bf16 and DeepSpeed's fp32 masters and optimizer as with bf16."""

    # Transformer Engine's (GPUs with TE; megatron-core's fp8_recipe): tensorwise (current scaling),
    # delayed, blockwise (Hopper and later), mxfp8 (Blackwell). torchao's on the local spec (CPU, GPUs
    # without TE): tensorwise and rowwise.
    recipe: Literal["tensorwise", "rowwise", "delayed", "blockwise", "mxfp8"] = "tensorwise"
    first_last_bf16: bool = False  # the first and last decoder layers in bf16, as Megatron-Bridge's current-scaling recipe
    amax_history_len: PositiveInt = 1024  # recipe=delayed: amaxes kept per tensor (Megatron-Bridge's delayed recipe)
    amax_compute_algo: Literal["max", "most_recent"] = "max"  # recipe=delayed: the scale from the history's max or its last
    margin: Count = 0  # recipe=delayed: scales lowered by 2**margin
    # the weights kept in FP8 (megatron-core's fp8_param, TE spec), so that their all-gathers move FP8;
    # off, as in megatron-core, and refused for now: DeepSpeed's ZeRO keeps bf16 weights
    param_gather: bool = False


@dataclass
class DpoConfig:
    """Preference fine-tuning (method: dpo; toolkit.train.preference): TRL's DPOTrainer losses."""

    # sigmoid: DPO (-log sigmoid(beta * margin)); ipo: IPO's squared loss on length-normalised
    # log-ratios (beta is its tau); robust: rDPO, whose label_smoothing is the chance a label is flipped
    loss_type: Literal["sigmoid", "ipo", "robust"] = "sigmoid"
    beta: Annotated[float, Bound(gt=0.0)] = 0.1  # how far the policy may move from the reference
    label_smoothing: Annotated[float, Bound(ge=0.0, lt=0.5)] = 0.0  # loss_type=robust only (TRL's)


# The parts of a vision-language model `vlm.freeze` names (toolkit/vlm/freeze.py): the vision tower's encoder, its
# projector into the language model (Qwen3-VL's patch merger and DeepStack mergers), the language model
VLM_PARTS = ("vision", "projector", "language")


@dataclass
class VlmConfig:
    """Vision-language checkpoints (Qwen3-VL; docs/guide/vlm.md): images in the data, the vision tower on the
    first pipeline stage."""

    # the parts not trained (a list, or comma-separated on the command line), as LLaMA-Factory's defaults
    # freeze_vision_tower and freeze_multi_modal_projector; [] trains every weight
    freeze: list[Literal["vision", "projector", "language"]] = field(default_factory=lambda: ["vision", "projector"])
    # the checkpoint as published (its config, vision tower and processor); null: the HF model model.checkpoint
    # was converted from, as `toolkit convert` recorded it
    wrapper: str | None = None


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    vlm: VlmConfig = field(default_factory=VlmConfig)  # Read only where model.checkpoint is a vision-language model.
    # sft: next-token loss on the responses; dpo: preference pairs {"prompt", "chosen", "rejected"}
    # against a frozen reference (the starting weights, or the base with the LoRA adapter disabled)
    method: Literal["sft", "dpo"] = "sft"
    dpo: DpoConfig = field(default_factory=DpoConfig)
    # training precision (fp32 master weights with bf16/fp16/fp8); fp8: bf16 weights, FP8 GEMMs (fp8.*)
    precision: Literal["bf16", "fp16", "fp32", "fp8"] = "bf16"
    fp8: Fp8Config = field(default_factory=Fp8Config)  # precision=fp8 only
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)  # fp16 only
    micro_batch: PositiveInt = 1  # sequences (method=dpo: pairs, two sequences each) per forward on one DP rank
    global_batch: PositiveInt = 8  # sequences (method=dpo: pairs) per optimizer step, over every micro-batch and DP rank
    steps: PositiveInt = 100  # optimizer steps in all (a resume with more steps extends the run)
    seed: Annotated[int, Bound(integer=True, ge=0)] = 1234  # data order, LoRA initialisation, dropout
    log_every: PositiveInt = 10  # steps between metric lines
    eval_every: Count = 0  # 0: only at the end (when a validation set is given)
    save_every: Count = 0  # 0: only at the end
    keep_last: PositiveInt = 2  # complete checkpoints kept; the one `latest` names is never pruned
    run_dir: str = "runs/finetune"  # checkpoints, metrics.jsonl, resolved_config.json and the export
    resume: str = "none"  # "none", "auto" (latest complete checkpoint in run_dir) or a checkpoint path
    export_hf: bool = True  # a full fine-tune exports RUN_DIR/hf at the end (a LoRA run always exports RUN_DIR/adapter)
    peak_tflops: Annotated[float, Bound(gt=0.0)] | None = None  # per device; looked up for known GPUs, nominal on CPU

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


FP8_WITH_FP16 = ("FP8 with fp16 is not supported: FP8 trains on bf16 weights with fp32 masters (TE's and torchao's "
                 "recipes are bf16 ones; fp16's loss scaling is not wired with FP8); use precision=fp8")
# Values refused on purpose get the reason, not only the list of choices.
REFUSED_CHOICES = {
    "bf16,fp16": "fp16 and bf16 cannot both be enabled (DeepSpeed asserts); choose one precision",
    "fp16,fp8": FP8_WITH_FP16,
}


def _choice_key(value) -> str:
    """A list or comma-separated value as its sorted items, so `fp16,bf16` and [bf16, fp16] meet."""
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    return ",".join(sorted(str(item).strip() for item in items))


def _coerce_number(value, kind: type):
    if isinstance(value, bool):
        raise ConfigError(f"expected a number, got {value!r}")
    try:
        number = float(value) if isinstance(value, str) else value
    except ValueError:
        raise ConfigError(f"expected a number, got {value!r}") from None
    if not isinstance(number, (int, float)):
        raise ConfigError(f"expected a number, got {value!r}")
    if not math.isfinite(number):
        raise ConfigError(f"expected a finite number, got {value!r}")
    if kind is int:
        if float(number) != int(number):
            raise ConfigError(f"expected a whole number, got {value!r}")
        return int(number)
    return float(number)


def _coerce(value, hint):
    """Turn a YAML/CLI value into the dataclass field's type, checking choices and bounds."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if value is None or hint is typing.Any:
        return value
    if origin is Annotated:
        result = _coerce(value, args[0])
        for bound in args[1:]:
            if not bound.allows(result):
                raise ConfigError(f"must be {bound.describe()}, got {value!r}")
        return result
    if origin is Literal:
        if value in args:
            return value
        reason = REFUSED_CHOICES.get(_choice_key(value))
        raise ConfigError(reason or f"must be one of {', '.join(map(str, args))}, got {value!r}")
    if origin is typing.Union or origin is types.UnionType:
        if value in ("none", "None", "null"):
            return None
        errors = []
        for option in args:
            if option is type(None):
                continue
            try:
                return _coerce(value, option)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError("; ".join(errors))
    if origin is list:  # a YAML list, or comma-separated text from the command line
        items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"expected a list, got {value!r}")
        return [_coerce(v, args[0]) for v in items]
    if origin is tuple:
        items = json.loads(value) if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or len(items) != len(args):
            raise ConfigError(f"expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(v, a) for v, a in zip(items, args))
    if hint is bool:
        if isinstance(value, str):
            if value.lower() in ("true", "1", "yes"):
                return True
            if value.lower() in ("false", "0", "no"):
                return False
            raise ConfigError(f"expected true/false, got {value!r}")
        if not isinstance(value, (bool, int)):
            raise ConfigError(f"expected true/false, got {value!r}")
        return bool(value)
    if hint in (int, float):
        return _coerce_number(value, hint)
    if hint is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"expected text, got {value!r}")
        return str(value)
    raise ConfigError(f"unsupported type {hint}")


def _apply(obj, key_path: list[str], value, full_key: str) -> None:
    hints = typing.get_type_hints(type(obj), include_extras=True)
    name = key_path[0]
    if name not in hints:
        known = ", ".join(hints)
        close = difflib.get_close_matches(name, list(hints), n=1)
        parts = full_key.split(".")
        depth = len(parts) - len(key_path)  # the keys above this level, then this one, then its sub-keys
        hint = f"did you mean {'.'.join([*parts[:depth], close[0], *parts[depth + 1:]])!r}? " if close else ""
        raise ConfigError(f"unknown config key {full_key!r} ({hint}known at this level: {known})")
    if len(key_path) > 1:
        child = getattr(obj, name)
        if not dataclasses.is_dataclass(child):
            raise ConfigError(f"{full_key!r}: {name} has no sub-keys")
        _apply(child, key_path[1:], value, full_key)
        return
    if dataclasses.is_dataclass(getattr(obj, name)):
        if not isinstance(value, dict):
            raise ConfigError(f"{full_key!r} is a section; give its keys")
        for k, v in value.items():
            _apply(getattr(obj, name), [k], v, f"{full_key}.{k}")
        return
    try:
        setattr(obj, name, _coerce(value, hints[name]))
    except (ValueError, TypeError, ConfigError) as e:
        raise ConfigError(f"{full_key}={value!r}: {e}") from None


def _is_text_field(cfg, keys: list[str]) -> bool:
    """String fields take command-line text verbatim (a value like `a: b` is not YAML for them)."""
    obj = cfg
    for name in keys[:-1]:
        obj = getattr(obj, name, None)
        if not dataclasses.is_dataclass(obj):
            return False
    hint = typing.get_type_hints(type(obj)).get(keys[-1])
    return hint is str or (hint is not None and set(typing.get_args(hint)) == {str, type(None)})


def _parse_value(text: str):
    """A command-line value as YAML (numbers, lists, true/false), or the plain string when it isn't YAML."""
    import yaml

    if not text:
        return text
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def load_config(path: str | None, overrides: list[str] = ()) -> TrainConfig:
    """Defaults, then the recipe YAML, then `key.sub=value` overrides."""
    import yaml

    data = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"recipe {path} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"recipe {path} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"recipe {path} must be a mapping of config keys")
    return config_from_mapping(data, overrides)


def config_from_mapping(data: dict, overrides: list[str] = ()) -> TrainConfig:
    """Defaults, then `data` (a recipe's mapping, as YAML gives it), then `key.sub=value` overrides."""
    cfg = TrainConfig()
    for key, value in data.items():
        _apply(cfg, [key], value, key)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        keys = key.split(".")
        _apply(cfg, keys, value if _is_text_field(cfg, keys) else _parse_value(value), key)
    validate(cfg)
    return cfg


def validate(cfg: TrainConfig) -> None:
    """Rules across fields (each field's type, choices and range are checked as it is read);
    layout checks happen once the world size is known."""
    if cfg.parallel.pp > 1 and cfg.parallel.zero_stage > 1:
        raise ConfigError("ZeRO-2/3 do not work with pipeline parallelism (several micro-batches in flight); use zero_stage=1")
    if cfg.parallel.zero_stage not in (1, 2, 3):
        raise ConfigError(
            "zero_stage must be 1, 2 or 3: at ZeRO-0 DeepSpeed refuses the direct backward calls of "
            "megatron-core's schedule (and reports no gradient norm); ZeRO-1 costs nothing extra at DP=1"
        )
    _validate_sequence_parallel(cfg)
    _validate_context_parallel(cfg)
    _validate_virtual_pipeline(cfg)
    _validate_fsdp(cfg)
    _validate_overlap(cfg)
    _validate_fp8(cfg)
    if cfg.optim.min_lr > cfg.optim.lr:
        raise ConfigError(f"optim.min_lr {cfg.optim.min_lr:g} is above optim.lr {cfg.optim.lr:g}")
    if cfg.resume not in ("none", "auto") and not Path(cfg.resume).is_dir():
        raise ConfigError(f"resume={cfg.resume}: not 'none', 'auto' or a checkpoint directory")
    if not cfg.model.checkpoint:
        raise ConfigError("model.checkpoint is required (a directory from `toolkit convert hf-to-megatron`)")
    if cfg.peft.init_from and not cfg.peft.enabled:
        raise ConfigError("peft.init_from is given but peft.enabled is false: set peft.enabled=true to train the adapter")
    if cfg.peft.init_from and not Path(cfg.peft.init_from).is_dir():
        raise ConfigError(f"peft.init_from={cfg.peft.init_from}: not a directory")
    if not cfg.data.train_file:
        raise ConfigError("data.train_file is required")
    _validate_optimizer_state(cfg)
    _validate_sample_generations(cfg)
    _validate_dpo(cfg)
    _validate_vlm_freeze(cfg.vlm.freeze)
    _validate_run_dir(cfg.run_dir)


def _validate_vlm_freeze(freeze: list[str]) -> None:
    if set(freeze) == set(VLM_PARTS):
        raise ConfigError(f"vlm.freeze={','.join(freeze)} freezes every part: nothing would train; leave one out "
                          "(e.g. vlm.freeze=vision,projector trains the language model)")


def _validate_sample_generations(cfg: TrainConfig) -> None:
    if not cfg.wandb.sample_generations:
        return
    if cfg.parallel.pp > 1:
        raise ConfigError(f"wandb.sample_generations with parallel.pp={cfg.parallel.pp} is not supported "
                          "(greedy decoding runs at PP = 1 only); set wandb.sample_generations=0")
    if not cfg.wandb.enabled:
        raise ConfigError("wandb.sample_generations is set but wandb.enabled is false: set wandb.enabled=true")
    if cfg.data.valid_file is None and cfg.data.valid_split is None:
        raise ConfigError("wandb.sample_generations needs a validation set: set data.valid_file or data.valid_split")


def _validate_dpo(cfg: TrainConfig) -> None:
    if cfg.method != "dpo":
        return
    if cfg.dpo.label_smoothing and cfg.dpo.loss_type != "robust":
        raise ConfigError(f"dpo.label_smoothing={cfg.dpo.label_smoothing:g} with dpo.loss_type={cfg.dpo.loss_type}: "
                          "label smoothing is the flip rate of loss_type=robust (rDPO), as in TRL 1.16, whose sigmoid "
                          "loss has none; set dpo.loss_type=robust or dpo.label_smoothing=0")
    refused = {"data.pack=true": cfg.data.pack, "parallel.dp_engine=fsdp": cfg.parallel.dp_engine == "fsdp",
               f"parallel.cp={cfg.parallel.cp}": cfg.parallel.cp > 1,  # a sequence's log-prob would span CP ranks
               "wandb.sample_generations": bool(cfg.wandb.sample_generations),
               "model.optimizer_state": cfg.model.optimizer_state is not None}
    for what, given in refused.items():
        if given:
            raise ConfigError(f"method=dpo with {what} is not supported: a preference pair is two unpacked rows "
                              "trained through DeepSpeed; leave it unset")


def _validate_run_dir(run_dir: str) -> None:
    """A run_dir (or a directory above it) that is a file would fail at the first write, after
    the ranks started: refused here."""
    for path in (Path(run_dir), *Path(run_dir).parents):
        if path.exists() and not path.is_dir():
            what = "is" if path == Path(run_dir) else f"lies inside {path}, which is"
            raise ConfigError(f"run_dir={run_dir} {what} an existing file, not a directory: give a directory path")


def _validate_optimizer_state(cfg: TrainConfig) -> None:
    path = cfg.model.optimizer_state
    if path is None:
        return
    if not Path(path).is_dir():
        raise ConfigError(f"model.optimizer_state={path}: not a directory")
    for enabled, what in ((cfg.peft.enabled, "peft.enabled (LoRA trains an adapter Megatron's optimizer never saw)"),
                          (cfg.parallel.dp_engine == "fsdp", "parallel.dp_engine=fsdp (the state is loaded into "
                                                             "DeepSpeed's ZeRO optimizer)")):
        if enabled:
            raise ConfigError(f"model.optimizer_state with {what} is not supported")


def _validate_virtual_pipeline(cfg: TrainConfig) -> None:
    """Combinations not offered with interleaving (its layout rules: toolkit.train.virtual.check_virtual_layout)."""
    vpp = cfg.parallel.vpp
    if vpp == 1:
        return
    # not proven against the reference with virtual stages yet: refused rather than trusted
    for enabled, what in ((cfg.peft.enabled, "peft.enabled (LoRA)"), (cfg.precision == "fp16", "precision=fp16"),
                          (cfg.parallel.ep > 1, "parallel.ep > 1")):
        if enabled:
            raise ConfigError(f"parallel.vpp={vpp} with {what} is not supported yet; use parallel.vpp=1")


def _validate_sequence_parallel(cfg: TrainConfig) -> None:
    if not cfg.parallel.sequence_parallel:
        return
    tp = cfg.parallel.tp
    if tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1: it splits the sequence over the TP ranks")
    if cfg.data.seq_len % tp and cfg.parallel.cp == 1:  # under CP the batches are padded to the split's multiple
        raise ConfigError(f"data.seq_len {cfg.data.seq_len} is not divisible by parallel.tp {tp}, "
                          "which sequence parallelism splits it over")
    if cfg.peft.enabled:
        raise ConfigError("peft.enabled with parallel.sequence_parallel is not supported: the LoRA linears "
                          "do not gather the sequence-parallel input")


def _validate_context_parallel(cfg: TrainConfig) -> None:
    cp = cfg.parallel.cp
    if cp == 1:
        return
    for problem, what in ((cfg.parallel.vpp > 1, f"parallel.vpp={cfg.parallel.vpp} (the interleaved schedule)"),
                          (cfg.parallel.dp_engine == "fsdp", "parallel.dp_engine=fsdp (FSDP would shard over DP alone, "
                                                            "not DP x CP)"),
                          (cfg.peft.enabled, "peft.enabled (LoRA)"),
                          (cfg.wandb.sample_generations > 0, "wandb.sample_generations (decoding runs whole sequences)")):
        if problem:
            raise ConfigError(f"parallel.cp={cp} with {what} is not supported yet; use parallel.cp=1")


def _validate_fsdp(cfg: TrainConfig) -> None:
    if cfg.parallel.dp_engine != "fsdp":
        return
    if cfg.parallel.pp > 1:
        raise ConfigError(f"parallel.dp_engine=fsdp with parallel.pp={cfg.parallel.pp}: FSDP is offered at PP = 1 only "
                          "(it would gather every stage's layers per micro-batch); use the DeepSpeed engine with PP")
    if cfg.parallel.overlap_comm is not None or cfg.parallel.reduce_bucket_size is not None:
        raise ConfigError("parallel.overlap_comm / reduce_bucket_size are DeepSpeed ZeRO settings, which "
                          "parallel.dp_engine=fsdp ignores (FSDP2 overlaps its all-gathers and reduce-scatters itself)")
    if cfg.precision == "fp16":
        raise ConfigError("parallel.dp_engine=fsdp with precision=fp16 is not supported (no loss scaler is wired "
                          "for FSDP); use bf16, or the DeepSpeed engine for fp16")
    if cfg.peft.enabled:
        raise ConfigError("parallel.dp_engine=fsdp with peft.enabled is not supported: the LoRA adapter is "
                          "trained under DeepSpeed only")


def _validate_fp8(cfg: TrainConfig) -> None:
    """The FP8 rules that need no device (those that do: toolkit.fp8.recipes.refusal)."""
    if cfg.precision != "fp8":
        if cfg.fp8 != Fp8Config():
            changed = [f"fp8.{f.name}" for f in dataclasses.fields(Fp8Config)
                       if getattr(cfg.fp8, f.name) != getattr(Fp8Config(), f.name)]
            raise ConfigError(FP8_WITH_FP16 if cfg.precision == "fp16" else
                              f"{', '.join(changed)} given with precision={cfg.precision}: set precision=fp8 to train in FP8")
        return
    if cfg.fp8.first_last_bf16 and cfg.fp8.recipe == "delayed":
        raise ConfigError("fp8.first_last_bf16 with fp8.recipe=delayed is not supported (megatron-core refuses it: "
                          "delayed scaling keeps one amax history for every layer); use fp8.recipe=tensorwise")
    if cfg.fp8.param_gather:
        raise ConfigError("fp8.param_gather=true is not supported yet: megatron-core's fp8_param makes the weights "
                          "Transformer Engine FP8 tensors, made for megatron-core's distributed optimizer; DeepSpeed's "
                          "ZeRO flattens or partitions bf16 weights and copies its fp32 masters into them; leave it false")
    for given, what in ((cfg.peft.enabled, "peft.enabled (LoRA's adapters are not FP8 linears)"),
                        (cfg.parallel.dp_engine == "fsdp", "parallel.dp_engine=fsdp (FSDP's fp32 masters and its "
                                                           "casts are not wired with FP8)")):
        if given:
            raise ConfigError(f"precision=fp8 with {what} is not supported yet; use precision=bf16")


def _validate_overlap(cfg: TrainConfig) -> None:
    from toolkit.dsconfig import rules
    from toolkit.dsconfig.settings import SCHEDULE_MEGATRON

    p = cfg.parallel
    if p.dp_engine == "deepspeed":
        problem = rules.overlap(p.zero_stage, SCHEDULE_MEGATRON, p.overlap_comm, p.reduce_bucket_size)
        if problem:
            raise ConfigError(f"parallel.{problem}")
    if p.overlap_p2p_comm and p.vpp <= 1:
        raise ConfigError("parallel.overlap_p2p_comm=true needs the interleaved schedule (parallel.vpp > 1): "
                          "plain 1F1B ignores it")
    if p.tp_comm_overlap:
        raise ConfigError("parallel.tp_comm_overlap=true is not supported: megatron-core overlaps TP communication "
                          "only inside Transformer Engine's layers (userbuffers, te.initialize_ub, with sequence "
                          "parallelism), which this trainer does not set up and the local (CPU) spec lacks")
