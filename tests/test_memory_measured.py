"""The memory estimator against measurement, not against itself.

One launch of 4 gloo processes (tests/workers_memory.py) builds real DeepSpeed engines from
toolkit.dsconfig configs around small megatron-core GPTModels, for ZeRO 0/1/2/3 at TP 1 and 2,
and ZeRO 0/1 at PP 2 (ZeRO-2/3 can't run with PP), in bf16 and fp32 and in both schedule modes
(a tiny Llama; a tiny Qwen3 too at a few of those layouts, for its q/k norms and head_dim; a tiny
Mixtral at DP4 x EP2, its experts partitioned over the expert-DP group),
and counts what each rank holds: parameters after step(), gradients after each backward (before
step()), optimizer states after the first step. The same launch counts the bytes saved for
backward with torch.autograd.graph.saved_tensors_hooks on CPU forward passes, with and without
recompute and sequence parallelism, and the peak on each stage of a 1F1B pipeline. Those engines also prove that
deepspeed.initialize builds from every generated config (ZeRO 0-3 x bf16/fp32 x both modes);
NVMe offload configs are only parse-checked (tests/test_dsconfig_oracle.py): DeepSpeed's async
I/O op needs the libaio headers, which this machine lacks.
"""

from __future__ import annotations

import pytest

from tests.workers_memory import SEQ, tiny_spec
from toolkit.dsconfig import Setup, build
from toolkit.layouts import Layout
from toolkit.memory import CPU_LOCAL, estimate
from toolkit.memory import activations as act
from toolkit.memory.lora import activation_change, adapter_numels
from toolkit.memory.params import stage_param_numels
from toolkit.memory.states import ZeroSettings, combined, model_states
from toolkit.runtime.launch import run_on_processes

STATES_TOLERANCE = 0.10
ACTIVATION_TOLERANCE = 0.15
SEQUENCE_PARALLEL_TOLERANCE = 0.10  # issue 14's bar for the sequence-parallel rows
WORLD = 4
LORA_TOLERANCE = 0.05  # issue 12's acceptance for a LoRA layout
MOE_TOLERANCE = 0.05  # issue 11's acceptance for an MoE layout
LORA_ALL = dict(r=4, targets=["all-linear"])
LORA_QV = dict(r=8, targets=["q_proj", "v_proj"])


