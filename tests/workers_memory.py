"""Run inside multi-process launches: real DeepSpeed engines around megatron-core GPTModels, built
from toolkit.dsconfig configs, and what each rank actually holds.

Bytes are counted per unique tensor storage (views share one), skipping meta tensors, so a flat
buffer and the parameters that are views into it are counted once:
  params     storages of every parameter's data (and its ZeRO-3 partition, ds_tensor)
  optimizer  storages of the inner torch optimizer's state and of the fp32 master copies (found
             under DeepSpeed's MASTER_ATTRS, since its param_groups are emptied between ZeRO-3
             steps and its state is empty before the first step), other than the parameters
  buckets    storages under DeepSpeed attributes named *ipg* (the reduce buckets)
  grads      every other storage reachable from the engine's optimizer and the parameters, after
             each backward and before step(); the largest count over the micro-steps is kept
Whatever appears after step() outside those categories (and the gradient buffers ZeRO keeps
allocated) is returned as `unaccounted`.
"""

from __future__ import annotations

import torch

SEQ = 32
SEED = 1234
# Where DeepSpeed's optimizers keep fp32 master weights: stage_1_and_2.py, stage3.py and the
# FP16/BF16 optimizer wrappers (runtime/fp16/*.py).
MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups", "fp32_groups_flat")


def tiny_spec(num_layers: int = 4, variant: str = "llama"):
    from toolkit.families import spec_from_config
    from toolkit.tinymodels import make_config

    return spec_from_config(make_config(variant, num_hidden_layers=num_layers).to_dict())[1]


# ---------------------------------------------------------------------------------------------
# tensor census


def _storages(obj, out: dict, seen: set, depth: int = 0, path: str = "") -> None:
    if id(obj) in seen or depth > 8:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "meta" and obj.untyped_storage().nbytes():
            out.setdefault(obj.untyped_storage().data_ptr(), (obj.untyped_storage().nbytes(), path))
        for attr in ("grad", "ds_tensor"):
            if getattr(obj, attr, None) is not None:
                _storages(getattr(obj, attr), out, seen, depth + 1, f"{path}.{attr}")
        return
    if isinstance(obj, (list, tuple, set)):
        for item in obj:
            _storages(item, out, seen, depth + 1, path)
    elif isinstance(obj, dict):
        for key, item in list(obj.items()):
            _storages(item, out, seen, depth + 1, f"{path}[{key}]" if isinstance(key, str) else path)
    elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
        if type(obj).__module__.split(".")[0] in ("deepspeed", "torch"):
            for name, item in list(vars(obj).items()):
                _storages(item, out, seen, depth + 1, f"{path}.{name}")


def storages(*roots) -> dict[int, tuple[int, str]]:
    out: dict = {}
    seen: set = set()
    for root in roots:
        _storages(root, out, seen)
    return out


def census(engine) -> dict[str, dict]:
    params = list(engine.module.parameters())
    param_keys = storages([p.data for p in params] + [p.ds_tensor for p in params if hasattr(p, "ds_tensor")])
    basic = engine.basic_optimizer
    masters = [getattr(engine.optimizer, a) for a in MASTER_ATTRS if hasattr(engine.optimizer, a)]
    masters = [t.detach() for t in _flat(masters)] + [p.detach() for g in basic.param_groups for p in g["params"]]
    optimizer = {k: v for k, v in storages(basic.state, masters).items() if k not in param_keys}
    everything = storages(engine.optimizer, params)
    buckets = {k: v for k, v in everything.items() if "ipg" in v[1] and k not in param_keys}
    rest = {k: v for k, v in everything.items() if k not in param_keys and k not in optimizer and k not in buckets}
    return {"params": param_keys, "optimizer": optimizer, "buckets": buckets, "rest": rest}


def _flat(items) -> list:
    out = []
    for item in items:
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (list, tuple)):
            out.extend(_flat(item))
    return out


def _bytes(d: dict) -> int:
    return sum(n for n, _ in d.values())


# ---------------------------------------------------------------------------------------------
# model states on real engines


