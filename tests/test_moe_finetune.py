"""Fine-tuning a Mixture-of-Experts model with expert parallelism (parallel.ep).

The reference is the single-process HF model (tests/finetune_harness.py) with the router's
load-balancing loss in megatron-core's per-layer form (tests/moe_reference.py), its coefficient
raised to 0.1 so that a wrong aux gradient shows (HF's own output_router_logits loss where the run
uses moe.aux_loss=hf). Every run routes in fp64 (moe.router_dtype=fp64, megatron-core's
moe_router_dtype) and so does the reference's router (tests/moe_reference.py route_in_fp64): the
runs route every token as the reference does (tokens_per_expert compared at every step), and all
10 steps are compared. Each layout is one launch of the real recipe; the DP2 x EP2 launch doubles as
the uninterrupted run of the SIGKILL/resume test and of a resume at EP1 from its checkpoint
resharded with `ckpt reshard --ep 1`; the TP2 x CP2 x EP2 one runs the allgather
dispatcher under context parallelism (each EP group a CP group), and the TP2 x PP2 x DP2 x EP2 one exports to HF, whose experts and router rows are then
compared one by one with the reference's. Qwen2-MoE (moe.aux_loss=hf) and OLMoE (allgather) have one
DP2 x EP2 launch each, compared expert by expert too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoTokenizer

from tests.finetune_harness import (GRAD_NORM_TOLERANCE, LOSS_TOLERANCE_FP32, RECIPE, STEPS, ReferenceCache, differences,
                                    hf_reference, launch, read_metrics, recipe, write_uneven_data)
from tests.moe_reference import moe_step_loss, route_in_fp64
from tests.finetune_harness import kill_tree, wait_for
from toolkit.convert import hf_to_megatron

AUX_LOSS_COEF = 0.1
SAVE_EVERY = 5
# The recipe's moe section in every run here: the router in fp64 on both sides (see the docstring).
FP64_ROUTER = {"router_dtype": "fp64"}


def moe_setup(root, variant):
    """A tiny fp32 MoE model of `variant` (a vocab of 250 padded to 256, the aux loss coefficient
    raised) in torch_dist, uneven data, and the HF reference (computed once)."""
    from toolkit.tinymodels import make_tiny_model

    hf = make_tiny_model(variant, root / "hf", dtype="float32", vocab_size=250, router_aux_loss_coef=AUX_LOSS_COEF)
    mc = hf_to_megatron(hf, root / "mc", fmt="torch_dist", progress=False)
    data = write_uneven_data(root / "data.jsonl", 300)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    cache = ReferenceCache()

    def reference(cfg_path):
        """(losses, grad norms, {step: the routers' and experts' weights}, per step the smallest
        top-k margin of any token, per step the tokens routed to each expert of each layer) of the
        HF reference for the recipe at cfg_path: its steps, its moe.aux_loss (the load-balancing
        loss) and moe.router_dtype (fp64: the reference's routers too), computed once per recipe."""
        cfg = yaml.safe_load(cfg_path.read_text())
        moe = {"aux_loss": "megatron", "router_dtype": None, **cfg.get("moe", {})}

        def compute():
            states = {}

            def keep(step, model):
                states[step] = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()
                                if is_routed(name)}

            step_loss = moe_step_loss(pad, moe["aux_loss"])
            losses, norms = hf_reference(hf, data, cfg_path, cfg["steps"], step_loss=step_loss, on_step=keep,
                                         prepare=route_in_fp64 if moe["router_dtype"] == "fp64" else None)
            return losses, norms, states, step_loss.margins, step_loss.routing

        return cache.get(cfg_path, compute, hf)

    return hf, mc, data, reference


def is_routed(name: str) -> bool:
    """An HF MoE layer's router ([experts, hidden]) or its routed experts (stacked [experts, ...])."""
    return ".mlp.experts." in name or name.endswith(".mlp.gate.weight")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """Mixtral: 6 experts, top-2."""
    return moe_setup(tmp_path_factory.mktemp("moe-ft"), "mixtral")