def _cases():
    states = []
    for zero in range(4):
        states += [
            dict(tp=1, pp=1, zero=zero, precision="bf16", schedule="deepspeed", micro_batches=2),
            dict(tp=1, pp=1, zero=zero, precision="fp32", schedule="megatron", micro_batches=2),
            dict(tp=2, pp=1, zero=zero, precision="bf16", schedule="megatron", micro_batches=2),
            dict(tp=2, pp=1, zero=zero, precision="fp32", schedule="deepspeed", micro_batches=2),
        ]
    for zero in (0, 1):
        states += [
            dict(tp=1, pp=2, zero=zero, precision="bf16", schedule="megatron", micro_batches=4),
            dict(tp=2, pp=2, zero=zero, precision="fp32", schedule="megatron", micro_batches=4),
        ]
    # Qwen3: q/k norms (replicated over TP), head_dim 12 != hidden / heads 5, 12 heads over 2 KV heads
    qwen3 = [
        dict(tp=2, pp=1, zero=1, precision="bf16", schedule="megatron", micro_batches=2),
        dict(tp=2, pp=1, zero=3, precision="fp32", schedule="deepspeed", micro_batches=2),
        dict(tp=1, pp=2, zero=1, precision="bf16", schedule="megatron", micro_batches=4),
    ]
    offload = dict(offload_optimizer="cpu")
    states += [
        dict(tp=1, pp=1, zero=1, precision="bf16", schedule="megatron", micro_batches=2, **offload),
        dict(tp=1, pp=1, zero=2, precision="bf16", schedule="deepspeed", micro_batches=2, **offload),
        dict(tp=2, pp=1, zero=2, precision="bf16", schedule="megatron", micro_batches=2, **offload),
        dict(tp=1, pp=1, zero=3, precision="bf16", schedule="megatron", micro_batches=2, **offload),
        dict(tp=2, pp=1, zero=3, precision="bf16", schedule="deepspeed", micro_batches=2, offload_param="cpu", **offload),
    ]
    # fp16: DeepSpeed's ZeRO optimizers with the dynamic loss scaler (engine.backward scales)
    states += [dict(tp=tp, pp=1, zero=zero, precision="fp16", schedule="deepspeed", micro_batches=2)
               for tp, zero in ((1, 1), (2, 2), (1, 3))]
    states = [dict(c, variant="llama") for c in states] + [dict(c, variant="qwen3") for c in qwen3]
    # LoRA: the base frozen (weights only), the adapter with gradients, fp32 master and Adam states
    states += [dict(c, variant="llama", lora=lora) for c, lora in (
        (dict(tp=2, pp=1, zero=1, precision="bf16", schedule="megatron", micro_batches=2), LORA_ALL),
        (dict(tp=1, pp=1, zero=2, precision="fp32", schedule="megatron", micro_batches=2), LORA_QV),
        (dict(tp=1, pp=1, zero=3, precision="bf16", schedule="megatron", micro_batches=2), LORA_ALL),
        (dict(tp=1, pp=2, zero=1, precision="bf16", schedule="megatron", micro_batches=4), LORA_QV),
    )]
    # MoE (issue 11): a tiny Mixtral (6 experts, top-2) at DP4 x EP2, so the experts are partitioned
    # over an expert-DP group of 2 and the dense weights (router included) over DP 4
    states += [dict(tp=1, pp=1, ep=2, zero=zero, precision=p, schedule="megatron", micro_batches=2, variant="mixtral")
               for zero, p in ((1, "bf16"), (2, "bf16"), (2, "fp32"))]
    # PyTorch FSDP2 (parallel.dp_engine=fsdp): fp32 masters sharded over DP, bf16 or fp32 compute
    states += [dict(tp=tp, pp=1, precision=p, micro_batches=2, variant=v, dp_engine="fsdp")
               for tp, p, v in ((1, "bf16", "llama"), (2, "bf16", "qwen3"), (2, "fp32", "llama"))]
    activations = [dict(tp=tp, pp=1, precision=p, recompute=r, micro=2, variant="llama")
                   for tp, p in ((1, "bf16"), (1, "fp32"), (2, "bf16")) for r in act.RECOMPUTE]
    # Qwen3: per-head q/k norms, head_dim 12 != hidden / heads, 12 heads over 2 KV heads
    activations += [dict(tp=tp, pp=1, precision=p, recompute=r, micro=2, variant="qwen3")
                    for tp, p in ((1, "bf16"), (1, "fp32"), (2, "bf16")) for r in ("none", "selective")]
    activations += [dict(tp=tp, pp=1, precision=p, recompute="none", micro=2, variant="llama", lora=lora)
                    for tp, p, lora in ((1, "bf16", LORA_ALL), (2, "fp32", LORA_QV))]
    # Phi-4-mini: RoPE on 12 of 16 dimensions per head, so smaller cos / sin
    activations += [dict(tp=tp, pp=1, precision="bf16", recompute="none", micro=2, variant="phi4-mini") for tp in (1, 2)]
    # Sequence parallelism: norms, residuals and the linears' saved inputs split over TP
    activations += [dict(tp=2, pp=1, precision=p, recompute=r, micro=2, variant=v, sequence_parallel=True)
                    for v, p, r in (("llama", "bf16", "none"), ("llama", "fp32", "none"), ("llama", "bf16", "selective"),
                                    ("llama", "bf16", "full"), ("qwen3", "bf16", "none"))]
    # MoE: the router, the alltoall dispatcher's permuted tokens and every token's k expert passes
    activations += [dict(tp=1, pp=1, precision=p, recompute="none", micro=2, variant=v)
                    for v in ("mixtral", "qwen3-moe") for p in ("bf16", "fp32")]
    # MoE under TP 2 with sequence parallelism (mandatory for MoE with TP): the routers see the
    # rank's sequence shard, the experts the TP group's routed rows (expert TP = TP); at EP 1 and EP 2
    # (the same tokens on both DP ranks, so the EP 2 ranks' mean is the EP 1 figure of that case)
    activations += [dict(tp=2, pp=1, precision=p, recompute="none", micro=2, variant=v, sequence_parallel=True, ep=ep)
                    for v, p, ep in (("mixtral", "fp32", 1), ("qwen3-moe", "bf16", 1), ("mixtral", "bf16", 2),
                                     ("qwen3-moe", "fp32", 2))]
    # Multi-latent attention (DeepSeek-V3: a dense first layer, MoE ones with a shared expert): the latents'
    # norms, q / k of qk + pos dims and v of v_head_dim; a low-rank and a full query
    activations += [dict(tp=1, pp=1, precision=p, recompute=r, micro=2, variant=v)
                    for v, p, r in (("deepseek-v3", "bf16", "none"), ("deepseek-v3-full-q", "fp32", "selective"))]
    pipeline = [dict(tp=1, pp=2, precision="bf16", micro=2, micro_batches=4, variant=v) for v in ("llama", "qwen3")]
    # interleaved 1F1B: two chunks of one layer per rank, stage 0 holding five chunk-forwards at its peak
    pipeline += [dict(tp=1, pp=2, vpp=2, precision="bf16", micro=2, micro_batches=4, variant="llama")]
    return states, activations, pipeline


