"""The keys DeepSpeed 0.19.8 actually reads, and what it expects under them.

DeepSpeed reads top-level keys with dict.get and a default, so a misspelled key is silently
ignored; the same holds inside the blocks that are plain dicts rather than pydantic models.
These tables were taken from deepspeed/runtime/config.py (DeepSpeedConfig._initialize_params and
the get_* helpers), deepspeed/__init__.py (mesh keys) and the engine's consumers of each block;
tests/test_dsconfig_keys.py re-derives them by recording which keys DeepSpeedConfig looks up, so
an upgrade that adds or drops a key fails there first.

A value is a type (int, float, bool, str, dict, list), a tuple of allowed strings, or ANY.
"""

from __future__ import annotations

ANY = object()
DTYPES = ("fp16", "bf16", "fp32", "float16", "bfloat16", "float32", "half", "float", "torch.float16",
          "torch.bfloat16", "torch.float32")

# Blocks DeepSpeed validates itself with pydantic models that forbid extra keys
# (DeepSpeedConfigModel, extra="forbid"); check() runs those models.
VALIDATED_BLOCKS = (
    "zero_optimization", "fp16", "bf16", "bfloat16", "tensorboard", "wandb", "csv_monitor", "comet",
    "comms_logger", "compile", "hybrid_engine", "tensor_parallel", "weight_quantization",
)

# Blocks DeepSpeed passes on as they are; no check of their contents here.
OPAQUE_BLOCKS = ("data_efficiency", "datastates_ckpt", "expert_parallel")

TOP_LEVEL: dict[str, object] = {
    "train_batch_size": int,
    "train_micro_batch_size_per_gpu": int,
    "gradient_accumulation_steps": int,
    "managed_gradient_accumulation": bool,
    "steps_per_print": int,
    "dump_state": bool,
    "disable_python_gc": bool,
    "disable_allgather": bool,
    "communication_data_type": ("fp16", "bf16", "fp32"),
    "seq_parallel_communication_data_type": ("fp16", "bf16", "fp32"),
    "prescale_gradients": bool,
    "gradient_predivide_factor": float,
    "gradient_allreduce_op": ("mean", "sum"),
    "gradient_clipping": float,
    "zero_allow_untested_optimizer": bool,
    "zero_force_ds_cpu_optimizer": bool,
    "wall_clock_breakdown": bool,
    "memory_breakdown": bool,
    "use_data_before_expert_parallelism": bool,
    "dataloader_drop_last": bool,
    "log_level": str,
    "vocabulary_size": int,
    # deepspeed/__init__.py: a (data, sequence) device mesh when both are given
    "sequence_parallel_size": int,
    "data_parallel_size": int,
    **{block: dict for block in VALIDATED_BLOCKS + OPAQUE_BLOCKS},
    "activation_checkpointing": dict,
    "flops_profiler": dict,
    "pipeline": dict,
    "checkpoint": dict,
    "data_types": dict,
    "aio": dict,
    "optimizer": dict,
    "scheduler": dict,
    "torch_autocast": dict,
    "timers": dict,
    "autotuning": dict,
}

# Sub-keys of the plain-dict blocks (the ones not in VALIDATED_BLOCKS or OPAQUE_BLOCKS).
BLOCK_KEYS: dict[str, dict[str, object]] = {
    "activation_checkpointing": {
        "partition_activations": bool,
        "contiguous_memory_optimization": bool,
        "cpu_checkpointing": bool,
        "number_checkpoints": int,
        "synchronize_checkpoint_boundary": bool,
        "profile": bool,
    },
    "flops_profiler": {
        "enabled": bool,
        "recompute_fwd_factor": float,
        "profile_step": int,
        "module_depth": int,
        "top_modules": int,
        "detailed": bool,
        "output_file": str,
    },
    # get_pipeline_config copies every key; runtime/pipe/engine.py reads these.
    "pipeline": {
        "stages": ANY,
        "partition": str,
        "seed_layers": bool,
        "activation_checkpoint_interval": int,
        "pipe_partitioned": bool,
        "grad_partitioned": bool,
        "use_reentrant": bool,
    },
    "checkpoint": {
        "tag_validation": str,  # Ignore / Warn / Fail, any case; DeepSpeed rejects other values
        "load_universal": bool,
        "use_node_local_storage": bool,
        "parallel_write": dict,
        "checkpoint_serialization": bool,
        "writer": ANY,
    },
    "data_types": {
        "grad_accum_dtype": DTYPES,
        "param_dtype": DTYPES,
        "buffer_dtype": DTYPES,
        "keep_in_fp32_modules": ANY,
    },
    "aio": {
        "block_size": int,
        "queue_depth": int,
        "intra_op_parallelism": int,
        "single_submit": bool,
        "overlap_events": bool,
        "use_gds": bool,
    },
    "optimizer": {"type": str, "params": dict, "legacy_fusion": bool},
    "scheduler": {"type": str, "params": dict},
    "torch_autocast": {"enabled": bool, "dtype": DTYPES, "lower_precision_safe_modules": list},
    "timers": {"throughput": dict},  # validated by DeepSpeed's DeepSpeedThroughputTimerConfig
    "autotuning": {
        key: ANY
        for key in (
            "enabled", "fast", "results_dir", "exps_dir", "overwrite", "start_profile_step", "end_profile_step",
            "metric_path", "metric", "tuner_type", "tuner_early_stopping", "tuner_num_trials", "arg_mappings",
            "model_info", "model_info_path", "mp_size", "max_train_batch_size", "min_train_batch_size",
            "max_train_micro_batch_size_per_gpu", "min_train_micro_batch_size_per_gpu",
            "num_tuning_micro_batch_sizes",
        )
    },
}

NESTED_KEYS: dict[str, dict[str, object]] = {
    "checkpoint.parallel_write": {"pipeline_stage": bool},
}

# Top-level keys that are comments by convention ("_comment", "//", "#note", "description"):
# DeepSpeed ignores them, so check warns instead of refusing.
COMMENT_PREFIXES = ("_", "#", "//")
COMMENT_NAMES = ("comment", "comments", "description", "note", "notes")


def is_comment(key: str) -> bool:
    return key.startswith(COMMENT_PREFIXES) or key.lower() in COMMENT_NAMES
