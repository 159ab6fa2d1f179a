"""What changed in megatron-core between the releases the toolkit supports (0.16.1 through 0.19.x),
each difference handled here once, named with the release that made it.

Everywhere else the toolkit calls these functions instead of testing a version: a new release that
moves something again is one new row of CHANGES and one branch below.

    CHANGES: (release, what upstream changed, what the toolkit does about it)

Only differences that the toolkit's own code meets are here; upstream's wider changes between these
releases are in docs/design/megatron_versions.md.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import inspect
from pathlib import Path

from packaging.version import Version


CHANGES = (
    ("0.17.0", "dist_checkpointing.save() gained async_strategy, default 'nvrx': an async save imports "
     "nvidia-resiliency-ext, and fails without it (strategies/torch.py get_async_strategy)",
     "save_kwargs(): async_strategy='mcore' (megatron-core's own writer) wherever save() takes it, "
     "without the deprecation warning it then logs on every rank"),
    ("0.17.0", "extensions/transformer_engine.get_te_version() removed",
     "te_version(): Transformer Engine's own version"),
    ("0.17.0", "inference/contexts/attention_context/triton/tensor_ops.py imports triton under a guard; 0.16.1 "
     "imports it unguarded, and ssm/mamba_mixer.py imports that module: without triton (a CPU-only torch has "
     "none) 0.16.1 cannot build a Mamba layer", "mamba_mixer_module(): the module, or one line naming the fix; mamba_builds() says which"),
    ("0.17.0", "Python >= 3.12 (Requires-Python)", "pyproject allows >=3.11: pip on 3.11 resolves 0.16.1"),
    ("0.19.0", "torch_dist stores the non-tensor state as a ShardedObject 'common_state' inside the DCP "
     "files instead of common.pt (serialization.py save; load_common_state_dict reads both)",
     "common_state_in_dcp(): the converter writes the installed release's layout; read_common_state() reads "
     "both; reading_both_common_layouts() lets an older release load the new layout"),
    ("0.18.0", "GatedDeltaNet's depthwise conv calls fla's causal_conv1d (its torch path only under deterministic_mode)",
     "the toolkit's torch causal_conv1d stands in where fla is missing (gated_delta_net_modules)"),
    ("0.18.0", "MambaModel / MambaStack (models/mamba, ssm/mamba_block.py) renamed HybridModel / HybridStack "
     "(models/hybrid; the old names kept as re-exports, MambaModel taking mamba_stack_spec as hybrid_stack_spec), "
     "its layer pattern argument hybrid_override_pattern renamed hybrid_layer_pattern (the old one deprecated)",
     "hybrid_model_class(), hybrid_stack_classes(): the classes and the argument names of the installed release"),
    ("0.19.0", "MambaMixer's depthwise conv became two parameters, conv1d_weight and conv1d_bias, instead of an nn.Conv1d "
     "`conv1d` (its torch_dist keys stay conv1d.weight / conv1d.bias: mamba_mixer.py conv_checkpoint_key_map)",
     "mamba_conv_names(): the names in the module's state_dict (the torch format) of the installed release"),
    ("0.19.0", "ssm/gated_delta_net.py became a package: the fla names live in gated_delta_net/common.py and are "
     "imported by name into gated_delta_net/gdn.py", "gated_delta_net_modules(): every module that holds them"),
    ("0.19.0", "GatedDeltaNet computes g and beta in a method of its own, _compute_g_and_beta "
     "(gated_delta_net/common.py:433-446; 0.16.1 inside forward, gated_delta_net.py:365-366; 0.17, 0.18 not read)",
     "gdn_beta_in_method(): OLMo-Hybrid's scaled beta overrides the method, else scales the beta forward passes "
     "to the kernels (toolkit/blocks/mixer_gated_delta_net.py)"),
    ("0.19.0", "DSAIndexer rotates the first qk_pos_emb_head_dim dimensions of its q and k (x_pe first, as DeepSeek's "
     "and HF's indexer; 0.16.1-0.18 rotate the last ones, dsa.py _apply_rope) and takes dsa_indexer_rotate_activation, "
     "dsa_indexer_rope_interleaved, dsa_indexer_scoring_relu, dsa_indexer_k_norm_epsilon (0.16.1-0.18 always apply the "
     "Hadamard rotation, bf16 with fast_hadamard_transform only, and k_norm takes layernorm_epsilon)",
     "require_exact_dsa(): DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) refused in one line before 0.19"),
    ("0.19.0", "the MoE aux-loss tracker became moe_logging.MoEMetricsTracker, sized by the first model's layers, "
     "whose clear() only zeroes", "reset_moe_metrics(): between models of different depths in one process"),
    ("0.19.0", "MLA refuses a q_layernorm in the spec where q_lora_rank is None (mla_qk_norm_config.py:259)",
     "none is put there on any release: toolkit/blocks/attention_mla.with_mla_core_attention(full_rank_query)"),
    ("0.19.0", "MLA with qk_layernorm and a full-rank query takes only the backend's fused norm + linear for "
     "linear_q_proj (mla_qk_norm_config.py:147-150), which the local spec lacks",
     "mla_qk_norm_resolver(): toolkit/blocks/attention_mla.buildable_mla resolves it to the spec's plain linear"),
    ("0.19.0", "GPTModel deprecated in favour of HybridModel (a warning at every construction)",
     "GPTModel kept for the transformer families while it is supported (RELEASE_NOTICES; docs/megatron_versions.md)"),
    ("0.19.0", "get_default_save_sharded_strategy() lost its version argument",
     "not called: the toolkit builds TorchDistSaveShardedStrategy itself"),
    ("0.19.2", "ColumnParallelLinear / RowParallelLinear pass gtp_remat_size to _forward_impl (1 unless a "
     "gtp_remat process group shards the weight further; read in 0.19.2, absent in 0.16.1)",
     "check_linear_forward_arguments(): toolkit/fp8/local.py's FP8 forward takes it at 1 and refuses "
     "another value, or an argument no supported release passes"),
)

# Transformer Engine releases each megatron-core series was built and tested with: 0.16.1's `dev`
# extra (transformer-engine>=2.9,<2.12); later series dropped the bound, so theirs are the NGC
# containers that ship them (NeMo 26.04: TE 2.14 with 0.17.0; NeMo 26.06: TE 2.16 with 0.18.0; 0.19 is
# tested on NGC 26.06). (lowest, first unsupported)
TE_RANGES = {
    (0, 16): (Version("2.9"), Version("2.12")),
    (0, 17): (Version("2.9"), Version("2.15")),
    (0, 18): (Version("2.9"), Version("2.17")),
    (0, 19): (Version("2.9"), Version("2.17")),
}

COMMON_PT = "common.pt"  # the legacy layout's file (megatron-core <= 0.18 writes it)
COMMON_STATE_KEY = "common_state/shard_0_1"  # ShardedObject("common_state", None, (1,), (0,)).unique_key


@functools.cache
def installed() -> Version:
    from megatron.core import package_info

    return Version(package_info.__version__)


def series() -> tuple[int, int]:
    v = installed()
    return v.major, v.minor


def save_kwargs() -> dict:
    """Keyword arguments for dist_checkpointing.save that keep the save on megatron-core's own writer."""
    from megatron.core import dist_checkpointing

    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:  # 0.17.0
        quiet_release_notices()
        return {"async_strategy": "mcore"}
    return {}