@pytest.fixture(scope="module")
def measured():
    per_rank = run_on_processes("tests.workers_memory:measure_all", WORLD, *_cases())
    return {key: [dict(r, rank=rank) for rank, out in enumerate(per_rank) for r in out[key]]
            for key in ("states", "activations", "pipeline")}


def _label(r: dict) -> str:
    offload = f" offload {r.get('offload_optimizer')}/{r.get('offload_param', 'none')}" if "offload_optimizer" in r else ""
    ep = f" EP{r['ep']}" if "ep" in r else ""
    return (f"{r['variant']} ZeRO-{r['zero']} {r['precision']} TP{r['tp']} PP{r['pp']}{ep} {r['schedule']}{offload} "
            f"rank {r['rank']}")


def _on_device(measured: dict) -> list[dict]:
    """Full fine-tuning without offload, dense models."""
    return [r for r in measured["states"]
            if "offload_optimizer" not in r and "lora" not in r and "ep" not in r and "dp_engine" not in r]


def _lora(r: dict):
    from toolkit.memory.lora import LoraShape

    return LoraShape(r["lora"]["r"], tuple(r["lora"]["targets"])) if "lora" in r else None


@pytest.mark.multiprocess
def test_engines_build_and_step_from_generated_configs_at_every_zero_stage(measured):
    built = {(r["zero"], r["precision"], r["schedule"]) for r in _on_device(measured)}
    assert built == {(z, p, s) for z in range(4) for p in ("bf16", "fp32") for s in ("deepspeed", "megatron")} | {
        (z, "fp16", "deepspeed") for z in (1, 2, 3)}
    for r in [r for r in measured["states"] if "dp_engine" not in r]:
        assert r["global_steps"] == 1, _label(r)  # one optimizer step per global batch, in both modes
        assert r["lr_after_step"] > 0, _label(r)


@pytest.mark.multiprocess
def test_model_states_per_rank_match_what_each_rank_holds(measured):
    """Per rank: parameters + gradients + optimizer states within 10%; parameters and optimizer
    states each within 10%. Gradients too, except that a ZeRO-1/2 rank's gradient buffer holds
    whole tensors cut by a partition boundary: the estimate is the expectation over where
    boundaries fall, and one rank may differ from it by up to one tensor. Qwen3's rows check the
    q/k-norm parameters and its head_dim in the estimate."""
    rows = []
    assert {r["variant"] for r in _on_device(measured)} == {"llama", "qwen3"}
    for r in _on_device(measured):
        spec = tiny_spec(variant=r["variant"])
        m, p = r["measured"], r["predicted"]
        total_m, total_p = (m["params"] + m["grads"] + m["optimizer"]), (p["params"] + p["grads"] + p["optimizer"])
        rows.append(f"{_label(r):<51} measured {total_m:>9,} predicted {total_p:>9,} ({total_p / total_m - 1:+.1%})")
        assert abs(total_p / total_m - 1) <= STATES_TOLERANCE, rows[-1]
        for key in ("params", "optimizer"):
            assert abs(p[key] / m[key] - 1) <= STATES_TOLERANCE, (rows[-1], key, m, p)
        bytes_per = 4 if r["precision"] == "fp32" else 2
        largest = bytes_per * max(stage_param_numels(spec, r["tp"], r["pp"], r["stage"]))
        assert abs(p["grads"] - m["grads"]) <= max(STATES_TOLERANCE * m["grads"], largest), (rows[-1], m, p)
        assert m["unaccounted"] <= 16, (rows[-1], m)  # only scalars (grad norm, overflow flag)
    print("\n".join(rows))


