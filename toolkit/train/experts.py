"""Expert parallelism under DeepSpeed ZeRO: megatron-core's expert groups handed to DeepSpeed's
own MoE support, so that ZeRO partitions and averages expert gradients over the expert-data-
parallel group (the ranks holding the same experts), not over all of DP.

megatron-core tags every expert parameter `allreduce=False`; DeepSpeed's is_moe_param reads the
same tag. Untagged for DeepSpeed's groups, those parameters are silently corrupted: broadcast from
DP rank 0 at start and averaged over all of DP (feasibility probe q3_ds_moe.py). What DeepSpeed
0.19.8 needs, and what this module gives it:
  * `param.group_name` on each expert parameter, naming an entry of deepspeed.utils.groups'
    expert-parallel and expert-data-parallel registries, filled with megatron-core's groups;
  * a param group `{"moe": True, "name": ...}` holding the experts (stage_1_and_2.py:875-887:
    partitioned over the expert-DP group; :1641 reduced over it, divided by all of DP at :1688);
  * `engine.has_moe_layers` while the ZeRO optimizer is built (engine.py:2101-2107 sets it only
    for DeepSpeed's own MoE modules); the optimizer then sums each expert partition's squares
    once in the gradient norm (over DP, then TP x PP) and clips every group by that one norm.
The engine's flag is cleared afterwards: its checkpoint path for MoE (engine.py:4914,
_save_moe_checkpoint) looks for DeepSpeed MoE modules; toolkit.train.checkpoint saves the experts
of every EP rank itself.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def is_expert(param) -> bool:
    """megatron-core's tag on expert parameters (SequentialMLP / TEGroupedMLP: allreduce=False)."""
    return not getattr(param, "allreduce", True)


def group_name(ep: int) -> str:
    return f"ep_size_{ep}"  # DeepSpeed's own naming (deepspeed/moe/layer.py)


def register_expert_groups(model, ep: int) -> str | None:
    """Tag the experts and give DeepSpeed megatron-core's EP and expert-DP groups. Returns the
    group name, or None at EP 1 (experts replicated over DP, reduced like dense weights) and on a
    stage of dense layers only. A LoRA expert's A and B are expert parameters (toolkit.lora); frozen
    experts are tagged too, as DeepSpeed broadcasts them over their expert-DP group at start
    (engine.py _broadcast_model)."""
    if ep == 1:
        return None
    from deepspeed.utils import groups
    from megatron.core import parallel_state as ps

    experts = [param for param in model.parameters() if is_expert(param)]
    if not experts:  # a pipeline stage of dense layers only: its weights are reduced over all of DP
        return None
    name = group_name(ep)
    # At expert TP 1 under TP > 1 the EP group spans the TP ranks (toolkit.train.build.check_expert_layout),
    # each holding experts of its own: DeepSpeed's gradient norm counts a parameter that is not
    # TP-sharded on TP rank 0 only (stage_1_and_2.py:2682), which would leave out the other TP
    # ranks' expert biases; `model_parallel` makes it count them on every rank.
    distinct_over_tp = ps.get_expert_tensor_parallel_world_size() == 1 < ps.get_tensor_model_parallel_world_size()
    for param in experts:
        param.group_name = name
        if distinct_over_tp:
            param.model_parallel = True
    for registry, ranks, group in (
            (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS, ps.get_expert_model_parallel_group()),
            (groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS, ps.get_expert_data_parallel_group())):
        registry[name] = group
        ranks[name] = dist.get_process_group_ranks(group)
    return name


def trained_expert_group(model, name: str | None) -> str | None:
    """`name` where an expert parameter trains, else None: LoRA with the experts frozen has no expert
    in the optimizer, and DeepSpeed refuses an MoE engine without one (stage_1_and_2.py:874: "None of the param
    groups are marked as MoE")."""
    return name if any(is_expert(p) and p.requires_grad for p in model.parameters()) else None


def split_expert_group(groups: list[dict], name: str | None) -> list[dict]:
    """The experts of each param group moved into a group of their own, which DeepSpeed marks
    `moe` (same settings, e.g. weight decay)."""
    if name is None:
        return groups
    out = []
    for index, group in enumerate(groups):
        dense = [p for p in group["params"] if not is_expert(p)]
        experts = [p for p in group["params"] if is_expert(p)]
        out.append({**group, "params": dense, "name": f"dense_{index}"})
        if experts:
            out.append({**group, "params": experts, "name": name, "moe": True})
    return out


def align_group_count(groups: list[dict], pipeline_group) -> list[dict]:
    """As many param groups on every pipeline stage: DeepSpeed's ZeRO all-reduces each group's
    gradient norm over the TP x PP group (stage_1_and_2.py:2695, one call per group), so a stage
    of dense layers only (no expert groups) would wait on the others' extra calls forever. Its
    dense groups are split (a parameter moved into a group of the same settings) until it has
    as many; the global norm, a sum over groups, is unchanged."""
    device = next(p for g in groups for p in g["params"]).device  # NCCL takes the rank's GPU tensors only
    count = torch.tensor([len(groups)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=pipeline_group)
    groups = list(groups)
    while len(groups) < int(count):
        index = max(range(len(groups)), key=lambda i: 0 if groups[i].get("moe") else len(groups[i]["params"]))
        group = groups[index]
        if group.get("moe") or len(group["params"]) < 2:
            raise RuntimeError(f"cannot split the param groups {[len(g['params']) for g in groups]} into {int(count)}")
        groups[index] = {**group, "params": group["params"][:-1]}
        groups.append({**group, "params": group["params"][-1:], "name": f"{group.get('name', 'dense')}_split"})
    return groups


@contextlib.contextmanager
def moe_engine(name: str | None):
    """While DeepSpeed builds the engine: has_moe_layers set once the model is configured, so that
    the ZeRO optimizer learns the expert groups; cleared on the engine afterwards (see above)."""
    if name is None:
        yield
        return
    from deepspeed.runtime.engine import DeepSpeedEngine

    upstream = DeepSpeedEngine._configure_distributed_model

    def configure(self, model):
        upstream(self, model)
        self.has_moe_layers = True

    DeepSpeedEngine._configure_distributed_model = configure
    try:
        yield
    finally:
        DeepSpeedEngine._configure_distributed_model = upstream


def restore_experts_from_masters(module) -> None:
    """After engine.load_checkpoint: DeepSpeed's model file (DP rank 0's) holds one EP rank's experts
    and puts them on every EP rank, while its ZeRO files hold each rank's own fp32 master partitions
    (restored as they were). Copy those masters back into the experts (collective over expert-DP)."""
    from deepspeed.utils import safe_get_full_fp32_param

    for param in module.parameters():
        # a frozen expert (LoRA's base) has no master: it was loaded from its own checkpoint
        if is_expert(param) and param.requires_grad and hasattr(param, "group_name"):
            param.data.copy_(safe_get_full_fp32_param(param).to(param.dtype))