def run(moe, directory, nprocs, parallel, *overrides, env=None, script=RECIPE, moe_options=None, **settings):
    """One launch of `script` with the recipe's moe section FP64_ROUTER plus `moe_options`."""
    hf, mc, data, reference = moe
    directory.mkdir(exist_ok=True)
    cfg = recipe(directory, mc, data, parallel=parallel, moe={**FP64_ROUTER, **(moe_options or {})}, **settings)
    launch(nprocs, cfg, *overrides, env=env, script=script)
    return cfg, read_metrics(directory / "run")


# DP2 x EP2 (2 processes, alltoall) is the uninterrupted run of the resume test below.
# TP2 x CP2 x EP2 runs megatron-core's allgather token dispatcher (moe.dispatcher), the others alltoall;
# its EP groups are CP groups (rank order tp-cp-ep-dp-pp): the dispatch swaps the chunks of one sequence,
# the aux loss counts tokens over the router's TP x CP group, and Mixtral's windows of 8 reach across
# the chunks of 6 (24 tokens over 2 x CP).
# The 8-process run also exports to HF (export_hf=True) from its per-(TP, PP, EP) rank model/ files,
# and its experts and routers are compared with the reference's one by one.
LAYOUTS = {
    # DP 1: micro-batches of 4 keep the 4 per step of the DP 2 layouts (each costs a dispatch per layer)
    "TP2xCP2xEP2-allgather": (4, {"tp": 2, "cp": 2, "ep": 2, "sequence_parallel": True}, False, {"dispatcher": "allgather"},
                              {"micro_batch": 4}),
    "TP2xPP2xDP2xEP2": (8, {"tp": 2, "pp": 2, "ep": 2, "sequence_parallel": True}, True, {}, {}),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_fine_tune_matches_hf_reference_with_aux_loss(moe, tmp_path, layout):
    nprocs, parallel, export_hf, options, settings = LAYOUTS[layout]
    cfg, metrics = run(moe, tmp_path, nprocs, {"zero_stage": 1, **parallel}, moe_options=options, export_hf=export_hf,
                       **settings)
    assert len(metrics) == STEPS
    reference = moe[3](cfg)
    print(f"{layout}: reference's closest top-k margin per step {[f'{m:.1e}' for m in reference[3]]}")
    assert_routed_as_the_reference(metrics, reference)
    loss, norm = differences(metrics, *reference[:2])
    print(f"{layout}: max |loss - reference| {loss:.1e}, grad norm relative {norm:.1e}")
    assert loss < LOSS_TOLERANCE_FP32 and norm < GRAD_NORM_TOLERANCE, (layout, loss, norm)
    assert_tokens_per_expert_cover_every_routed_token(moe, metrics)
    assert_ran_with(tmp_path / "run", options)
    if export_hf:
        assert_hf_export_holds_every_ranks_trained_experts(moe[0], tmp_path / "run")
        assert_every_expert_trained_as_in_reference(moe[0], tmp_path / "run", reference[2][STEPS], layout)


def assert_routed_as_the_reference(metrics, reference):
    """Every step's logged tokens_per_expert ([layer][expert]) is the reference's routing."""
    for m, routing in zip(metrics, reference[4], strict=True):
        assert m["tokens_per_expert"] == routing, (f"step {m['step']} routed otherwise than the reference",
                                                   m["tokens_per_expert"], routing)


def assert_ran_with(run_dir, options):
    """The run's resolved config holds the moe options it was given, and the router in fp64."""
    import json

    resolved = json.loads((run_dir / "resolved_config.json").read_text())["config"]["moe"]
    assert {**FP64_ROUTER, **options}.items() <= resolved.items(), (options, resolved)


# Per expert (and per router row): |run's change - reference's change| / |reference's change| (L2) of
# its weights over the run, the changes taken from the original HF weights. Measured up to 5.2e-6 in
# fp32 over 10 steps at TP2 x PP2 x DP2 x EP2; the guard below (experts reduced over the wrong
# group) gives 0.39 to 13 after 3 steps.
EXPERT_TOLERANCE = 1e-4


def expert_errors(original_hf, run_dir, reference_state) -> dict[str, float]:
    """Every layer's every routed expert (a slice of the stacked gate_up_proj / down_proj) and every
    row of its router (row e: expert e's logit), from the run's HF export against the reference's
    weights after the same steps. Weight changes after several Adam steps follow each step's
    gradient of that expert, so a gradient reduced over the wrong ranks, or an expert put on the
    wrong EP rank, shows in that expert's entry."""
    before, after = hf_state(original_hf), hf_state(run_dir / "hf")
    errors = {}
    for name, reference in reference_state.items():
        for expert in range(reference.shape[0]):
            change = reference[expert] - before[name][expert]
            off = (after[name][expert] - before[name][expert]) - change
            errors[f"{name}[{expert}]"] = float(off.norm() / change.norm())
    return errors


def assert_every_expert_trained_as_in_reference(original_hf, run_dir, reference_state, label):
    errors = expert_errors(original_hf, run_dir, reference_state)
    layers = {name.split(".mlp.")[0] for name in errors}
    assert len(layers) == 4 and len(errors) == 4 * 3 * len(next(iter(reference_state.values()))), sorted(errors)
    worst = max(errors, key=errors.get)
    print(f"{label}: {len(errors)} experts and router rows, worst {worst} {errors[worst]:.1e}")
    assert errors[worst] < EXPERT_TOLERANCE, (worst, errors[worst])


def assert_hf_export_holds_every_ranks_trained_experts(original_hf, run_dir):
    """The run's HF export loads with from_pretrained, every expert of every layer (each on one of the
    EP ranks of one of the stages) trained, and its tensors are bit for bit the fp32 master weights
    of the run's layout-independent state (train/: whole tensors written through megatron-core's
    sharded keys, a path apart from the per-rank model/ files the export merged)."""
    from safetensors.torch import load_file

    from toolkit.convert import dist_format
    from toolkit.train import checkpoint

    before, after = hf_state(original_hf), hf_state(run_dir / "hf")
    experts = [name for name in after if ".mlp.experts." in name]
    assert len(experts) == 2 * 4, experts  # [experts, ...] stacked per layer: gate_up_proj, down_proj
    assert all(trained(before[name], after[name], True) for name in experts)

    exported = load_file(str(run_dir / "hf" / "model.safetensors"))
    train = checkpoint.find_latest(run_dir) / "train"
    stored = dist_format.tensor_shapes(train)

    def master(key):
        shape, dtype = stored["fp32." + key]
        return dist_format.read_box(train, "fp32." + key, (0,) * len(shape), shape, dtype)

    experts_key = "decoder.layers.mlp.experts.experts."
    embedding, router = master("embedding.word_embeddings.weight"), master("decoder.layers.mlp.router.weight")
    fc1, fc2 = master(experts_key + "linear_fc1.weight"), master(experts_key + "linear_fc2.weight")
    assert torch.equal(exported["model.embed_tokens.weight"], embedding[:250])
    width = fc2.shape[-1]
    for layer in range(4):
        prefix = f"model.layers.{layer}.block_sparse_moe."
        assert torch.equal(exported[prefix + "gate.weight"], router[layer])
        for expert in range(6):
            name = f"{prefix}experts.{expert}."
            assert torch.equal(exported[name + "w1.weight"], fc1[layer, expert, :width]), name
            assert torch.equal(exported[name + "w3.weight"], fc1[layer, expert, width:]), name
            assert torch.equal(exported[name + "w2.weight"], fc2[layer, expert]), name


def assert_tokens_per_expert_cover_every_routed_token(moe, metrics):
    """Logged load balance: per layer, the non-padding input tokens of the step's global batch x top-k
    (summed over DP, the TP ranks' sequence shards and the stages), spread over every expert."""
    from transformers import AutoConfig

    from tests.finetune_harness import reference_samples

    hf, _, data, _ = moe
    config = AutoConfig.from_pretrained(hf)
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    topk = config.num_experts_per_tok
    lengths = [min(len(tokens), 24) for tokens, _ in reference_samples(AutoTokenizer.from_pretrained(hf), data, 25)]
    for m in metrics:
        table = m["tokens_per_expert"]
        real = sum(lengths[i % len(lengths)] for i in range((m["step"] - 1) * 16, m["step"] * 16))
        assert len(table) == config.num_hidden_layers and all(len(row) == experts and sum(row) == topk * real
                                                               for row in table), (m["step"], table, real)


# Per family, the HF tensors (a substring of their names) that must have trained: every one changed
# in the run's HF export (run/hf, written from the per-(TP, PP, EP) rank model/ files).
FAMILY_TRAINED = {
    "qwen2-moe": ("mlp.shared_expert.", "mlp.shared_expert_gate.weight", "mlp.experts.", "mlp.gate.weight"),
    "olmoe": ("self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.experts.", "mlp.gate.weight"),
}
# Per family, the recipe's MoE options of its launch (moe.aux_loss, moe.dispatcher), so that each
# runs at DP2 x EP2 with no launch of its own: HF's load-balancing loss (the reference then adds
# HF's own output_router_logits aux_loss) and the allgather dispatcher.
FAMILY_MOE_OPTIONS = {"qwen2-moe": {"aux_loss": "hf"}, "olmoe": {"dispatcher": "allgather"}}


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", list(FAMILY_TRAINED))
def test_dp2_ep2_fine_tune_of_qwen2_moe_and_olmoe_matches_hf_reference_with_aux_loss(tmp_path, variant):
    """Qwen2-MoE's shared expert and its sigmoid gate (trained with HF's load-balancing loss), OLMoE's
    q/k norms over the whole projection (through the allgather dispatcher), under EP 2: the HF
    reference's losses and gradient norms, each of those tensors trained, and every expert and
    router row as the reference's."""
    (tmp_path / "model").mkdir()
    setup = moe_setup(tmp_path / "model", variant)
    options = FAMILY_MOE_OPTIONS[variant]
    cfg, metrics = run(setup, tmp_path, 2, {"zero_stage": 1, "ep": 2}, moe_options=options, export_hf=True)
    assert len(metrics) == STEPS
    reference = setup[3](cfg)
    assert_routed_as_the_reference(metrics, reference)
    loss, norm = differences(metrics, *reference[:2])
    print(f"{variant} DP2xEP2 {options}: max |loss - reference| {loss:.1e}, grad norm relative {norm:.1e}")
    assert loss < LOSS_TOLERANCE_FP32 and norm < GRAD_NORM_TOLERANCE, (variant, loss, norm)
    assert_tokens_per_expert_cover_every_routed_token(setup, metrics)
    assert_ran_with(tmp_path / "run", options)
    assert_every_expert_trained_as_in_reference(setup[0], tmp_path / "run", reference[2][STEPS], variant)
    before, after = hf_state(setup[0]), hf_state(tmp_path / "run" / "hf")
    assert before.keys() == after.keys()
    for part in FAMILY_TRAINED[variant]:
        names = [name for name in before if part in name]
        assert names and all(trained(before[n], after[n], ".experts." in n) for n in names), (variant, part)


def trained(before: torch.Tensor, after: torch.Tensor, per_expert: bool) -> bool:
    """Moved further than weight decay alone moves it (at most lr x weight_decay per step, recipe()'s
    2e-3 x 0.1 over the 10 steps), each expert of a stacked [experts, ...] tensor on its own."""
    if per_expert:
        return all(trained(b, a, False) for b, a in zip(before, after))
    return float((after - before).abs().max()) > 2e-3 * 0.1 * STEPS * float(before.abs().max())


def hf_state(hf_dir) -> dict:
    """The state dict of the model HF's own from_pretrained loads from `hf_dir`, nothing missing or unused."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    return model.state_dict()


GUARD_STEPS = 3


@pytest.mark.multiprocess
def test_expert_grads_reduced_over_all_of_dp_break_parity(moe, tmp_path):
    """Guard: the same DP2 x EP2 run with all of DP handed to DeepSpeed as the experts' data-parallel
    group: their gradients are then averaged with another EP rank's experts (and ZeRO partitions them
    over ranks holding different experts). Losses and gradient norms leave the reference, and so does
    every expert in the expert-by-expert comparison."""
    cfg, metrics = run(moe, tmp_path, 2, {"zero_stage": 1, "ep": 2}, steps=GUARD_STEPS, export_hf=True,
                       script=Path(__file__).parent / "recipe_experts_over_all_dp.py")
    reference = moe[3](cfg)
    loss, norm = differences(metrics, *reference[:2])
    print(f"experts reduced over all of DP: max |loss - reference| {loss:.1e}, grad norm relative {norm:.1e}")
    assert loss > 100 * LOSS_TOLERANCE_FP32 and norm > 100 * GRAD_NORM_TOLERANCE, (loss, norm)
    errors = expert_errors(moe[0], tmp_path / "run", reference[2][GUARD_STEPS])
    experts = {name: error for name, error in errors.items() if ".mlp.experts." in name}
    print(f"experts reduced over all of DP: expert errors from {min(experts.values()):.1e} to {max(experts.values()):.1e}")
    assert all(error > 100 * EXPERT_TOLERANCE for error in experts.values()), experts


@pytest.mark.multiprocess
def test_router_left_out_of_the_tp_sum_breaks_parity(moe, tmp_path):
    """Guard: the TP2 x CP2 x EP2 allgather layout above with the routers' weights left out of the TP
    sum of sequence-parallel gradients (tests/recipe_with_defect.py): each TP rank's
    router learns from its own half of the tokens, and nothing else is wrong. The fp64 routing keeps
    the comparison step for step, so this small router-gradient bug fails it."""
    nprocs, parallel, _, options, settings = LAYOUTS["TP2xCP2xEP2-allgather"]
    cfg, metrics = run(moe, tmp_path, nprocs, {"zero_stage": 1, **parallel}, moe_options=options, steps=GUARD_STEPS, **settings,
                       script=Path(__file__).parent / "recipe_with_defect.py", env={"DEFECT": "no-tp-sum:.router."})
    loss, norm = differences(metrics, *moe[3](cfg)[:2])
    print(f"router left out of the TP sum: max |loss - reference| {loss:.1e}, grad norm relative {norm:.1e}")
    assert loss > 10 * LOSS_TOLERANCE_FP32 or norm > 10 * GRAD_NORM_TOLERANCE, (loss, norm)


@pytest.mark.multiprocess
def test_dp2_ep2_matches_reference_and_resumes_after_sigkill_exactly_with_every_ep_ranks_experts(moe, tmp_path):
    parallel = {"zero_stage": 1, "ep": 2}
    straight_cfg, straight = run(moe, tmp_path / "straight", 2, parallel, save_every=SAVE_EVERY)
    loss, norm = differences(straight, *moe[3](straight_cfg)[:2])
    print(f"DP2xEP2: max |loss - reference| {loss:.1e}, grad norm relative {norm:.1e}")
    assert loss < LOSS_TOLERANCE_FP32 and norm < GRAD_NORM_TOLERANCE, (loss, norm)
    release = tmp_path / "straight" / "run" / "checkpoints" / "step_0000010" / "model" / "release"
    assert sorted(p.name for p in release.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"], "one file per EP rank"

    hf, mc, data, _ = moe
    killed = tmp_path / "killed"
    killed.mkdir()
    flag = tmp_path / "paused"
    cfg = recipe(killed, mc, data, parallel=parallel, moe=FP64_ROUTER, save_every=SAVE_EVERY)
    proc = launch(2, cfg, env={"TOOLKIT_FAULT_PAUSE": f"checkpoint-before-marker@2:{flag}"}, wait=False)
    wait_for(flag.exists, proc)
    kill_tree(proc.pid)
    proc.wait()
    assert (killed / "run" / "checkpoints" / "latest").read_text() == "step_0000005"

    launch(2, cfg, "resume=auto")
    resumed = read_metrics(killed / "run")
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in straight], "fp32 resume must be exact"
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in straight]
    assert_resumes_at_ep1_as_the_straight_run(moe, tmp_path, killed / "run", straight)


def assert_resumes_at_ep1_as_the_straight_run(moe, tmp_path, run_dir, straight):
    """The step-5 checkpoint of DP2 x EP2, resharded offline to EP1 (`toolkit ckpt reshard --ep 1`:
    its model/ exports the same HF weights), resumed at DP2 x EP1 ZeRO-2: each rank reads all the
    experts, their master weights and Adam moments, from train/ and repeats steps 6-10 of the
    straight run up to reduction order."""
    from safetensors.torch import load_file

    from toolkit.convert import megatron_to_hf
    from toolkit.train.reshard import reshard

    hf, mc, data, _ = moe
    saved = run_dir / "checkpoints" / "step_0000005"
    out = reshard(saved, tmp_path / "ep1", tp=1, pp=1, ep=1)
    exports = [megatron_to_hf(step / "model", tmp_path / name, progress=False)
               for name, step in (("hf-ep2", saved), ("hf-ep1", out / "checkpoints" / saved.name))]
    before, after = (load_file(next(Path(d).glob("*.safetensors"))) for d in exports)
    assert before.keys() == after.keys() and all(before[k].equal(after[k]) for k in before)

    (tmp_path / "ep1-config").mkdir()
    launch(2, recipe(tmp_path / "ep1-config", mc, data, parallel={"zero_stage": 2, "ep": 1}, moe=FP64_ROUTER,
                     run_dir=str(out)), "resume=auto")
    resumed = {m["step"]: m for m in read_metrics(out)}
    assert sorted(resumed) == list(range(SAVE_EVERY + 1, STEPS + 1))
    for key, tolerance in (("loss", 1e-6), ("grad_norm", 1e-5)):
        worst = max(abs(resumed[m["step"]][key] - m[key]) / abs(m[key]) for m in straight if m["step"] > SAVE_EVERY)
        print(f"DP2xEP2 -> (ckpt reshard --ep 1) -> DP2xEP1 ZeRO-2: max relative {key} difference, steps 6-10: "
              f"{worst:.1e}")
        assert worst <= tolerance, key


@pytest.mark.parametrize(
    "world, overrides, message",
    [
        (4, ["parallel.ep=4"], "6 experts cannot be split evenly over parallel.ep=4"),
        (6, ["parallel.ep=2", "parallel.tp=2"], r"parallel.ep=2 x parallel.tp=2 does not fit the TP x DP = 2 x 3 ranks"),
        (4, ["parallel.ep=2", "parallel.tp=2"], "needs sequence parallelism, as in megatron-core"),
        (4, ["parallel.ep=2", "parallel.zero_stage=3"], "zero_stage=3"),
        (4, ["parallel.pp=2", "moe.aux_loss=hf"], "moe.aux_loss=hf with PP=2: HF's loss pools router counts over all layers"),
    ],
)
def test_expert_layouts_that_do_not_fit_are_refused_in_one_line(moe, tmp_path, world, overrides, message):
    from toolkit.errors import ToolkitError
    from toolkit.train import build
    from toolkit.train.config import load_config

    hf, mc, data, _ = moe
    cfg = load_config(str(recipe(tmp_path, mc, data, global_batch=24)), overrides)
    with pytest.raises(ToolkitError, match=message) as refused:
        build.check_layout(cfg, world, build.read_checkpoint_meta(cfg))
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "run").exists()


def test_ep_on_a_dense_model_is_refused(tmp_path):
    from toolkit.errors import ToolkitError
    from toolkit.tinymodels import make_tiny_model
    from toolkit.train import build
    from toolkit.train.config import load_config

    hf = make_tiny_model("llama", tmp_path / "hf", dtype="float32")
    mc = hf_to_megatron(hf, tmp_path / "mc", fmt="torch_dist", progress=False)
    cfg = load_config(str(recipe(tmp_path, mc, write_uneven_data(tmp_path / "d.jsonl", 4))), ["parallel.ep=2"])
    with pytest.raises(ToolkitError, match="needs a Mixture-of-Experts model"):
        build.check_layout(cfg, 2, build.read_checkpoint_meta(cfg))


@pytest.mark.parametrize("override, message", [
    ("moe.dispatcher=flex", "moe.dispatcher='flex': must be one of alltoall, allgather, got 'flex'"),
    ("moe.aux_loss=switch", "moe.aux_loss='switch': must be one of megatron, hf, got 'switch'"),
    ("moe.router_dtype=fp16", "moe.router_dtype='fp16': must be one of fp32, fp64, got 'fp16'"),
])
def test_unknown_moe_option_is_refused_in_one_line(moe, tmp_path, override, message):
    from toolkit.errors import ToolkitError
    from toolkit.train.config import load_config

    hf, mc, data, _ = moe
    with pytest.raises(ToolkitError) as refused:
        load_config(str(recipe(tmp_path, mc, data)), [override])
    assert str(refused.value) == message
