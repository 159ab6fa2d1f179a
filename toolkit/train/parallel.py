"""Where the two frameworks meet. megatron-core owns the tensor-parallel layers and the pipeline
schedule; DeepSpeed owns data parallelism (ZeRO), mixed precision, the optimizer step and the
checkpoint files. This module builds both and does the gradient work DeepSpeed doesn't know of.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from toolkit.train.config import TrainConfig
from toolkit.train.virtual import chunks


class MegatronCoreMPU:
    """The Megatron-LM `mpu` surface DeepSpeed calls, over megatron.core.parallel_state
    (megatron-core removed get_model_parallel_rank/world_size, which DeepSpeed needs).

    "Model parallel" for DeepSpeed = every rank holding a distinct shard (TP x PP), which gives
    one mp_rank_XX checkpoint file per shard."""

    def __getattr__(self, name):
        from megatron.core import parallel_state

        return getattr(parallel_state, name)

    @staticmethod
    def get_model_parallel_group():
        from megatron.core import parallel_state as ps

        return ps.get_model_parallel_group()

    # DeepSpeed averages gradients and partitions ZeRO states over its "data parallel" group: under
    # context parallelism that is DP x CP (each CP rank's gradient is its chunks' part; the loss is
    # scaled by CP in megatron-core's schedule, so the average over DP x CP is the sum over CP).
    # Without CP, megatron-core's DP group itself, as before.
    @staticmethod
    def _with_cp() -> dict:
        from megatron.core import parallel_state as ps

        return {"with_context_parallel": ps.get_context_parallel_world_size() > 1}

    def get_data_parallel_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group(**self._with_cp())

    def get_data_parallel_world_size(self):
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_world_size(**self._with_cp())

    def get_data_parallel_rank(self):
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank(**self._with_cp())

    def get_model_parallel_rank(self):
        return dist.get_rank(group=self.get_model_parallel_group())

    def get_model_parallel_world_size(self):
        return dist.get_world_size(group=self.get_model_parallel_group())


def param_groups(model, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: never on norms or biases (1-D parameters)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def mark_tied_output_replica(model, tied: bool) -> None:
    """With tied embeddings and PP > 1 the last stage's output layer is a copy of the first
    stage's embedding: tell DeepSpeed's grad-norm code to count it once (ds_pipe_replicated is
    how DeepSpeed's own PipelineModule marks tied copies)."""
    from megatron.core import parallel_state as ps

    if not tied or ps.get_pipeline_model_parallel_world_size() == 1:
        return
    for chunk in chunks(model):
        if chunk.post_process and not chunk.pre_process:
            chunk.output_layer.weight.ds_pipe_replicated = True


def allreduce_tied_embedding_grads(model, tied: bool) -> None:
    """megatron's finalize_model_grads sums the grads of the two tied copies over the embedding
    group; DeepSpeed never does, and without it the copies silently drift apart. The copies are
    on the chunk holding the embedding (first stage) and the one holding the output layer (last)."""
    from megatron.core import parallel_state as ps

    if not tied or ps.get_pipeline_model_parallel_world_size() == 1:
        return
    for chunk in chunks(model):
        weight = chunk.shared_embedding_or_output_weight()  # the embedding, the output layer, or None
        if weight is None or not weight.requires_grad:
            continue
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(weight.grad, group=ps.get_embedding_group())


# The gated delta net's output norm (Qwen3-Next, Qwen3.5, OLMo-Hybrid: toolkit/blocks/mixer_gated_delta_net.py)
GDN_OUT_NORM = "self_attention.out_norm."


def partial_over_tp(config, name: str, param) -> bool:
    """Replicated over TP, but each TP rank computes only part of its gradient: megatron's
    finalize_model_grads sums these over TP (_allreduce_non_tensor_model_parallel_grads, the same
    rule). Under sequence parallelism each rank normalises its own tokens (norms, tagged
    `sequence_parallel`); q/k norms see each rank's own heads, and so does a gated delta net's output norm
    (GatedDeltaNet.out_norm, one weight of head_v_dim over this rank's value heads; megatron-core tags it for no
    such sum: without it the TP copies drifted, Qwen3.5's TP2 x PP2 fine-tune 4.7e-6 off HF, 9.6e-7 with it). Routed experts' biases carry the
    tag too (megatron-core's expert MLPs are built with the model's config) but are no such part:
    at expert TP = TP every TP rank computes its shard from the same dispatched tokens, and at
    expert TP 1 (gpt-oss) each TP rank holds other experts, whose biases a sum would mix."""
    if ".mlp.experts." in name:
        return False
    return (config.sequence_parallel and getattr(param, "sequence_parallel", False)) or (
        config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)) or GDN_OUT_NORM in name


def sum_partial_grads_over_tp(model) -> list[str]:
    """DeepSpeed never sums the gradients above over TP, and without it the TP copies silently
    drift apart. A hook sums every micro-batch's part as backward computes it, before DeepSpeed's
    ZeRO hooks take the gradient (at ZeRO-2/3 no .grad is left by the step). Returns the names."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1:
        return []
    group = ps.get_tensor_model_parallel_group()
    summed = [(name, param) for name, param in model.named_parameters()
              if param.requires_grad and partial_over_tp(model.config, name, param)]
    for _, param in summed:
        param.register_hook(lambda grad: _summed(grad, group))
    return [name for name, _ in summed]


def _summed(grad: torch.Tensor, group) -> torch.Tensor:
    total = grad.clone()
    dist.all_reduce(total, group=group)
    return total


def build_engine(model, cfg: TrainConfig, ds_config: dict, schedule):
    """DeepSpeed engine with our param groups and LR schedule (toolkit.train.schedule); DeepSpeed
    steps the scheduler in engine.step() and keeps its state, the schedule's too, in checkpoints."""
    import deepspeed

    from toolkit.runtime.cpu_compat import allow_deepspeed_fp16, skip_deepspeed_shm_op
    from toolkit.train import experts

    if not torch.cuda.is_available():
        skip_deepspeed_shm_op()
        allow_deepspeed_fp16()
    expert_group = experts.trained_expert_group(model, experts.register_expert_groups(model, cfg.parallel.ep))
    groups = experts.split_expert_group(param_groups(model, cfg.optim.weight_decay), expert_group)
    if cfg.parallel.ep > 1 and cfg.parallel.pp > 1:
        from megatron.core import parallel_state as ps

        groups = experts.align_group_count(groups, ps.get_pipeline_model_parallel_group())
    with experts.moe_engine(expert_group):
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=groups,
            config=ds_config,
            mpu=MegatronCoreMPU(),
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
        )
    engine.has_moe_layers = False  # the optimizer keeps its expert groups; checkpoints are ours (toolkit.train.experts)
    return engine