@pytest.mark.multiprocess
def test_offloaded_states_add_up_to_what_the_ranks_hold(measured):
    """On this CPU-only machine the "GPU" and the host are the same RAM, so offload can only be
    checked in total: everything the engine holds (parameters, gradients, optimizer states and
    the offload staging buffers) against the estimate's GPU states plus its host memory. Where
    the estimate puts each part (GPU or host) follows DeepSpeed's code, not a measurement."""
    rows = []
    for r in [r for r in measured["states"] if "offload_optimizer" in r]:
        m, p = r["measured"], r["predicted"]
        held = m["params"] + m["grads"] + m["optimizer"]
        predicted = p["params"] + p["grads"] + p["optimizer"] + p["host"]
        rows.append(f"{_label(r):<62} held {held:>9,} predicted {predicted:>9,} ({predicted / held - 1:+.1%})")
        assert abs(predicted / held - 1) <= STATES_TOLERANCE, rows[-1]
        assert p["optimizer"] == 0 and p["host"] >= 12 * sum(stage_param_numels(tiny_spec(), r["tp"], 1, 0)) // 4
    assert len(rows) == 5 * WORLD
    print("\n".join(rows))


def _activation_row(r: dict, saved: dict) -> tuple[float, int, float, int, str]:
    """(per layer measured, predicted, whole model measured, predicted, label) of an activation
    case, `saved` its saved bytes per number of layers. Per layer = (saved bytes of a 4-layer model -
    of a 2-layer model) / 2, so the embedding and loss terms cancel out of the measurement."""
    spec, lora = tiny_spec(4, r["variant"]), _lora(r)
    per_layer = (saved[4] - saved[2]) / 2
    sp = r.get("sequence_parallel", False)
    shape = act.Shape(SEQ, r["micro"], r["tp"], 2 if r["precision"] == "bf16" else 4, sp)
    predicted = act.layer_bytes(spec, shape, CPU_LOCAL, r["recompute"])
    if lora is not None:
        predicted += activation_change(spec, lora, shape.tokens, r["tp"], shape.act_bytes)
    whole = estimate(spec, _setup(r), SEQ, r["recompute"], CPU_LOCAL, sp, lora=lora,
                     ep=r.get("ep", 1)).stages[0].activations
    label = (f"{r['variant']:<9} TP{r['tp']}{'-SP' if sp else '   '}{' EP' + str(r['ep']) if r.get('ep', 1) > 1 else ''} "
             f"{r['precision']} recompute {r['recompute']:<9}"
             f"{f' LoRA r={lora.r} ' + '+'.join(lora.target_modules) if lora else ''}")
    return per_layer, predicted, saved[4], whole, label


def _compared(label, per_layer, predicted, model, whole) -> str:
    return (f"{label}: per layer measured {per_layer:>9,.0f} predicted {predicted:>9,} ({predicted / per_layer - 1:+.1%}); "
            f"model measured {model:>9,.0f} predicted {whole:>9,} ({whole / model - 1:+.1%})")


def _rank_row(r: dict) -> tuple[str, tuple]:
    """One rank's comparison line and its (per layer measured, predicted, model measured, predicted)."""
    *figures, label = _activation_row(r, r["saved"])
    return _compared(f"{label} rank {r['rank']}", *figures), tuple(figures)


@pytest.mark.multiprocess
def test_activation_bytes_per_layer_match_saved_tensors(measured):
    """Per layer and for the whole model, per rank. The sequence-parallel rows (TP2-SP, MoE ones
    included) are held to 10%."""
    rows = []
    for r in [r for r in measured["activations"] if r.get("ep", 1) == 1]:
        row, (per_layer, predicted, model, whole) = _rank_row(r)
        rows.append(row)
        tolerance = SEQUENCE_PARALLEL_TOLERANCE if r.get("sequence_parallel") else ACTIVATION_TOLERANCE
        assert abs(predicted / per_layer - 1) <= tolerance, rows[-1]
        assert abs(whole / model - 1) <= tolerance, rows[-1]
    print("\n".join(rows))


