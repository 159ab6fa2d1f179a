"""Functions run inside multi-process test launches (toolkit.runtime.launch needs importable names)."""

from __future__ import annotations

from pathlib import Path


def megatron_native_checks(cases: list[dict]) -> list[dict]:
    """On one process, with megatron-core itself as the judge, for each case (a model family's
    `dist`, `te_torch` and `bf16_dist` checkpoints and an empty `resave` path):
    - the sharded keys of a local-spec GPTModel, vs the keys of our TE-named torch file;
    - megatron's own dist_checkpointing.save of the model loaded from our torch_dist output,
      vs our torch_dist metadata (same tensors, global shapes, dtypes and objects). The model is
      built in the source dtype: with an fp32 source every parameter is fp32 on both sides (the
      local spec keeps norms in fp32 whatever params_dtype is, so a bf16 model could not match);
    - the dtypes of our torch_dist written from a bf16 source (every tensor in the source dtype);
    - the element count of every parameter the model holds (what `toolkit memory` counts)."""
    from toolkit.runtime.distributed import init_parallel

    init_parallel(1, 1)
    return [_native_checks(**case) for case in cases]


def _native_checks(dist: str, te_torch: str, resave: str, bf16_dist: str) -> dict:
    import torch
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from toolkit.convert.load import load_converted
    from toolkit.convert.metadata import CheckpointMeta
    from toolkit.convert.torch_format import load_trusted_types
    from toolkit.layouts import Layout
    from toolkit.model import build_gpt_model

    meta = CheckpointMeta.read(Path(dist))
    model = build_gpt_model(meta.model_spec, Layout(1, 1, meta.vocab_divisor), getattr(torch, meta.model_spec.dtype))
    load_converted(model, dist)
    sharded_keys = {v.key for v in model.sharded_state_dict().values()}

    te_keys = set(load_trusted_types(Path(te_torch) / "release/mp_rank_00/model_optim_rng.pt")["model"])
    Path(resave).mkdir()
    dist_checkpointing.save(model.sharded_state_dict(), resave)

    def layout_of(directory):
        md = FileSystemReader(directory).read_metadata().state_dict_metadata
        return {
            k: (tuple(v.size), str(v.properties.dtype)) if isinstance(v, TensorStorageMetadata) else "bytes"
            for k, v in md.items()
        }

    return {
        "sharded_keys": sorted(sharded_keys),
        "param_numels": sorted(p.numel() for p in model.parameters()),
        "te_keys": sorted(te_keys),
        "ours": layout_of(Path(dist) / "release"),
        "megatrons": layout_of(resave),
        "bf16_source": layout_of(Path(bf16_dist) / "release"),
    }