def _batches(spec, n: int, micro: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, spec.vocab_size, (micro, SEQ), generator=g) for _ in range(n)]


def _run_step(engine, setup, spec, seed: int) -> int:
    """Forward and backward every micro-batch of one optimizer step; stop before step().
    Returns the most gradient bytes seen after a backward."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batches = _batches(spec, setup.micro_batches, setup.micro_batch, seed)
    pos = torch.arange(SEQ)[None].expand(setup.micro_batch, -1)
    if setup.schedule == "deepspeed":
        grads = 0
        for i, tokens in enumerate(batches):
            loss = engine(tokens, pos, None, labels=tokens).float().mean()
            engine.backward(loss)
            grads = max(grads, _bytes(census(engine)["rest"]))
            if i < len(batches) - 1:
                engine.step()  # DeepSpeed counts micro-steps; the last one is the boundary
        return grads
    # megatron-core schedule: engine(...) registers DeepSpeed's backward hooks; ZeRO-0 has no
    # torch-style backward support in DeepSpeed, so the module is called directly there.
    call = engine.module if setup.zero == 0 else engine

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        out = call(tokens, pos, None, labels=tokens)
        return out, lambda o: (o.float().mean() / len(batches), {})

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=engine.module,
                                num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=setup.micro_batch,
                                forward_only=False)
    return _bytes(census(engine)["rest"])  # accumulation only grows until step()


def _engine(case: dict, spec, world: int):
    import deepspeed

    from toolkit.dsconfig import OptimizerSettings, Setup, build
    from toolkit.layouts import Layout
    from toolkit.model import build_gpt_model
    from toolkit.runtime.cpu_compat import allow_deepspeed_fp16
    from toolkit.train.parallel import MegatronCoreMPU, param_groups

    from toolkit.train import experts

    tp, pp, ep = case["tp"], case["pp"], case.get("ep", 1)
    dp = world // (tp * pp)
    setup = Setup(gpus=world, tp=tp, pp=pp, zero=case["zero"], precision=case["precision"], micro_batch=2,
                  global_batch=2 * case["micro_batches"] * dp, schedule=case["schedule"], steps_per_print=10**9,
                  offload_optimizer=case.get("offload_optimizer", "none"), offload_param=case.get("offload_param", "none"),
                  optimizer=OptimizerSettings(lr=1e-3, torch_adam=True))  # torch AdamW: no JIT build, even offloaded
    config = build(setup, spec)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[case["precision"]]
    reset_moe_globals(spec)
    torch.manual_seed(SEED)
    model = build_gpt_model(spec, Layout(tp, pp, ep=ep), dtype)
    if "lora" in case:
        _apply_lora(model, spec, Layout(tp, pp), case["lora"])
    # under LoRA the recipe's parameter groups: only what requires a gradient (the adapter)
    parameters = param_groups(model, 0.0) if "lora" in case or ep > 1 else model.parameters()
    allow_deepspeed_fp16()  # CPU only (toolkit.runtime.cpu_compat), as the recipe's engine
    # under EP the recipe's expert groups: experts partitioned and reduced over expert-DP
    expert_group = experts.register_expert_groups(model, ep)
    with experts.moe_engine(expert_group):
        engine, *_ = deepspeed.initialize(model=model, config=config, mpu=MegatronCoreMPU(),
                                          model_parameters=experts.split_expert_group(parameters, expert_group))
    engine.has_moe_layers = False
    return engine, setup


def _apply_lora(model, spec, layout, lora: dict) -> None:
    """toolkit.lora's layers with PEFT's initialisation, as the recipe applies them."""
    from megatron.core import parallel_state as ps

    from toolkit.families import family_named
    from toolkit.lora.adapter import apply_lora
    from toolkit.lora.peft_dir import LoraSettings

    settings = LoraSettings(lora["r"], 2.0 * lora["r"], 0.0, tuple(lora["targets"]))
    apply_lora(model, family_named(spec.family), spec, layout, ps.get_tensor_model_parallel_rank(),
               ps.get_pipeline_model_parallel_rank(), settings, {}, SEED)


def model_state_case(case: dict, spec, world: int) -> dict:
    from megatron.core import parallel_state as ps

    from toolkit.memory import CPU_LOCAL, estimate
    from toolkit.memory.lora import LoraShape

    engine, setup = _engine(case, spec, world)
    grads = _run_step(engine, setup, spec, seed=case["zero"])
    after_backward = census(engine)
    engine.step()
    after_step = census(engine)
    stage = ps.get_pipeline_model_parallel_rank()
    lora = LoraShape(case["lora"]["r"], tuple(case["lora"]["targets"])) if "lora" in case else None
    predicted = estimate(spec, setup, SEQ, kernels=CPU_LOCAL, reserve=0, lora=lora,
                         ep=case.get("ep", 1)).stages[stage].states
    result = {
        **case,
        "stage": stage,
        "engine": type(engine).__name__,
        "optimizer_class": type(engine.optimizer).__name__,
        "measured": {"params": _bytes(after_step["params"]), "grads": grads,
                     "optimizer": _bytes(after_step["optimizer"]), "buckets": _bytes(after_backward["buckets"]),
                     "unaccounted": _bytes({k: v for k, v in after_step["rest"].items()
                                            if k not in after_backward["rest"]})},
        "predicted": {"params": predicted.params, "grads": predicted.grads, "optimizer": predicted.optimizer,
                      "buffers": predicted.buffers, "host": predicted.host},
        "lr_after_step": engine.get_lr()[0],
        "global_steps": engine.global_steps,
    }
    del engine
    return result


def fsdp_state_case(case: dict, spec, world: int) -> dict:
    """The recipe's FSDP2 engine (toolkit.train.fsdp.build_engine) around an fp32 model: the sharded
    parameters after step(), the sharded gradients after the backward of every micro-batch (before
    step()), AdamW's state after the first step."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from toolkit.dsconfig import Setup
    from toolkit.layouts import Layout
    from toolkit.memory import CPU_LOCAL, estimate
    from toolkit.model import build_gpt_model
    from toolkit.train import fsdp
    from toolkit.train.config import TrainConfig

    tp = case["tp"]
    dp = world // tp
    setup = Setup(gpus=world, tp=tp, pp=1, zero=3, precision=case["precision"], micro_batch=2,
                  global_batch=2 * case["micro_batches"] * dp)
    torch.manual_seed(SEED)
    model = build_gpt_model(spec, Layout(tp, 1), torch.float32)
    cfg = TrainConfig(precision=case["precision"])
    engine = fsdp.build_engine(model, cfg, lambda step: 1.0)
    batches = _batches(spec, setup.micro_batches, setup.micro_batch, seed=5)
    pos = torch.arange(SEQ)[None].expand(setup.micro_batch, -1)

    def forward_step(data_iterator, m):
        tokens = next(data_iterator)
        return engine(tokens, pos, None, labels=tokens), lambda o: (o.float().mean() / len(batches), {})

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=engine.module,
                                num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=setup.micro_batch,
                                forward_only=False)
    params = list(engine.module.parameters())
    grads = _bytes(storages([p.grad.to_local() for p in params if p.grad is not None]))
    engine.step()
    param_keys = storages([p.to_local() for p in params])
    moments = [t.to_local() if hasattr(t, "to_local") else t for state in engine.optimizer.state.values()
               for t in state.values()]  # a DTensor's own storage is empty: its local shard holds the bytes
    optimizer = {k: v for k, v in storages(moments).items() if k not in param_keys}
    predicted = estimate(spec, setup, SEQ, kernels=CPU_LOCAL, reserve=0, dp_engine="fsdp").stages[0].states
    zero3 = estimate(spec, setup, SEQ, kernels=CPU_LOCAL, reserve=0).stages[0].states
    return {**case, "stage": 0, "lr_after_step": engine.get_lr()[0],
            "measured": {"params": _bytes(param_keys), "grads": grads, "optimizer": _bytes(optimizer)},
            "predicted": {"params": predicted.params, "grads": predicted.grads, "optimizer": predicted.optimizer},
            "zero3": {"params": zero3.params, "grads": zero3.grads, "optimizer": zero3.optimizer}}