@pytest.mark.multiprocess
def test_moe_activation_bytes_under_expert_parallelism_match_saved_tensors_on_average(measured):
    """TP 2 with SP x EP 2: how many routed rows an EP rank's experts get depends on where the router
    sends the tokens (here 3% to 8% apart between the EP ranks), and the estimate is the
    expectation, every token's k rows spread over the EP ranks: within 10% of the ranks' mean,
    per layer and for the whole model (each rank's figure printed)."""
    rows = []
    cases = [r for r in measured["activations"] if r.get("ep", 1) > 1]
    assert len(cases) == 2 * WORLD
    for key in sorted({(r["variant"], r["precision"]) for r in cases}):
        ranks = [r for r in cases if (r["variant"], r["precision"]) == key]
        rows += [_rank_row(r)[0] for r in ranks]
        mean = {n: sum(r["saved"][n] for r in ranks) / len(ranks) for n in (2, 4)}
        per_layer, predicted, model, whole, label = _activation_row(ranks[0], mean)
        rows.append(_compared(f"{label} mean of {len(ranks)} ranks", per_layer, predicted, model, whole))
        assert abs(predicted / per_layer - 1) <= SEQUENCE_PARALLEL_TOLERANCE, rows[-1]
        assert abs(whole / model - 1) <= SEQUENCE_PARALLEL_TOLERANCE, rows[-1]
    print("\n".join(rows))


@pytest.mark.multiprocess
def test_first_pipeline_stage_holds_pp_micro_batches_in_flight(measured):
    """1F1B: stage 0 runs PP forwards before its first backward, the last stage one. Interleaved
    (VPP 2): the peak chunk-forwards per rank follow megatron-core's warm-up and order."""
    peaks = {}
    for r in measured["pipeline"]:
        setup = _setup(r, pp=2, micro_batches=r["micro_batches"])
        spec = tiny_spec(variant=r["variant"])
        predicted = estimate(spec, setup, SEQ, "none", CPU_LOCAL).stages[r["stage"]].activations
        schedule = f"PP2 x VPP{r['vpp']}" if "vpp" in r else "1F1B"
        print(f"{r['variant']} {schedule} stage {r['stage']} rank {r['rank']}: peak measured {r['peak']:,} "
              f"predicted {predicted:,} ({predicted / r['peak'] - 1:+.1%})")
        assert abs(predicted / r["peak"] - 1) <= ACTIVATION_TOLERANCE, (r, predicted)
        if "vpp" not in r:
            peaks[r["variant"], r["stage"]] = r["peak"]
    # two layers per stage: stage 0 holds two micro-batches' worth, stage 1 one plus the loss
    for variant in ("llama", "qwen3"):
        spec = tiny_spec(variant=variant)
        loss = act.last_stage_bytes(spec, act.Shape(SEQ, 2, 1, 2), CPU_LOCAL, Layout(1, 2).padded_vocab(spec.vocab_size))
        assert peaks[variant, 0] > 1.5 * (peaks[variant, 1] - loss), variant


@pytest.mark.multiprocess
def test_lora_model_states_per_rank_match_what_each_rank_holds(measured):
    """A LoRA engine: parameters (the frozen base in the training dtype plus the adapter),
    gradients and optimizer states (the adapter's only) each within 5% of what each rank holds, and
    the optimizer states a small fraction of full fine-tuning's for the same layout."""
    rows = []
    lora_rows = [r for r in measured["states"] if "lora" in r]
    assert len(lora_rows) == 4 * WORLD
    for r in lora_rows:
        m, p = r["measured"], r["predicted"]
        total_m, total_p = (m["params"] + m["grads"] + m["optimizer"]), (p["params"] + p["grads"] + p["optimizer"])
        label = f"{_label(r)} LoRA r={r['lora']['r']} {'+'.join(r['lora']['targets'])}"
        rows.append(f"{label:<75} measured {total_m:>9,} predicted {total_p:>9,} ({total_p / total_m - 1:+.1%})")
        assert abs(total_p / total_m - 1) <= LORA_TOLERANCE, rows[-1]
        for key in ("params", "optimizer"):
            assert abs(p[key] / m[key] - 1) <= LORA_TOLERANCE, (rows[-1], key, m, p)
        # as for full fine-tuning: a ZeRO-1/2 gradient buffer keeps whole the tensors a partition
        # boundary cuts, so one rank may differ from the expectation by one (adapter) tensor
        bytes_per = 4 if r["precision"] == "fp32" else 2
        largest = bytes_per * max(adapter_numels(tiny_spec(), _lora(r), r["tp"], r["pp"]))
        assert abs(p["grads"] - m["grads"]) <= max(LORA_TOLERANCE * m["grads"], largest), (rows[-1], m, p)
        full = [f for f in _on_device(measured) if all(f[k] == r[k] for k in ("tp", "pp", "zero", "precision", "rank"))]
        for f in full:
            assert m["optimizer"] < 0.2 * f["measured"]["optimizer"], (rows[-1], f["measured"])
    print("\n".join(rows))


