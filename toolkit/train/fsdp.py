"""PyTorch FSDP2 (`fully_shard`) as the data-parallel engine: the native alternative to ZeRO-3.

    parallel.dp_engine=fsdp      (PP = 1; TP from megatron-core)

megatron-core's tensor-parallel layers hold plain tensors, a different TP shard on each TP rank;
FSDP2 shards each of them further over the data-parallel group alone (a 1-D DeviceMesh built
from megatron-core's DP group), so a parameter is a DTensor over DP whose local data is a 1/DP
row-slice of this TP rank's shard. FSDP gathers the bf16 (or fp32) parameters for each layer's
forward and backward and reduce-scatters the gradients in fp32, averaged over DP as ZeRO does,
after every micro-batch's backward into the sharded gradient (as ZeRO-3: no rank ever holds
the whole gradient; FSDP's no-sync accumulation would keep it whole, in fp32, until the last).

What FSDP does not know of, done here (as the DeepSpeed path does in toolkit.train.parallel):
  - gradients megatron-core leaves partial over TP (sequence-parallel norms, q/k norms) are
    summed over TP after FSDP's reduce-scatter (linear: the order of the two sums is free);
  - the gradient norm counts every TP-sharded parameter on every TP rank but a TP-replicated
    one on TP rank 0 only (megatron's param_is_not_tensor_parallel_duplicate), summed over
    TP x DP. torch's clip_grad_norm_ on the DTensors reduces over their DP mesh only: each TP
    rank would clip by the norm of its own shard (tests/test_fsdp.py, the guard).

The optimizer is torch's AdamW over the sharded fp32 parameters, with the DeepSpeed path's
hyper-parameters and parameter groups; the LR schedule is the same LambdaLR. Checkpoints go
through torch.distributed.checkpoint: each TP rank's DP group writes its own directory
(fsdp/tp_XX/), resumable on the same layout.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from toolkit.errors import ToolkitError

FSDP_DIR = "fsdp"  # in a checkpoint step directory, beside model/ and ranks/
SCHEDULER_FILE = "lr_scheduler.pt"


class FsdpError(ToolkitError):
    """FSDP cannot train or checkpoint this run."""


def mixed_precision(precision: str):
    """bf16 parameters in forward/backward, fp32 master weights and gradient reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard(model, precision: str) -> None:
    """fully_shard each transformer layer, then the root (embedding, final norm, output layer),
    over megatron-core's DP group. The model must hold fp32 parameters (the masters)."""
    from megatron.core import parallel_state as ps
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = DeviceMesh.from_group(ps.get_data_parallel_group(), device)
    policy = mixed_precision(precision)
    for layer in model.decoder.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


class TensorParallelGrads:
    """Which parameters' gradients need a TP sum, and which count in the norm on this TP rank,
    read from megatron-core's parameter attributes before fully_shard swaps in DTensor parameters."""

    def __init__(self, model):
        from megatron.core import parallel_state as ps

        from toolkit.train.parallel import partial_over_tp

        self.tp = ps.get_tensor_model_parallel_world_size()
        self.group = ps.get_tensor_model_parallel_group()
        tp_rank = ps.get_tensor_model_parallel_rank()
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.partial = {name for name, p in named if self.tp > 1 and partial_over_tp(model.config, name, p)}
        self.counted = {name for name, p in named if getattr(p, "tensor_model_parallel", False) or tp_rank == 0}

    def sum_partial(self, model) -> None:
        for name, param in model.named_parameters():
            if name in self.partial and param.grad is not None:
                dist.all_reduce(param.grad.to_local(), group=self.group)

    def norm(self, model) -> torch.Tensor:
        """The global L2 norm of the gradients: each element of the TP x DP model counted once."""
        squares = torch.zeros((), dtype=torch.float64, device=_device())
        for name, param in model.named_parameters():
            if name in self.counted and param.grad is not None:
                squares += param.grad.to_local().double().pow(2).sum()
        dist.all_reduce(squares)  # PP = 1: the world is TP x DP
        return squares.sqrt()


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class FsdpEngine:
    """The part of DeepSpeed's engine surface the recipe uses (call, step, get_lr,
    get_global_grad_norm, optimizer, lr_scheduler, save/load_checkpoint), over FSDP2."""

    def __init__(self, model, tp_grads: TensorParallelGrads, optimizer, lr_scheduler, clip_grad: float):
        self.module, self.tp_grads = model, tp_grads
        self.optimizer, self.lr_scheduler, self.clip_grad = optimizer, lr_scheduler, clip_grad
        self._norm = None

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def step(self) -> None:
        self.tp_grads.sum_partial(self.module)
        norm = self.tp_grads.norm(self.module)
        self._norm = float(norm)
        if self.clip_grad > 0:
            coefficient = torch.clamp(self.clip_grad / (norm + 1e-6), max=1.0)  # as torch's clip_grad_norm_
            for param in self.module.parameters():
                if param.grad is not None:
                    param.grad.to_local().mul_(coefficient.to(param.grad.dtype))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()

    def get_global_grad_norm(self) -> float | None:
        return self._norm

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def adam_step(self) -> int:
        steps = {int(state["step"]) for state in self.optimizer.state.values() if "step" in state}
        return steps.pop() if len(steps) == 1 else 0

    def master_weights(self) -> dict:
        """The whole fp32 TP shard of every parameter on every rank (an all-gather over DP each)."""
        return {param: param.full_tensor().detach().float().cpu().clone() for param in self.module.parameters()}

    def save_checkpoint(self, save_dir: str, **_ignored) -> None:
        """Collective: model and optimizer through torch.distributed.checkpoint, one directory per TP
        rank written by its DP group; the LR scheduler (the same on every rank) by rank 0."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.module, self.optimizer)
        directory = Path(save_dir) / FSDP_DIR
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(_tp_dir(directory)),
                 process_group=_dp_group())
        if dist.get_rank() == 0:
            torch.save(self.lr_scheduler.state_dict(), directory / SCHEDULER_FILE)

    def load_checkpoint(self, load_dir: str, **_ignored):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        directory = Path(load_dir) / FSDP_DIR
        if not (directory / SCHEDULER_FILE).is_file():
            raise FsdpError(f"{load_dir} holds no FSDP state ({directory}): it was not written with parallel.dp_engine=fsdp")
        model_state, optim_state = get_state_dict(self.module, self.optimizer)  # creates AdamW's state to load into
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(_tp_dir(directory)), process_group=_dp_group())
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.lr_scheduler.load_state_dict(torch.load(directory / SCHEDULER_FILE, weights_only=False))
        return load_dir, {}


def _dp_group():
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group()


def _tp_dir(directory: Path) -> Path:
    from megatron.core import parallel_state as ps

    return directory / f"tp_{ps.get_tensor_model_parallel_rank():02d}"


def build_engine(model, cfg, schedule) -> FsdpEngine:
    """Shard the model and build torch's AdamW and the LR schedule over the sharded parameters."""
    from toolkit.train.parallel import param_groups

    tp_grads = TensorParallelGrads(model)
    shard(model, cfg.precision)
    o = cfg.optim
    optimizer = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return FsdpEngine(model, tp_grads, optimizer, lr_scheduler, o.clip_grad)