# Deprecation notices of choices the toolkit makes on purpose, logged on every rank: (logger, text).
RELEASE_NOTICES = (
    # 0.17.0: megatron-core's own async writer, in favour of NVRx's (an optional package clusters may lack)
    ("megatron.core.dist_checkpointing.strategies.torch", "MCore's async save is deprecated"),
    # 0.19.0: GPTModel, in favour of HybridModel (docs/megatron_versions.md says what moving would take)
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
)


@functools.cache
def quiet_release_notices() -> None:
    import logging

    for name, text in RELEASE_NOTICES:
        logging.getLogger(name).addFilter(lambda record, text=text: text not in record.getMessage())


def mamba_conv_names() -> tuple[str, str]:
    """MambaMixer's conv weight and bias as its state_dict names them (relative to the mixer)."""
    if installed() >= Version("0.19.0"):
        return "conv1d_weight", "conv1d_bias"
    return "conv1d.weight", "conv1d.bias"


def mamba_mixer_module():
    """megatron-core's ssm/mamba_mixer.py, imported where a Mamba layer is built (see CHANGES, 0.17.0: on 0.16.1
    it needs triton)."""
    from toolkit.errors import ToolkitError

    try:
        from megatron.core.ssm import mamba_mixer
    except ModuleNotFoundError as err:
        if err.name != "triton":
            raise
        raise ToolkitError(
            f"megatron-core {installed()}'s Mamba mixer imports triton, which is not installed (a CPU-only torch "
            "has none; inference/contexts/attention_context/triton/tensor_ops.py): pip install triton, or use "
            "megatron-core >= 0.17, which imports it only where it is there") from None
    return mamba_mixer


