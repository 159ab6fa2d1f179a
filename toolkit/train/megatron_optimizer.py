"""Start a fine-tune from the optimizer state of a Megatron-LM training checkpoint (model.optimizer_state).

Megatron-LM's `torch_dist` checkpoint of a model trained with megatron-core's DistributedOptimizer,
saved with `distrib_optim_sharding_type: fully_reshardable`, holds beside the model one global
tensor per parameter and state, under megatron-core's own sharding of the parameter:

    optimizer.state.param.<key>        fp32 master weight
    optimizer.state.exp_avg.<key>      Adam first moment
    optimizer.state.exp_avg_sq.<key>   Adam second moment

and, in common.pt, the param groups (Adam's betas, its step count) and the sharding type. These are
the tensors our own layout-independent state (toolkit.train.elastic) holds under other names, so
the same loader reads them: each rank reads only its TP/PP box and hands DeepSpeed its ZeRO fragment.

Other formats are refused before any process starts: `dp_reshardable` (and the deprecated bucket
formats) store DistributedOptimizer's flat per-DP-rank buffers, which only Megatron-LM at the same
TP x PP can read, and the legacy per-rank `torch` format keeps them in distrib_optim.pt per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import ConfigError, ToolkitError

STATE_PREFIX = "optimizer.state."
SHARDING_TYPE = "fully_reshardable"
# (megatron-core's state name, DeepSpeed's optimizer-state key; None = the fp32 master weight)
STATES = (("param", None), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))
OPTION = "model.optimizer_state"


@dataclass(frozen=True)
class MegatronOptimizerState:
    """A checked Megatron-LM optimizer state to start from: where its shards are, and Adam's step."""

    shards: Path  # the iteration directory (iter_NNNNNNN/ or release/)
    adam_step: int  # the step the fine-tune's Adam continues from (bias correction)


def check(path: str | Path, meta, tp: int, keep_step: bool) -> MegatronOptimizerState:
    """Everything that can be checked before any process starts: a torch_dist checkpoint whose
    DistributedOptimizer wrote Adam's state fully_reshardable, for every parameter of this very
    model (architecture and padded vocabulary at this TP), in fp32."""
    from toolkit.convert import dist_format
    from toolkit.convert.megatron_checkpoint import resolve_iteration_dir

    where = f"{OPTION}={path}"
    try:
        shards = resolve_iteration_dir(Path(path))
    except ToolkitError as e:
        raise ConfigError(f"{where}: {e}") from None
    if any(shards.glob("mp_rank_*")):
        raise ConfigError(f"{where} is Megatron-LM's legacy per-rank format (distrib_optim.pt per DP rank): the "
                          f"optimizer state is read from a torch_dist checkpoint saved {SHARDING_TYPE} only")
    if not (shards / dist_format.DCP_METADATA).is_file():
        raise ConfigError(f"{where}: {shards} holds no torch_dist checkpoint (no {dist_format.DCP_METADATA})")
    stored = dist_format.tensor_shapes(shards)
    step = _adam_step(shards, stored, where)
    model = _check_same_model(shards, stored, meta, tp, where)
    _check_states(stored, model, where)
    return MegatronOptimizerState(shards, step if keep_step else 0)


def _adam_step(shards: Path, stored: dict, where: str) -> int:
    """Megatron's Adam step, once common.pt shows a DistributedOptimizer's fully_reshardable Adam state."""
    optimizer = _common_optimizer(shards, where)
    if not any(k.startswith(STATE_PREFIX) for k in stored) and not optimizer:
        raise ConfigError(f"{where} holds no optimizer state (saved without it): start from its weights alone "
                          f"(leave {OPTION} unset)")
    sharding = optimizer.get("param_state_sharding_type")
    if sharding != SHARDING_TYPE:
        kind = f"in the {sharding!r} format" if sharding else "without megatron-core's DistributedOptimizer"
        raise ConfigError(f"{where} holds its optimizer state {kind}: only a DistributedOptimizer's "
                          f"{SHARDING_TYPE!r} state is per parameter (save with "
                          f"distrib_optim_sharding_type={SHARDING_TYPE})")
    groups = optimizer.get("optimizer", {}).get("param_groups", [])
    if not groups or any("betas" not in g for g in groups):
        raise ConfigError(f"{where}: its optimizer is not Adam (param groups without betas): only Adam's moments "
                          "can continue under this trainer's AdamW")
    steps = {int(g["step"]) for g in groups if g.get("step") is not None}
    if len(steps) != 1:
        raise ConfigError(f"{where}: its param groups hold Adam step counts {sorted(steps)}, not one")
    return steps.pop()


def _check_same_model(shards: Path, stored: dict, meta, tp: int, where: str) -> dict:
    """The stored model tensors are model.checkpoint's architecture with this run's padded
    vocabulary (the optimizer state is loaded with the parameters' global shapes); returns them."""
    from toolkit.convert import consistency
    from toolkit.convert.megatron_checkpoint import OPTIMIZER_PREFIX, VOCAB_KEYS
    from toolkit.families import family_named
    from toolkit.layouts import Layout

    spec = meta.model_spec
    model = {k: v for k, v in stored.items() if not k.startswith(OPTIMIZER_PREFIX)}
    rows = next((model[k][0][0] for k in VOCAB_KEYS if k in model), None)
    try:
        consistency.check_dist(model, family_named(spec.family), spec, Layout(1, 1, rows or 1), shards)
    except ToolkitError as e:
        raise ConfigError(f"{where} is not a checkpoint of the model in model.checkpoint: {e}") from None
    ours = Layout(tp, 1, meta.vocab_divisor).padded_vocab(spec.vocab_size)
    if rows != ours:
        raise ConfigError(f"{where} pads the vocabulary to {rows} rows, this run (TP {tp}, vocab divisor "
                          f"{meta.vocab_divisor}) to {ours}: convert model.checkpoint with a vocab divisor giving {rows}")
    return model


def _common_optimizer(shards: Path, where: str) -> dict:
    """The optimizer's non-tensor state (param groups, sharding type) from the checkpoint's common state (common.pt, or inside the DCP files from megatron-core 0.19), unpickled
    with the converter's allow-list (tensors, builtins, Megatron-LM's args)."""
    from toolkit.convert.torch_format import load_trusted_types

    from toolkit.runtime import megatron_versions

    try:
        state = megatron_versions.read_common_state(shards, lambda f: load_trusted_types(f, mmap=False))
    except ToolkitError as e:
        raise ConfigError(f"{where}: {e}") from None
    optimizer = state.get("optimizer") if isinstance(state, dict) else None
    return optimizer if isinstance(optimizer, dict) else {}


def _check_states(stored: dict, model: dict, where: str) -> None:
    import torch

    for name, _ in STATES:
        for key, (shape, _) in model.items():
            found = stored.get(f"{STATE_PREFIX}{name}.{key}")
            if found is None:
                raise ConfigError(f"{where} has no {name} for {key!r}: not Adam's complete state")
            if found[0] != shape or found[1] != torch.float32:
                raise ConfigError(f"{where} stores {name} of {key!r} as {list(found[0])} {found[1]}, expected "
                                  f"{list(shape)} torch.float32")


def load(state: MegatronOptimizerState, engine, shards) -> None:
    """Collective: this rank's fragment of every parameter's fp32 master and moments, and Adam's step."""
    from toolkit.train import elastic

    names = tuple((STATE_PREFIX + name, key) for name, key in STATES)
    elastic.load_state(state.shards, engine, shards, state.adam_step, names)