def packed_vs_unpacked_losses(checkpoint: str, documents: list[dict], seq_len: int) -> float:
    """Max |per-token loss| difference between documents packed into one row (block-diagonal
    attention) and the same documents run one per row."""
    import torch
    from transformers import AutoTokenizer

    from toolkit.convert.metadata import CheckpointMeta
    from toolkit.convert.load import load_converted
    from toolkit.model import build_gpt_model
    from toolkit.runtime.distributed import init_parallel
    from toolkit.train.data import collate, pack_rows, pad_rows, parse_line
    from toolkit.train.loss import token_losses

    init_parallel(1, 1)
    meta = CheckpointMeta.read(Path(checkpoint))
    model = build_gpt_model(meta.model_spec, meta.layout).eval()
    load_converted(model, checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(Path(checkpoint) / "hf")
    samples = [parse_line(tokenizer, d) for d in documents]

    def losses(batch):
        positions = torch.arange(seq_len)[None].expand(batch["tokens"].shape[0], -1)
        mask = batch.get("attention_mask")
        with torch.no_grad():
            logits = model(batch["tokens"], positions, mask)
        return token_losses(logits, batch["labels"], None)

    packed_rows = pack_rows(samples, seq_len + 1, tokenizer.pad_token_id)
    assert len(packed_rows) == 1, "the documents must fit one packed row"
    packed = collate(packed_rows, packed=True)
    packed_loss = losses(packed)[0][packed["loss_mask"][0] > 0]
    single = collate(pad_rows(samples, seq_len + 1, tokenizer.pad_token_id), packed=False)
    single_loss = losses(single)[single["loss_mask"] > 0]
    assert packed_loss.shape == single_loss.shape
    return float((packed_loss - single_loss).abs().max())


def fail_on_rank_one(message: str) -> int:
    import os

    rank = int(os.environ["RANK"])
    if rank == 1:
        raise ValueError(message)
    return rank


def die_on_rank_one() -> int:
    import os

    if os.environ["RANK"] == "1":
        os._exit(7)
    import time

    time.sleep(60)  # would wait for rank 1 forever in a collective
    return 0


def strict_device_checks(nprocs_expected: int) -> dict:
    """Under TOOLKIT_STRICT_DEVICES=1: what the check refuses (host tensors from our code, also
    after arithmetic) and accepts (tensors made on or moved to the compute device), and the
    trainer's own per-step reduction (loss sum and stop flag over all ranks)."""
    import os

    import torch
    import torch.distributed as dist

    from toolkit.runtime.distributed import init_parallel
    from toolkit.runtime.strict_devices import DeviceError
    from toolkit.train.step import reduce_step_totals

    assert os.environ.get("TOOLKIT_STRICT_DEVICES") == "1"
    info = init_parallel(1, 1)
    assert dist.get_world_size() == nprocs_expected

    def refused(make) -> bool:
        try:
            dist.all_reduce(make())
        except DeviceError:
            return True
        return False

    host = torch.tensor([1.0])
    verdicts = {
        "host tensor": refused(lambda: torch.tensor([1.0])),
        "host tensor after arithmetic": refused(lambda: host * 2 + 1),
        "made on the device": refused(lambda: torch.ones(1, device=info.device)),
        "moved to the device": refused(lambda: host.to(info.device)),
    }
    # Rank 1 alone asks to stop; both ranks hold a loss sum (PP1, TP1): 2.5 + 2.5, and both stop.
    verdicts["step totals"] = reduce_step_totals(torch.tensor(2.5, device=info.device), info.rank == 1, info.device)
    return verdicts


def lora_logits(checkpoint: str, tokens, cases: list[dict]) -> list[tuple]:
    """Per case, in one launch: logits (whole vocab, padding sliced off) of the megatron-core
    model at TP=case["tp"] with the HF PEFT adapter at case["adapter"] imported onto it; the
    model parallel groups are rebuilt where the TP changes. A case may also ask for
      export: the imported adapter gathered back to that directory untouched (import -> 0 steps
      -> export);
      swap_query_groups: the logits after swapping the q_proj B rows of the first two query
      groups in layer 0 (a wrong interleave);
      fresh: only the adapter's settings are used and the weights initialised as PEFT does.
    Returns (logits, swapped logits or None) per case."""
    from tests.workers_memory import switch_layout

    out = []
    for case in cases:
        switch_layout(case.get("tp", 1), 1)
        out.append(_lora_case(checkpoint, tokens, case["adapter"], case.get("export"),
                              case.get("swap_query_groups", False), case.get("fresh", False)))
    return out


def lora_logits_of_each(jobs: list[tuple]) -> list[list[tuple]]:
    """lora_logits for each (checkpoint, tokens, cases) of `jobs`, in one launch."""
    return [lora_logits(checkpoint, tokens, cases) for checkpoint, tokens, cases in jobs]


def _lora_case(checkpoint: str, tokens, adapter_dir: str, export_dir: str | None, swap_query_groups: bool,
               fresh: bool):
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from toolkit.convert.load import load_converted
    from toolkit.convert.metadata import CheckpointMeta
    from toolkit.families import family_named
    from toolkit.layouts import Layout
    from toolkit.lora import adapter, peft_dir
    from toolkit.model import build_gpt_model

    tp = ps.get_tensor_model_parallel_world_size()
    meta = CheckpointMeta.read(Path(checkpoint))
    spec, layout = meta.model_spec, Layout(tp, 1, meta.vocab_divisor)
    model = build_gpt_model(spec, layout, torch.float32)
    load_converted(model, checkpoint)
    family, settings = family_named(spec.family), peft_dir.read_settings(Path(adapter_dir))
    initial = None if fresh else adapter.read_initial(Path(adapter_dir), family, spec, settings)
    applied = adapter.apply_lora(model, family, spec, layout, ps.get_tensor_model_parallel_rank(), 0, settings,
                                 peft_dir.base_reference(Path(checkpoint)), 0, initial)
    if export_dir:
        adapter.save_adapter(applied, Path(export_dir))
    model.eval()
    tokens = torch.tensor(tokens)

    def logits():
        with torch.no_grad():
            out = model(tokens, torch.arange(tokens.shape[1])[None].expand_as(tokens), None)
            # as a list: a tensor sent through the result queue dies with the worker's shared memory
            return gather_from_tensor_model_parallel_region(out)[..., : spec.vocab_size].tolist()

    correct, swapped = logits(), None
    if swap_query_groups:
        b = model.decoder.layers[0].self_attention.linear_qkv.lora_B["q_proj"]
        group = spec.num_heads // spec.num_kv_heads * spec.head_dim
        with torch.no_grad():
            b[: 2 * group] = torch.cat([b[group : 2 * group], b[:group]]).clone()
        swapped = logits()
    return correct, swapped


def sequence_parallel_grad_errors(checkpoint: str, seq_len: int) -> dict:
    """At TP 2 (two processes): the gradients of one backward with sequence parallelism, against
    the same model without it, both with the TP sum of partial gradients (toolkit.train.parallel)
    and without it. Returns the largest |difference| of the loss and of any gradient, and the
    names summed over TP."""
    import torch

    from toolkit.convert.load import load_converted
    from toolkit.convert.metadata import CheckpointMeta
    from toolkit.layouts import Layout
    from toolkit.model import build_gpt_model, transformer_config
    from toolkit.runtime.distributed import init_parallel
    from toolkit.train.parallel import sum_partial_grads_over_tp

    init_parallel(2, 1)
    meta = CheckpointMeta.read(Path(checkpoint))
    spec, layout = meta.model_spec, Layout(2, 1, meta.vocab_divisor)
    tokens = torch.randint(0, spec.vocab_size, (2, seq_len + 1), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(seq_len)[None].expand(2, -1)

    def backward(sequence_parallel: bool, summed: bool):
        config = transformer_config(spec, layout, torch.float32, sequence_parallel=sequence_parallel)
        model = build_gpt_model(spec, layout, torch.float32, config=config)
        load_converted(model, checkpoint)
        names = sum_partial_grads_over_tp(model) if summed else []
        loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()
        loss.backward()
        return float(loss), {n: p.grad for n, p in model.named_parameters()}, names

    loss, grads, _ = backward(False, True)

    def errors(summed: bool) -> dict:
        sp_loss, sp_grads, names = backward(True, summed)
        worst = max(float((sp_grads[n] - g).abs().max()) for n, g in grads.items())
        return {"loss": abs(sp_loss - loss), "grad": worst, "names": names}

    return {"summed": errors(True), "not_summed": errors(False)}


def moe_aux_loss_checks(cases: list[dict]) -> list[dict]:
    """For each case (`hf`: an fp32 HF MoE model, `checkpoint`: it converted at EP 1, `coeff`), one
    forward of the same batch through HF with output_router_logits and through our megatron-core
    model in each aux-loss mode (toolkit/blocks/router_losses.py); the loss values (without the coefficient) and
    the gradients of coeff * loss wrt every router weight. Only the aux loss reaches the routers:
    the main loss is multiplied by 0 on both sides. Modes: hf, megatron, hf with full activation
    recomputation, and hf on a batch whose first row ends in padding (HF's attention_mask,
    megatron-core's padding_mask). Also the megatron mode's formula (README) on HF's router logits."""
    import torch
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    from toolkit.convert.load import load_converted
    from toolkit.convert.metadata import CheckpointMeta
    from toolkit.model import build_gpt_model, transformer_config
    from toolkit.blocks.router_losses import AuxLoss, last_aux_loss
    from toolkit.runtime.distributed import init_parallel

    init_parallel(1, 1)
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    results = []
    for case in cases:
        meta = CheckpointMeta.read(Path(case["checkpoint"]))
        tokens = torch.randint(0, meta.model_spec.vocab_size, (3, 19), generator=torch.Generator().manual_seed(5))
        valid = torch.ones_like(tokens)
        valid[0, -5:] = 0
        reference, hf_grads, router_logits, config = _hf_aux_loss(case["hf"], tokens, case["coeff"], None)
        padded_reference, padded_hf_grads, *_ = _hf_aux_loss(case["hf"], tokens, case["coeff"], valid)
        result = {"reference": reference, "padded_reference": padded_reference,
                  "megatron_formula": _megatron_switch_loss(router_logits, config)}
        for mode in ("hf", "megatron", "hf_recompute", "hf_padded"):
            aux = AuxLoss(mode.split("_")[0], case["coeff"])
            config = transformer_config(meta.model_spec, meta.layout, torch.float32, aux,
                                        **(recompute if mode == "hf_recompute" else {}))
            model = build_gpt_model(meta.model_spec, meta.layout, config=config, aux_loss=aux).train()
            load_converted(model, case["checkpoint"])
            clear_aux_losses_tracker()
            padding = (valid == 0) if mode == "hf_padded" else None  # megatron-core: True = padding
            logits = model(tokens, torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1), attention_mask=None,
                           padding_mask=padding)
            (logits.sum() * 0).backward()
            grads = [m.weight.grad for name, m in model.named_modules() if name.endswith("mlp.router")]
            tracker = get_moe_layer_wise_logging_tracker()
            result[mode] = float(last_aux_loss(model) if aux.mode == "hf" else tracker["load_balancing_loss"]["values"].sum())
            expected = padded_hf_grads if mode == "hf_padded" else hf_grads
            result[f"{mode}_grad_diff"] = max(float((a - b).abs().max()) for a, b in zip(grads, expected))
        result["grad_max"] = max(float(g.abs().max()) for g in hf_grads)
        results.append(result)
    return results


def _hf_aux_loss(hf_dir: str, tokens, coeff: float, attention_mask):
    """HF's aux loss (without the coefficient), the gradients of coeff * it wrt the routers, the router
    logits and the config."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
    out = hf(input_ids=tokens, attention_mask=attention_mask, output_router_logits=True)
    (out.logits.sum() * 0 + coeff * out.aux_loss).backward()
    grads = [m.weight.grad for name, m in hf.named_modules() if name.endswith("mlp.gate")]
    return float(out.aux_loss), grads, out.router_logits, hf.config


def _megatron_switch_loss(router_logits, config) -> float:
    """sum over layers of E / (k T^2) * sum_i c[l, i] p[l, i] (toolkit/blocks/router_losses.py), from HF's logits."""
    import torch

    k, total = config.num_experts_per_tok, 0.0
    for logits in router_logits:
        probs = torch.softmax(logits.detach().float(), dim=-1)
        counts = torch.zeros_like(probs).scatter(1, probs.topk(k, dim=-1).indices, 1.0).sum(0)
        total += float(probs.shape[1] * (counts * probs.sum(0)).sum() / (k * probs.shape[0] ** 2))
    return total


def megatron_distributed_optimizer_checkpoint(checkpoint: str, out: str, steps: int, dp_reshardable_out: str = "") -> float:
    """megatron-core's own training objects, not ours: the converted model wrapped in megatron-core's
    DistributedDataParallel with its DistributedOptimizer (Adam, fp32, state sharded over DP), a few
    steps on random tokens, then dist_checkpointing.save of the model's and the optimizer's
    sharded_state_dict in the layout-independent (`fully_reshardable`) format (and, given
    `dp_reshardable_out`, the same state there in megatron-core's `dp_reshardable` format). Returns
    the last loss."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from toolkit.convert.load import load_converted
    from toolkit.convert.metadata import CheckpointMeta
    from toolkit.model import build_gpt_model
    from toolkit.runtime.distributed import init_parallel

    init_parallel(1, 1)
    meta = CheckpointMeta.read(Path(checkpoint))
    model = build_gpt_model(meta.model_spec, meta.layout)
    load_converted(model, checkpoint)
    ddp = DistributedDataParallel(config=model.config, module=model,
                                  ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True))
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True,
                                                       params_dtype=torch.float32), [ddp])
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    tokens = torch.randint(0, meta.model_spec.vocab_size, (2, 16), generator=generator)
    positions = torch.arange(16).expand(2, -1)
    for _ in range(steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        optimizer.step()
    saves = ((out, "fully_reshardable"), (dp_reshardable_out, "dp_reshardable"))
    for directory, sharding in (s for s in saves if s[0]):
        model_state = model.sharded_state_dict()
        state = {"model": model_state, "optimizer": optimizer.sharded_state_dict(
            model_state, metadata={"distrib_optim_sharding_type": sharding})}
        if torch.distributed.get_rank() == 0:
            Path(directory).mkdir(parents=True)
        torch.distributed.barrier()
        dist_checkpointing.save(state, directory)
    return float(loss)


def cuda_shaped_checks(cfg_path: str, tokens, save_dir: str, variants: list[str]) -> dict:
    """CUDA-only paths driven on CPU in one 1-rank launch (tests/test_cuda_shaped.py); each check's
    failure is returned as text, so that one failing check does not hide the others."""
    import traceback

    from toolkit.runtime.distributed import init_parallel

    init_parallel(1, 1)
    out = {}
    for name, check in (("gpu_layer_specs", lambda: _layer_specs_with_gpu_flags(variants)),
                        ("lora_under_te", lambda: _lora_where_te_would_run(cfg_path, tokens)),
                        ("save_from_device", lambda: _save_tensors_not_on_cpu(save_dir)),
                        ("mamba_ssm_kernels", _mamba_ssm_kernels_where_installed)):
        try:
            out[name] = check()
        except BaseException:  # noqa: BLE001 - reported to the test (CheckpointException is not an Exception)
            out[name] = {"error": traceback.format_exc()}
    return out


def _mamba_ssm_kernels_where_installed() -> dict:
    """megatron-core's MambaMixer where CUDA and `mamba_ssm` exist. mamba_ssm cannot import here, so its module
    is set as its import leaves it (mamba_mixer.py:68-79: HAVE_MAMBA_SSM and the three names), each name a
    recording kernel answering as mamba_ssm's would (the torch scan's numbers); CUDA as a GPU answers. Runs last:
    it leaves the process so. Where the release cannot import its mixer at all (0.16.1 without triton, which a
    GPU's torch has), the one line that says so."""
    import torch
    from megatron.core.process_groups_config import ProcessGroupCollection

    from toolkit.errors import ToolkitError
    from toolkit.runtime import megatron_versions

    try:
        mamba_mixer = megatron_versions.mamba_mixer_module()
    except ToolkitError as err:
        return {"refused": str(err)}
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from toolkit.blocks import mixer_mamba, norms
    from toolkit.blocks.kernels import mamba2_ssd
    from toolkit.runtime import cpu_compat

    calls = []

    def kernel(*args, **kwargs):
        calls.append(sorted(kwargs))
        return mamba2_ssd.mamba_split_conv1d_scan_combined(*args, **kwargs)

    class KernelNorm(mamba2_ssd.RMSNormGated):  # mamba_ssm's layernorm_gated.RMSNorm
        pass

    class KernelExtendedRMSNorm(KernelNorm, norms.ExtendedRMSNorm):  # upstream's class over mamba_ssm's norm
        pass

    for name, value in (("HAVE_MAMBA_SSM", True), ("mamba_split_conv1d_scan_combined", kernel),
                        ("mamba_chunk_scan_combined", object()), ("RMSNormGated", KernelNorm),
                        ("ExtendedRMSNorm", KernelExtendedRMSNorm)):
        setattr(mamba_mixer, name, value)
    if hasattr(mamba_mixer, "TOOLKIT_MAMBA_SSD"):
        del mamba_mixer.TOOLKIT_MAMBA_SSD
    torch.cuda.is_available = lambda: True
    cpu_compat.apply_upstream_fixes()
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                               mamba_state_dim=4, mamba_head_dim=4, mamba_num_groups=2, mamba_num_heads=4)
    spec = mixer_mamba.mamba_mixer_spec(4, 8)  # where the stand-in would replace them
    kept = mamba_mixer.mamba_split_conv1d_scan_combined is kernel and mamba_mixer.RMSNormGated is KernelNorm
    mixer = build_module(spec, config, d_model=16, layer_number=1,
                         pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    out, _ = mixer(torch.randn(10, 2, 16))
    assert out.shape == (10, 2, 16)
    return {"kernel_kept": kept, "norm": type(mixer.norm).__name__, "kernel_calls": len(calls),
            "stand_in_marker": hasattr(mamba_mixer, "TOOLKIT_MAMBA_SSD")}


def _layer_specs_with_gpu_flags(variants: list[str]) -> dict:
    """Every family's layer spec built from its TransformerConfig with the flags CUDA switches on
    (a family's own block spec needs the process group, hence here)."""
    import torch

    from toolkit.families import spec_from_config
    from toolkit.layouts import Layout
    from toolkit.model import layer_spec_module, running_layer_spec, transformer_config
    from toolkit.tinymodels import make_config

    built, available = {}, torch.cuda.is_available
    torch.cuda.is_available = lambda: True  # CUDA cannot exist here: the answer a GPU gives
    try:
        for variant in variants:
            _, spec = spec_from_config(make_config(variant).to_dict())
            config = transformer_config(spec, Layout(1, 1), torch.bfloat16)
            built[variant] = type(layer_spec_module(running_layer_spec(), config, spec)).__name__
    finally:
        torch.cuda.is_available = available
    return built


def _lora_where_te_would_run(cfg_path: str, tokens) -> dict:
    """The recipe's LoRA model where the Transformer Engine spec would be chosen (a GPU with TE:
    neither exists here, so the spec decision is forced): the layer classes it built and its logits."""
    import torch

    import toolkit.model
    from toolkit.runtime.distributed import ParallelInfo
    from toolkit.train import build
    from toolkit.train.config import load_config

    toolkit.model.running_layer_spec = lambda: "te"  # what a GPU with TE answers (for a full fine-tune)
    cfg = load_config(cfg_path, [])
    meta = build.read_checkpoint_meta(cfg)
    model, layout = build.build_model(meta, cfg)
    layer = model.decoder.layers[0]
    classes = {"input_layernorm": type(layer.input_layernorm).__name__,
               "linear_qkv": type(layer.self_attention.linear_qkv).__name__}
    info = ParallelInfo(0, 1, 1, 1, 1, 0, 0, 0, torch.device("cpu"))
    build.apply_lora(model, build.lora_plan(cfg, meta), meta, layout, info, cfg.seed)
    model.eval()
    tokens = torch.tensor(tokens)
    with torch.no_grad():
        logits = model(tokens, torch.arange(tokens.shape[1])[None].expand_as(tokens), None)
    return {"classes": classes, "logits": logits[..., : meta.model_spec.vocab_size].tolist()}


def _save_tensors_not_on_cpu(save_dir: str) -> dict:
    """train/'s writer (toolkit.train.torch_dist_save) given tensors on a device other than the
    CPU, as DeepSpeed leaves them on a GPU. The stand-in device is torch's lazy-tensor backend, the
    one non-CPU device a CPU build of torch has: megatron-core's filesystem writer refuses it as it
    refuses a CUDA tensor (`assert tensor.is_cpu`)."""
    import torch
    import torch._lazy.ts_backend
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from toolkit.train import torch_dist_save

    Path(save_dir).mkdir()
    torch._lazy.ts_backend.init()
    values = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    on_device = values.to("lazy")
    assert not on_device.is_cpu
    torch_dist_save.save({"w": ShardedTensor.from_rank_offsets("w", on_device, replica_id=0)}, save_dir)
    loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4), replica_id=0)},
                                     save_dir)
    return {"equal": bool(torch.equal(loaded["w"], values))}


def router_tensors_in_bf16_model(checkpoints: list[str]) -> list[dict]:
    """For each converted checkpoint, loaded by load_converted into a one-process bf16 local-spec model (both
    layer specs' checkpoints load into it): {name: tensor} of every router weight and expert bias as the
    model holds them, as (dtype name, values as float lists: exact for bf16 and float32) since tensors do not
    outlive the worker."""
    import torch

    from toolkit.convert.load import load_converted
    from toolkit.convert.metadata import CheckpointMeta
    from toolkit.layouts import Layout
    from toolkit.model import build_gpt_model
    from toolkit.runtime.distributed import init_parallel

    init_parallel(1, 1)
    out = []
    for checkpoint in checkpoints:
        meta = CheckpointMeta.read(Path(checkpoint))
        model = build_gpt_model(meta.model_spec, Layout(1, 1, meta.vocab_divisor), torch.bfloat16, layer_spec="local")
        load_converted(model, checkpoint)
        held = [*model.named_parameters(), *model.named_buffers()]
        out.append({name: (str(t.dtype), t.detach().float().tolist()) for name, t in held if ".mlp.router." in name})
        del model
    return out