def mamba_builds() -> bool:
    """Whether megatron-core's Mamba mixer imports here: 0.16.1 needs triton for it (see CHANGES, 0.17.0)."""
    import importlib.util

    return installed() >= Version("0.17.0") or importlib.util.find_spec("triton") is not None


def exact_dsa() -> bool:
    """Whether the installed megatron-core computes DeepSeek Sparse Attention as HF does (see CHANGES, 0.19.0)."""
    return installed() >= Version("0.19.0")


def require_exact_dsa() -> None:
    """DeepSeek Sparse Attention as HF computes it needs megatron-core 0.19's DSAIndexer (see CHANGES, 0.19.0)."""
    from toolkit.errors import ConversionError

    if not exact_dsa():
        raise ConversionError(f"DeepSeek Sparse Attention (index_topk) cannot be computed as HF does on megatron-core "
                              f"{installed()}: its indexer rotates the other end of q and k and always applies the "
                              "Hadamard rotation (experimental_attention_variant/dsa.py); use megatron-core >= 0.19")


def hybrid_model_class():
    """(megatron-core's hybrid Mamba / attention / MLP model class, the keywords its stack spec and its layer
    pattern are passed by)."""
    if installed() >= Version("0.18.0"):
        from megatron.core.models.hybrid.hybrid_model import HybridModel

        return HybridModel, "hybrid_stack_spec", "hybrid_layer_pattern"
    from megatron.core.models.mamba.mamba_model import MambaModel

    return MambaModel, "mamba_stack_spec", "hybrid_override_pattern"


def hybrid_stack_classes():
    """(megatron-core's hybrid layer stack, its submodules dataclass)."""
    if installed() >= Version("0.18.0"):
        from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules

        return HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules

    return MambaStack, MambaStackSubmodules


def gated_delta_net_modules() -> tuple[str, ...]:
    """The modules that hold GatedDeltaNet's fla kernels by name (the one with HAVE_FLA first)."""
    if installed() >= Version("0.19.0"):
        return ("megatron.core.ssm.gated_delta_net.common", "megatron.core.ssm.gated_delta_net.gdn")
    return ("megatron.core.ssm.gated_delta_net",)


def gdn_beta_in_method() -> bool:
    """GatedDeltaNet computes beta in _compute_g_and_beta (else inside forward)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    return hasattr(GatedDeltaNet, "_compute_g_and_beta")


def reset_moe_metrics() -> None:
    """Forget megatron-core's per-layer MoE metrics (sized by the first MoE model built in the process)."""
    if installed() >= Version("0.19.0"):
        from megatron.core.transformer.moe import moe_logging

        moe_logging.destroy_moe_metrics_tracker()
        return
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()


def mla_qk_norm_resolver():
    """0.19.0's resolver of MLA's norms and projections (None before it)."""
    if installed() < Version("0.19.0"):
        return None
    from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver

    return QKNormConfigResolver


# Keyword arguments megatron-core's linears pass to _forward_impl beyond 0.16.1's, with the value under
# which the toolkit's FP8 forward (toolkit/fp8/local.py) computes what megatron-core's would.
LINEAR_FORWARD_LATER = {"gtp_remat_size": 1}  # 0.19.2


def check_linear_forward_arguments(later: dict) -> None:
    """Refuse a linear's _forward_impl argument that the FP8 forward would silently ignore."""
    from toolkit.errors import ConfigError

    for name, value in later.items():
        if name not in LINEAR_FORWARD_LATER:
            raise ConfigError(f"megatron-core {installed()} passes {name}={value!r} to a linear's _forward_impl, "
                                      "which toolkit/fp8/local.py does not know: it would compute another GEMM")
        if value != LINEAR_FORWARD_LATER[name]:
            raise ConfigError(f"{name}={value!r} (megatron-core {installed()}): the FP8 forward on the local "
                                      f"spec takes {name}={LINEAR_FORWARD_LATER[name]} only")