@pytest.mark.multiprocess
def test_fsdp_model_states_per_rank_match_what_each_rank_holds_and_compare_with_zero3(measured):
    """FSDP2's sharded fp32 parameters, gradients and AdamW moments within 10% per rank (and in
    total); against ZeRO-3 the same 16 bytes per parameter in bf16 and 4 fewer in fp32."""
    rows = []
    fsdp = [r for r in measured["states"] if r.get("dp_engine") == "fsdp"]
    assert len(fsdp) == 3 * WORLD
    for r in fsdp:
        m, p, z = r["measured"], r["predicted"], r["zero3"]
        total_m, total_p, total_z = (sum(d[k] for k in ("params", "grads", "optimizer")) for d in (m, p, z))
        rows.append(f"FSDP {r['variant']} {r['precision']} TP{r['tp']} rank {r['rank']}: measured {total_m:>9,} "
                    f"predicted {total_p:>9,} ({total_p / total_m - 1:+.1%}); ZeRO-3 estimate {total_z:>9,}")
        assert r["lr_after_step"] > 0
        assert abs(total_p / total_m - 1) <= STATES_TOLERANCE, rows[-1]
        for key in ("params", "grads", "optimizer"):
            assert abs(p[key] / m[key] - 1) <= STATES_TOLERANCE, (rows[-1], key, m, p)
        # ZeRO-3 also keeps its small parameters (below the persistence threshold) whole on every rank
        if r["precision"] == "bf16":
            assert abs(total_p / total_z - 1) <= STATES_TOLERANCE, rows[-1]
        else:
            assert total_p < 0.9 * total_z, rows[-1]
    print("\n".join(rows))


@pytest.mark.multiprocess
def test_moe_model_states_per_rank_match_what_each_rank_holds(measured):
    """Issue 11: at DP4 x EP2 each rank holds 3 of the 6 experts, whose gradients, fp32 masters and
    Adam moments ZeRO partitions over the expert-DP group (2 ranks), while the dense weights and
    the router are partitioned over DP 4: parameters + gradients + optimizer states within 5% per
    rank, parameters and optimizer states each within 5%. The same model estimated at EP1 (every
    expert on every rank), or with the experts' states partitioned over all of DP, is off by far
    more than that (-23% for the latter at ZeRO-2 bf16)."""
    rows = []
    moe_rows = [r for r in measured["states"] if "ep" in r]
    assert len(moe_rows) == 3 * WORLD
    for r in moe_rows:
        spec = tiny_spec(variant=r["variant"])
        m, p = r["measured"], r["predicted"]
        total_m, total_p = (m["params"] + m["grads"] + m["optimizer"]), (p["params"] + p["grads"] + p["optimizer"])
        rows.append(f"{_label(r):<56} measured {total_m:>9,} predicted {total_p:>9,} ({total_p / total_m - 1:+.1%}); "
                    f"params {m['params']:,}/{p['params']:,} grads {m['grads']:,}/{p['grads']:,} "
                    f"optimizer {m['optimizer']:,}/{p['optimizer']:,}")
        assert abs(total_p / total_m - 1) <= MOE_TOLERANCE, rows[-1]
        for key in ("params", "optimizer"):
            assert abs(p[key] / m[key] - 1) <= MOE_TOLERANCE, (rows[-1], key)
        bytes_per = 4 if r["precision"] == "fp32" else 2
        largest = bytes_per * max(stage_param_numels(spec, 1, 1, 0, r["ep"]))
        assert abs(p["grads"] - m["grads"]) <= max(MOE_TOLERANCE * m["grads"], largest), rows[-1]
        setup = Setup(gpus=WORLD, zero=r["zero"], precision=r["precision"], micro_batch=2,
                      global_batch=2 * r["micro_batches"] * WORLD, schedule=r["schedule"])
        as_dense = estimate(spec, setup, SEQ, kernels=CPU_LOCAL, reserve=0).stages[0].states  # experts over DP 4, all 6
        assert abs(as_dense.params / m["params"] - 1) > 4 * MOE_TOLERANCE, (rows[-1], as_dense)
        # and the experts' states partitioned over all of DP (4) instead of the expert-DP group (2)
        zero = ZeroSettings.from_config(build(setup, spec))
        numels = {part: stage_param_numels(spec, 1, 1, 0, r["ep"], part) for part in ("dense", "experts")}
        over_dp = combined(*(model_states(numels[part], bytes_per, WORLD, zero, r["micro_batches"]) for part in numels))
        assert abs((over_dp.params + over_dp.grads + over_dp.optimizer) / total_m - 1) > 2 * MOE_TOLERANCE, rows[-1]
    print("\n".join(rows))


