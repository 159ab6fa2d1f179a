"""An Accelerate config (YAML) that points `accelerate launch` at a generated DeepSpeed JSON.

With `deepspeed_config_file` set, Accelerate takes ZeRO, precision, clipping and accumulation from
the JSON and refuses the same settings in the YAML (accelerate PR #941), so only the launch
topology is written here.
"""

from __future__ import annotations


def accelerate_config(deepspeed_json: str, gpus: int, nodes: int = 1, zero_stage: int = 0) -> dict:
    deepspeed = {"deepspeed_config_file": deepspeed_json, "zero3_init_flag": zero_stage == 3}
    if nodes > 1:
        deepspeed["deepspeed_multinode_launcher"] = "standard"
    return {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": deepspeed,
        "machine_rank": 0,
        "num_machines": nodes,
        "num_processes": gpus,
        "main_training_function": "main",
        "rdzv_backend": "static" if nodes == 1 else "c10d",
        "same_network": True,
        "use_cpu": False,
        "debug": False,
    }


def accelerate_yaml(deepspeed_json: str, gpus: int, nodes: int = 1, zero_stage: int = 0) -> str:
    import yaml

    return yaml.safe_dump(accelerate_config(deepspeed_json, gpus, nodes, zero_stage), sort_keys=False)
