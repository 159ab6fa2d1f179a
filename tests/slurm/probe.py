"""Stand-in for recipes/finetune.py in the Slurm tests, launched by the same rendered script.

Each rank records what reached it (argv, environment, node, restart) as JSON in $PROBE_OUT.
PROBE_ALLREDUCE=1 also joins the torchrun group (gloo, or PROBE_BACKEND=nccl) and all-reduces rank + 1.
PROBE_WAIT_USR1=SECONDS waits for SIGUSR1 like the trainer and then exits 99 (0 on timeout).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

out = Path(os.environ["PROBE_OUT"])
rank = int(os.environ["RANK"])
restart = os.environ.get("SLURM_RESTART_COUNT", "0")
got = []
signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
record = {
    "argv": sys.argv[1:],
    "rank": rank,
    "world_size": int(os.environ["WORLD_SIZE"]),
    "local_rank": int(os.environ["LOCAL_RANK"]),
    "node": os.environ.get("SLURMD_NODENAME"),
    "node_id": os.environ.get("SLURM_NODEID"),
    "restart": restart,
    "env": {k: v for k, v in os.environ.items()
            if k.startswith(("PROBE_", "HF_", "WANDB_", "OMP_", "TOOLKIT_", "MASTER_", "NCCL_", "TORCH_NCCL_",
                             "CUDA_DEVICE_"))},
}
if os.environ.get("PROBE_ALLREDUCE"):
    import torch
    import torch.distributed as dist

    backend = os.environ.get("PROBE_BACKEND", "gloo")
    device = "cpu"
    if backend == "nccl":
        device = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    value = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(value)
    record["allreduce"] = value.item()
    dist.destroy_process_group()
(out / f"restart{restart}-rank{rank}.json").write_text(json.dumps(record))
if os.environ.get("PROBE_WAIT_USR1"):
    deadline = time.monotonic() + float(os.environ["PROBE_WAIT_USR1"])
    (out / f"ready-restart{restart}-rank{rank}").touch()
    while not got and time.monotonic() < deadline:
        time.sleep(0.1)
    sys.exit(99 if got else 0)