# ---------------------------------------------------------------------------------------------
# activations


class _Live:
    """Saved-for-backward bytes alive right now, per unique storage, and the peak."""

    def __init__(self, params: set):
        self.params, self.refs, self.live, self.peak, self.total = params, {}, 0, 0, 0

    def pack(self, t):
        key = t.untyped_storage().data_ptr()
        if key in self.params or t.device.type == "meta":
            return t
        if key not in self.refs:
            self.refs[key] = [0, t.untyped_storage().nbytes()]
            self.live += self.refs[key][1]
            self.total += self.refs[key][1]
            self.peak = max(self.peak, self.live)
        self.refs[key][0] += 1
        return _Held(t, key, self)

    def release(self, key):
        ref = self.refs[key]
        ref[0] -= 1
        if not ref[0]:
            self.live -= ref[1]
            del self.refs[key]

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held


class _Held:
    def __init__(self, tensor, key, live):
        self.tensor, self.key, self.live = tensor, key, live

    def __del__(self):
        self.live.release(self.key)


def _model(spec, tp, pp, dtype, recompute, sequence_parallel=False, lora: dict | None = None, ep: int = 1,
           vpp: int = 1, cp: int = 1):
    from toolkit.layouts import Layout
    from toolkit.model import build_gpt_model, transformer_config
    from toolkit.train.virtual import schedule_settings

    extra = {"none": {}, "selective": dict(recompute_granularity="selective"),
             "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)}[recompute]
    reset_moe_globals(spec)
    torch.manual_seed(SEED)
    layout = Layout(tp, pp, ep=ep)
    config = transformer_config(spec, layout, dtype, sequence_parallel=sequence_parallel, **extra,
                                **schedule_settings(pp, vpp), context_parallel_size=cp)
    if vpp > 1:  # the recipe's chunks (toolkit.train.build), one per virtual stage
        return [build_gpt_model(spec, layout, dtype, config=config, vp_stage=v) for v in range(vpp)]
    model = build_gpt_model(spec, layout, dtype, config=config)
    if lora is not None:
        _apply_lora(model, spec, layout, lora)
    return model


def reset_moe_globals(spec) -> None:
    """megatron-core's MoE module globals, between models: the aux-loss tracker is sized by the
    first MoE model's layers, and the aux-loss scale keeps the shape of whoever set it first (a
    backward outside the schedule sets a 0-d one the schedule can't copy its [1] scale into)."""
    if spec.is_moe:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        from toolkit.runtime import megatron_versions

        megatron_versions.reset_moe_metrics()
        MoEAuxLossAutoScaler.main_loss_backward_scale = None


def forward_saved_bytes(spec, tp: int, dtype, recompute: str, micro: int, sequence_parallel: bool = False,
                        lora: dict | None = None, ep: int = 1) -> int:
    """Bytes saved for backward by one forward of one micro-batch (PP = 1), parameters excluded."""
    model = _model(spec, tp, 1, dtype, recompute, sequence_parallel, lora, ep)
    live = _Live({p.untyped_storage().data_ptr() for p in model.parameters()})
    tokens = _batches(spec, 1, micro, seed=7)[0]
    pos = torch.arange(SEQ)[None].expand(micro, -1)
    with torch.autograd.graph.saved_tensors_hooks(live.pack, live.unpack):
        loss = model(tokens, pos, None, labels=tokens).float().mean()
    total = live.total
    loss.backward()
    return total


def context_parallel_saved_bytes(cases: list[dict]) -> list[dict]:
    """Bytes saved for backward by one forward at CP (the launch's world size) of each case, this
    rank's chunks of a SEQ-token micro-batch (toolkit.blocks.context_parallel), for 2 and 4 layers."""
    from megatron.core import parallel_state as ps

    from toolkit.blocks.context_parallel import chunk_positions

    cp = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 2
    switch_layout(1, 1, cp=cp)
    rank = ps.get_context_parallel_rank()
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    out = []
    for case in cases:
        saved = {}
        for n in (2, 4):
            spec = tiny_spec(n, case["variant"])
            model = _model(spec, 1, 1, dtypes[case["precision"]], case["recompute"], cp=cp)
            live = _Live({p.untyped_storage().data_ptr() for p in model.parameters()})
            mine = chunk_positions(SEQ, cp, rank)
            tokens = _batches(spec, 1, case["micro"], seed=7)[0][:, mine]
            with torch.autograd.graph.saved_tensors_hooks(live.pack, live.unpack):
                loss = model(tokens, mine[None].expand(case["micro"], -1), None, labels=tokens).float().mean()
            saved[n] = live.total
            loss.backward()
        out.append({**case, "cp": cp, "saved": saved})
    return out


def pipeline_peak_bytes(spec, dtype, micro: int, micro_batches: int, vpp: int = 1) -> int:
    """Peak saved-for-backward bytes on this rank's stage during one 1F1B (or interleaved) step."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = _model(spec, 1, 2, dtype, "none", vpp=vpp)
    chunks = model if vpp > 1 else [model]
    live = _Live({p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()})
    batches = _batches(spec, micro_batches, micro, seed=9)
    pos = torch.arange(SEQ)[None].expand(micro, -1)

    def forward_step(data_iterator, m):
        tokens = next(data_iterator)
        return m(tokens, pos, None, labels=tokens), lambda o: (o.float().mean(), {})

    with torch.autograd.graph.saved_tensors_hooks(live.pack, live.unpack):
        data = [iter(batches) for _ in chunks] if vpp > 1 else iter(batches)
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data, model=model,
                                    num_microbatches=micro_batches, seq_length=SEQ, micro_batch_size=micro,
                                    forward_only=False)
    return live.peak


# ---------------------------------------------------------------------------------------------
# the launch


def switch_layout(tp: int, pp: int, ep: int = 1, vpp: int = 1, cp: int = 1):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from toolkit.runtime.distributed import init_parallel

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    info = init_parallel(tp, pp, ep=ep, vpp=vpp, cp=cp)
    model_parallel_cuda_manual_seed(SEED)
    return info


def measure_all(state_cases: list[dict], activation_cases: list[dict], pipeline_cases: list[dict]) -> dict:
    """Every case, grouped by layout so each TP x PP is initialised once."""
    import deepspeed
    import torch.distributed as dist

    from toolkit.runtime.cpu_compat import skip_deepspeed_shm_op

    skip_deepspeed_shm_op()
    switch_layout(1, 1)
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    out = {"states": [], "activations": [], "pipeline": []}
    key = lambda c: (c["tp"], c["pp"], c.get("ep", 1), c.get("vpp", 1))  # noqa: E731
    layouts = sorted({key(c) for c in state_cases + activation_cases + pipeline_cases})
    for tp, pp, ep, vpp in layouts:
        switch_layout(tp, pp, ep, vpp)
        here = lambda c: key(c) == (tp, pp, ep, vpp)  # noqa: E731
        for case in [c for c in state_cases if here(c)]:
            measure = fsdp_state_case if case.get("dp_engine") == "fsdp" else model_state_case
            out["states"].append(measure(case, tiny_spec(variant=case["variant"]), world))
        for case in [c for c in activation_cases if here(c)]:
            saved = {n: forward_saved_bytes(tiny_spec(n, case["variant"]), tp, dtypes[case["precision"]], case["recompute"],
                                            case["micro"], case.get("sequence_parallel", False), case.get("lora"),
                                            case.get("ep", 1))
                     for n in (2, 4)}
            out["activations"].append({**case, "saved": saved})
        for case in [c for c in pipeline_cases if here(c)]:
            from megatron.core import parallel_state as ps

            peak = pipeline_peak_bytes(tiny_spec(variant=case["variant"]), dtypes[case["precision"]], case["micro"],
                                       case["micro_batches"], case.get("vpp", 1))
            out["pipeline"].append({**case, "stage": ps.get_pipeline_model_parallel_rank(), "peak": peak})
    return out