def te_version() -> Version | None:
    """Transformer Engine's version, or None where it is not installed."""
    for name in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            return Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        import transformer_engine

        return Version(transformer_engine.__version__)
    except Exception:  # noqa: BLE001 - not installed, or a build that does not import
        return None


def te_supported(version: Version) -> tuple[bool, str]:
    """Whether the installed megatron-core supports this Transformer Engine, and a line that says so."""
    low, high = TE_RANGES.get(series(), TE_RANGES[max(TE_RANGES)])
    plain = Version(version.base_version)
    ok = low <= plain < high
    return ok, (f"Transformer Engine {version} with megatron-core {installed()} "
                f"(which supports TE >= {low}, < {high})")


def common_state_in_dcp() -> bool:
    """Whether the installed release keeps torch_dist's non-tensor state inside the DCP files (0.19.0)."""
    return installed() >= Version("0.19.0")


def has_legacy_common(directory: Path) -> bool:
    return (Path(directory) / COMMON_PT).is_file()


def read_common_state(directory: Path, load_pt) -> dict:
    """A torch_dist checkpoint's non-tensor state in either layout. `load_pt(path_or_buffer)` unpickles
    with the caller's allow-list (never an unrestricted pickle)."""
    import io

    directory = Path(directory)
    if has_legacy_common(directory):
        return load_pt(directory / COMMON_PT)
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    class RawBytes(DefaultLoadPlanner):  # DCP's own load_bytes unpickles with weights_only=False
        def load_bytes(self, read_item, value):
            self.state_dict[read_item.dest_index.fqn] = io.BytesIO(value.read())

    reader = FileSystemReader(str(directory))
    if COMMON_STATE_KEY not in reader.read_metadata().state_dict_metadata:
        return {}
    planner = RawBytes()
    dcp_load({COMMON_STATE_KEY: io.BytesIO()}, storage_reader=reader, planner=planner, no_dist=True)
    loaded = planner.state_dict[COMMON_STATE_KEY]
    loaded.seek(0)
    return load_pt(loaded)[0]  # megatron-core saves [data] of the one ShardedObject


@contextlib.contextmanager
def reading_both_common_layouts():
    """Around dist_checkpointing.load: a release before 0.19.0 also reads a checkpoint that keeps its
    common state inside the DCP files (one written by 0.19). Its own reader of common.pt is replaced
    for the call only: 0.16.1's TorchCommonLoadStrategy.load_common (strategies/common.py:74, chosen by
    serialization.verify_checkpoint_and_load_strategy), 0.17-0.18's module function load_common,
    imported by name into serialization.py:32. 0.19.0 reads both layouts itself."""
    if common_state_in_dcp():
        yield
        return
    import torch
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import common

    def load_either(checkpoint_dir, original):
        if has_legacy_common(checkpoint_dir):
            return original(checkpoint_dir)
        return read_common_state(checkpoint_dir, lambda f: torch.load(f, map_location="cpu", weights_only=True))

    if hasattr(serialization, "load_common"):  # 0.17.0, 0.18.0
        original = serialization.load_common
        serialization.load_common = lambda d: load_either(d, original)
        try:
            yield
        finally:
            serialization.load_common = original
        return
    original = common.TorchCommonLoadStrategy.load_common  # 0.16.1
    common.TorchCommonLoadStrategy.load_common = lambda self, d: load_either(d, lambda c: original(self, c))
    try:
        yield
    finally:
        common.TorchCommonLoadStrategy.load_common = original


def dist_load(sharded_state_dict: dict, directory: str | Path, **kwargs) -> dict:
    """dist_checkpointing.load of a checkpoint in either common-state layout, on any supported release."""
    from megatron.core import dist_checkpointing

    with reading_both_common_layouts():
        return dist_checkpointing.load(sharded_state_dict, str(directory), **kwargs)


def common_layout(directory: Path) -> str | None:
    """How a torch_dist directory keeps its non-tensor state, in words; None if not torch_dist."""
    directory = Path(directory)
    if not (directory / "metadata.json").is_file():
        return None
    if has_legacy_common(directory):
        return "common.pt (megatron-core <= 0.18; every supported release loads it)"
    return "common_state inside the DCP files (megatron-core >= 0.19; the toolkit loads it on every supported release)"