def _setup(r: dict, pp: int = 1, micro_batches: int = 1) -> Setup:
    dp = WORLD // (r["tp"] * pp)
    return Setup(gpus=WORLD, tp=r["tp"], pp=pp, vpp=r.get("vpp", 1), zero=1, precision=r["precision"], micro_batch=r["micro"],
                 global_batch=r["micro"] * micro_batches * dp, schedule="megatron")


@pytest.mark.multiprocess
def test_deepspeeds_own_estimators_on_the_same_models(measured):
    """DeepSpeed's estimate_zero2/zero3_model_states_mem_needs on the measured pure-DP bf16 runs.

    Why they differ from what a rank holds (and from ours):
    * ZeRO-2: DeepSpeed counts 2 + 18/N bytes per parameter, where 18 = 2 (bf16 grads) + 4 (fp32
      grads) + 4 (fp32 master) + 8 (Adam). The fp32 gradient partition exists only inside step()
      (stage_1_and_2.py builds it and frees it after the update), so it is not resident; our
      estimate puts it under buffers. DeepSpeed also ignores the whole boundary tensors a
      partition's gradient buffer keeps.
    * ZeRO-3: DeepSpeed counts 4L + 18/N, with L the largest layer gathered in 16 bits (param and
      grad). It omits the rank's own 16-bit parameter partition and the parameters kept whole
      under stage3_param_persistence_threshold, and counts the fp32 gradients (freed after each
      sub-group's step) and the gathered layer (transient) as resident.
    Neither estimator knows TP or PP, so only TP1 PP1 runs are compared."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    spec = tiny_spec()
    numels = stage_param_numels(spec, 1, 1, 0)
    rows = []
    for r in _on_device(measured):
        if (r["variant"], r["tp"], r["pp"], r["precision"], r["zero"]) not in {("llama", 1, 1, "bf16", 2),
                                                                               ("llama", 1, 1, "bf16", 3)}:
            continue
        m, p = r["measured"], r["predicted"]
        held = m["params"] + m["grads"] + m["optimizer"]
        ours = p["params"] + p["grads"] + p["optimizer"]
        if r["zero"] == 2:
            _, theirs = estimate_zero2_model_states_mem_needs(sum(numels), WORLD, 1, cpu_offload=False)
            fp32_grads = 4 * sum(numels) // WORLD
            assert abs(theirs - (held + fp32_grads)) / theirs < 0.05  # the same terms once fp32 grads are added
        else:
            _, theirs, _ = estimate_zero3_model_states_mem_needs(sum(numels), max(numels), WORLD, 1, cpu_offload=False,
                                                                 cpu_offload_params=False)
        rows.append(f"ZeRO-{r['zero']} rank {r['rank']}: held {held:,}  ours {ours:,} ({ours / held - 1:+.1%})  "
                    f"DeepSpeed {theirs:,} ({theirs / held - 1:+.1%})")
        assert abs(ours / held - 1) <= abs(theirs / held - 1) + 0.01, rows[-1]
    assert len(rows) == 2 * WORLD
    print("\n".join(rows))
