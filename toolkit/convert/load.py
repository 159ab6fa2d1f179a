"""Load a checkpoint written by `toolkit convert hf-to-megatron` (or a fine-tune's model) into a
megatron-core model already built for this process's TP/PP rank (see toolkit.model).

torch_dist loads into any TP/PP layout through megatron-core's own loader; per-rank torch files
written for another layout are merged and re-split in memory (this stage's tensors only). Both
layer specs read the same checkpoints: torch_dist through megatron-core's sharded keys, per-rank
`torch` files through our name mapping.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable

import torch

from toolkit.convert import naming, torch_format
from toolkit.convert.megatron_checkpoint import MegatronCheckpoint, resolve_iteration_dir
from toolkit.convert.metadata import CheckpointMeta, verify_file
from toolkit.convert.stages import TensorSource, stage_hf_names, stage_tensors
from toolkit.errors import ConversionError
from toolkit.families import BUFFERS
from toolkit.layouts import Layout


def load_converted(model, checkpoint_dir: str | Path, check_sums: bool = True,
                   meta: CheckpointMeta | None = None) -> CheckpointMeta:
    """Load the checkpoint at `checkpoint_dir` into `model` (parallel_state must be initialised), or
    into each of a list of model chunks (virtual pipeline stages, each with its `vp_stage`).
    `meta`: its metadata, when the caller has read and checked it already (a training run has).

    `check_sums=False` is for `verify`, which reports mismatching files itself and still
    compares the logits (to name the first divergent layer).
    """
    root = Path(checkpoint_dir)
    meta = meta or CheckpointMeta.read(root)
    shards = resolve_iteration_dir(root)
    chunks = model if isinstance(model, list) else [model]
    if meta.format == "torch_dist":
        load_dist(chunks, shards)  # one collective read for every chunk: megatron-core checks the coverage
        return meta
    opened = functools.cache(functools.partial(MegatronCheckpoint.open, root))  # another layout: once for every chunk
    for chunk in chunks:
        _load_rank_files(chunk, root, meta, shards, check_sums, opened)
    return meta


def _load_rank_files(model, root: Path, meta: CheckpointMeta, shards: Path, check_sums: bool,
                     opened: Callable[[], MegatronCheckpoint]) -> None:
    from megatron.core import parallel_state as ps
    # A dense model has no expert ranks: EP ranks, if any, are data-parallel ones holding the same files
    moe = meta.model_spec.is_moe
    tp, ep = ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size() if moe else 1
    pp, pp_rank = pipeline_stage(model)
    ranks = (ps.get_tensor_model_parallel_rank(), pp_rank, ps.get_expert_model_parallel_rank() if moe else 0)
    if (tp, pp, ep) == (meta.tp, meta.pp, meta.ep):
        path = torch_format.rank_file(shards, meta.layout, *ranks)
        if check_sums and meta.checksums:  # Megatron-LM's own checkpoints carry none
            verify_file(root, path, meta.checksums)  # before unpickling anything from it
        state = torch_format.model_entry(torch_format.load_trusted_types(path), path)
    else:
        state = dict(_reshard(opened(), Layout(tp, pp, meta.vocab_divisor, ep), *ranks))
    load_state_by_name(model, state)


def pipeline_stage(model) -> tuple[int, int]:
    """(stages, this model's stage) of the plain pipeline whose stages hold the same layers: with
    virtual stages (interleaved 1F1B), chunk v of pipeline rank r is stage v x PP + r of PP x VPP."""
    from megatron.core import parallel_state as ps

    pp, rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    vp_stage = getattr(model, "vp_stage", None)
    if vp_stage is None:
        return pp, rank
    return pp * ps.get_virtual_pipeline_model_parallel_world_size(), vp_stage * pp + rank


def _reshard(ckpt: MegatronCheckpoint, layout: Layout, tp_rank: int, pp_rank: int, ep_rank: int):
    """This rank's shard of a per-rank checkpoint written for another layout: merge the HF
    tensors this stage (and EP rank) needs from the stored shards, then split them for the new layout."""
    wanted = stage_hf_names(ckpt.family, ckpt.spec, layout, pp_rank, ep_rank)
    source = TensorSource(dict(ckpt.hf_tensors(wanted)))
    return stage_tensors(source, ckpt.family, ckpt.spec, layout, tp_rank, pp_rank, ep_rank=ep_rank)


def load_state_by_name(model, state: dict) -> None:
    """load_state_dict that accepts either TE or local names and ignores `_extra_state`."""
    names = model.state_dict().keys()
    target_spec = naming.detect_layer_spec(names)
    moe = naming.router_layers(names)
    dtype = next(model.parameters()).dtype
    renamed = {  # the float32 expert bias as stored: megatron-core keeps it in float32 (router.py)
        naming.to_spec_name(naming.to_canonical(k), target_spec, naming.split_layer(k)[0] in moe):
            v if k.endswith(BUFFERS) else v.to(dtype)
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    }
    missing, unexpected = model.load_state_dict(renamed, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ConversionError(f"checkpoint does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")


def load_dist(chunks: list, shards: Path) -> None:
    """megatron-core's own loader, for every model chunk at once (Megatron-LM's nesting: model0,
    model1, ...). `args` in common.pt is an argparse.Namespace, so it is allowed explicitly for
    weights_only unpickling."""
    from toolkit.runtime import megatron_versions

    wanted = {f"model{v}": chunk.sharded_state_dict() for v, chunk in enumerate(chunks)}
    with torch.serialization.safe_globals(torch_format.SAFE_GLOBALS):
        loaded = megatron_versions.dist_load(wanted, shards)
    for chunk, key in zip(chunks, wanted):
        missing, unexpected = chunk.load_state_dict(loaded[key], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ConversionError(f"torch_dist checkpoint does not match the model: missing {missing[:3]}, "
                                  f"unexpected {unexpected[:3]}")
