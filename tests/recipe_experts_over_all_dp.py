"""The fine-tuning recipe with a deliberate fault, for the MoE guard test: DeepSpeed is handed all
of DP as the experts' data-parallel group (the wrong group), so the experts' gradients are averaged
with another EP rank's experts. ZeRO then partitions each expert over ranks that hold different
experts, so no consistent global state exists to write (megatron-core's sharding check refuses
it): the layout-independent train/ state is left out too; the guard needs only model/ and the
export. Patched here, in the worker, so the product has no test switch for it."""

import runpy
from pathlib import Path

from deepspeed.utils import groups
from megatron.core import parallel_state as ps
import torch.distributed as dist

from toolkit.train import elastic, experts

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "finetune.py"


def register_over_all_dp(model, ep: int):
    name = register_expert_groups(model, ep)
    if name is not None:
        groups._EXPERT_DATA_PARALLEL_GROUP[name] = ps.get_data_parallel_group()
        groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = dist.get_process_group_ranks(ps.get_data_parallel_group())
    return name


if __name__ == "__main__":
    register_expert_groups = experts.register_expert_groups
    experts.register_expert_groups = register_over_all_dp
    elastic.save_state = lambda *args, **kwargs: None
    runpy.run_path(str(RECIPE), run_name="__main__")
