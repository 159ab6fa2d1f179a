"""method=dpo matches TRL 1.16's real DPOTrainer step for step (fp32, CPU): losses and TRL's
rewards/* metrics within 1e-5, gradient norms within 1e-4 relative, for each loss type offered.

The reference (tests/dpo_reference.py) is computed in process once per recipe; each layout is one
launch of the real recipe. The guard trains TRL with chosen and rejected swapped in the pairs one
DP rank of DP2 would hold, and shows the comparison then fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.dpo_reference import METRIC_KEYS, trl_reference, write_preference_data
from tests.finetune_harness import ReferenceCache, copy_stopped_at_step_5, launch, read_metrics, recipe, write_peft_adapter
from toolkit.convert import hf_to_megatron

STEPS = 10
TOLERANCE = 1e-5  # loss and rewards/*, absolute
NORM_TOLERANCE = 1e-4  # gradient norm, relative
GLOBAL_PAIRS = 8
REFERENCES = ReferenceCache()

# name -> (processes, parallel, loss type, LoRA, model). LoRA "new": a new adapter (B = 0), whose
# reference is the base with the adapter disabled; "loaded": from peft.init_from, B non-zero, whose
# reference is the base with that starting adapter (TRL's frozen "ref" copy; keep_starting_adapter).
# Each loss type once in full and once with an adapter, each layout once: a loss type is a function of the
# per-sequence log-probabilities, which every layout computes the same way (its TP/PP/DP sums are the layouts'
# own), so the cross product of losses and layouts proved nothing this cross does not.
LAYOUTS = {
    "sigmoid-TP2xPP2": (4, {"tp": 2, "pp": 2, "zero_stage": 1}, "sigmoid", None, "llama"),
    "sigmoid-lora-loaded-DP1": (1, {"tp": 1, "pp": 1, "zero_stage": 1}, "sigmoid", "loaded", "llama"),
    "ipo-TP2xPP2xDP2": (8, {"tp": 2, "pp": 2, "zero_stage": 1}, "ipo", None, "llama"),
    "ipo-lora-TP2xDP2": (4, {"tp": 2, "pp": 1, "zero_stage": 1}, "ipo", "new", "llama"),
    "robust-lora-TP2xDP2": (4, {"tp": 2, "pp": 1, "zero_stage": 1}, "robust", "new", "llama"),
    # Qwen3-MoE's experts split over EP2 (router_aux_loss_coef 0: TRL adds HF's load-balancing loss
    # over its whole batch, megatron-core per micro-batch; SFT's MoE tests prove that loss)
    "robust-qwen3moe-DP2xEP2": (2, {"tp": 1, "pp": 1, "zero_stage": 1, "ep": 2}, "robust", None, "qwen3-moe"),
}
RESUMED_FROM = "ipo-TP2xPP2xDP2"
LORA_TARGETS = ["q_proj", "v_proj", "down_proj"]
SEED = 1234  # the recipe's default seed: a new adapter's initialisation
LOSS_SETTINGS = {"sigmoid": {"beta": 0.1}, "ipo": {"beta": 0.5}, "robust": {"beta": 0.1, "label_smoothing": 0.2}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from toolkit.tinymodels import make_tiny_model

    root = tmp_path_factory.mktemp("dpo")
    hf = make_tiny_model("llama-odd-vocab", root / "hf", dtype="float32", num_hidden_layers=4, vocab_size=250)
    megatron = hf_to_megatron(hf, root / "mc", fmt="torch_dist", progress=False)
    moe = make_tiny_model("qwen3-moe", root / "hf-moe", dtype="float32", router_aux_loss_coef=0.0)
    models = {"llama": (hf, megatron), "qwen3-moe": (moe, hf_to_megatron(moe, root / "mc-moe", fmt="torch_dist", progress=False))}
    # B drawn non-zero: the reference (TRL's frozen "ref" copy of a loaded adapter; ours from
    # keep_starting_adapter) differs from the base model, so a reference taken without it would show
    loaded = write_peft_adapter(hf, root / "adapter", LORA_TARGETS, r=4, alpha=8.0)
    adapters = {"loaded": loaded, "new": recipe_initial_adapter(loaded, root / "adapter-new")}
    return {"root": root, "hf": hf, "megatron": megatron, "adapters": adapters, "models": models,
            "data": write_preference_data(root / "pairs.jsonl", 5 * GLOBAL_PAIRS)}


def recipe_initial_adapter(like: Path, out: Path) -> Path:
    """The adapter the recipe starts a new LoRA from (toolkit.lora.adapter.peft_init: A drawn from
    the seed, B zero), saved as PEFT saves one, for TRL to start from the same weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    from toolkit.lora.adapter import peft_init

    shutil.copytree(like, out)
    tensors = load_file(str(out / "adapter_model.safetensors"))
    save_file({k: peft_init(k, tuple(v.shape), SEED) for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    return out


def dpo_recipe(setup, directory: Path, parallel: dict, loss_type: str, lora: str | None, data: Path | None = None,
               model: str = "llama", **overrides) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    extra = {}
    if lora == "loaded":
        extra = {"peft": {"enabled": True, "init_from": str(setup["adapters"]["loaded"])}}
    elif lora == "new":
        extra = {"peft": {"enabled": True, "r": 4, "alpha": 8.0, "target_modules": ",".join(LORA_TARGETS)}}
    return recipe(directory, setup["models"][model][1], data or setup["data"], method="dpo",
                  dpo={"loss_type": loss_type, **LOSS_SETTINGS[loss_type]}, parallel=parallel,
                  optim={"lr": 1e-3, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.0, "clip_grad": 1.0},
                  global_batch=GLOBAL_PAIRS, micro_batch=2, steps=STEPS, **extra, **overrides)


def reference(setup, cfg: Path, lora: str | None, model: str = "llama"):
    adapter, hf = setup["adapters"][lora] if lora else None, setup["models"][model][0]
    return REFERENCES.get(cfg, lambda: trl_reference(hf, cfg, STEPS, adapter=adapter), hf, adapter)


def differences(metrics: list[dict], ref: list[dict]) -> dict[str, float]:
    """Worst difference per key over the steps (relative for the gradient norm)."""
    worst = {}
    for key in METRIC_KEYS:
        if key == "grad_norm":
            worst[key] = max(abs(m[key] - r[key]) / r[key] for m, r in zip(metrics, ref))
        else:
            worst[key] = max(abs(m[key] - r[key]) for m, r in zip(metrics, ref))
    return worst


def within_tolerance(worst: dict[str, float]) -> bool:
    return worst["grad_norm"] < NORM_TOLERANCE and all(v < TOLERANCE for k, v in worst.items()
                                                       if k in ("loss", "rewards/chosen", "rewards/rejected",
                                                                "rewards/accuracies", "rewards/margins"))


class Runs:
    def __init__(self, setup, root: Path):
        self.setup, self.root, self.done = setup, root, {}

    def __call__(self, name):
        if name not in self.done:
            nprocs, parallel, loss_type, lora, model = LAYOUTS[name]
            # the IPO run also saves its step-5 checkpoint, which the resume test starts from
            cfg = dpo_recipe(self.setup, self.root / name, parallel, loss_type, lora, model=model,
                             **({"save_every": 5} if name == RESUMED_FROM else {}))
            launch(nprocs, cfg)
            self.done[name] = (cfg, read_metrics(self.root / name / "run"))
        return self.done[name]


@pytest.fixture(scope="module")
def runs(setup, tmp_path_factory):
    return Runs(setup, tmp_path_factory.mktemp("dpo-runs"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dpo_losses_rewards_and_grad_norms_match_trl(setup, runs, name):
    cfg, metrics = runs(name)
    ref = reference(setup, cfg, LAYOUTS[name][3], LAYOUTS[name][4])
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    worst = differences(metrics, ref)
    print(name, {k: f"{v:.1e}" for k, v in worst.items()})
    assert within_tolerance(worst), (worst, metrics, ref)


@pytest.mark.multiprocess
def test_guard_chosen_and_rejected_swapped_on_one_rank_fails_the_comparison(setup, runs, tmp_path):
    """TRL trained on data where the pairs DP rank 1 of DP2 holds have chosen and rejected swapped
    (what a collate that swapped them on one rank would train on) is far outside the tolerance."""
    cfg, metrics = runs(RESUMED_FROM)  # DP2: rank 1 holds the second half of each global batch
    rows = [json.loads(line) for line in setup["data"].read_text().splitlines()]
    half = GLOBAL_PAIRS // 2
    for i, row in enumerate(rows):
        if i % GLOBAL_PAIRS >= half:
            row["chosen"], row["rejected"] = row["rejected"], row["chosen"]
    swapped = tmp_path / "swapped.jsonl"
    swapped.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    guard_cfg = dpo_recipe(setup, tmp_path / "guard", LAYOUTS[RESUMED_FROM][1], "ipo", None, data=swapped)
    worst = differences(metrics, trl_reference(setup["hf"], guard_cfg, STEPS))
    print("guard", {k: f"{v:.1e}" for k, v in worst.items()})
    assert not within_tolerance(worst)
    assert worst["loss"] > 100 * TOLERANCE


@pytest.mark.multiprocess
def test_resume_on_another_layout_goes_on_matching_trl(setup, runs, tmp_path):
    """The IPO run stopped after its step-5 checkpoint and resumed at TP2 (the layout-independent
    state; the reference rebuilt from the starting weights) repeats TRL's steps 6-10."""
    cfg, _ = runs(RESUMED_FROM)
    copy_stopped_at_step_5(runs.root / RESUMED_FROM / "run", tmp_path)
    resumed_cfg = dpo_recipe(setup, tmp_path, {"tp": 2, "pp": 1, "zero_stage": 1}, "ipo", None)
    launch(2, resumed_cfg, "resume=auto")
    resumed = read_metrics(tmp_path / "run")
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))
    worst = differences(resumed[5:], reference(setup, cfg, None)[5:])
    print("resumed at TP2", {k: f"{v:.1e}" for k, v in worst.items()})
    assert within_tolerance(worst), worst


def test_label_smoothing_without_robust_refused_in_one_line(tmp_path):
    from tests.finetune_harness import assert_refused_in_one_line

    assert_refused_in_one_line(tmp_path, ["method=dpo", "dpo.label_smoothing=0.1"], "loss_type=robust")
    assert_refused_in_one_line(tmp_path, ["method=dpo", "data.pack=true"], "method=dpo with data.pack")


def test_a_record_that_is_not_a_pair_is_refused_naming_its_line(tmp_path):
    from toolkit.tinymodels import build_tokenizer
    from toolkit.train.data import DataStats, ReadOptions
    from toolkit.train.data_sources import DataError, Source, records
    from toolkit.train.preference import read_pairs

    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "1=", "chosen": "2", "rejected": "3"}\n{"prompt": "1=", "response": "2"}\n')
    columns = {c: c for c in ("prompt", "chosen", "rejected")}
    with pytest.raises(DataError, match=r"pairs.jsonl:2: method=dpo expects keys \"chosen\" and \"rejected\""):
        read_pairs(records(Source(str(data)), columns, tmp_path), build_tokenizer(), ReadOptions(16), DataStats())


def test_pairs_are_tokenised_as_trl_and_kept_together():
    """TRL's own collator on TRL's tokenisation gives our rows; a micro-batch is its m chosen then
    its m rejected rows, and keep_start drops a pair whose prompt fills the length, as TRL does."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from toolkit.tinymodels import build_tokenizer
    from toolkit.train.data import DataStats, ReadOptions
    from toolkit.train.preference import PairSource, parse_pair, read_pairs, to_pair_rows

    tok = build_tokenizer()
    records = [{"prompt": "12=", "chosen": "3", "rejected": "44"}, {"chosen": "5=12", "rejected": "5=9"},
               {"prompt": "1234567=", "chosen": "1", "rejected": "2"}]
    stats = DataStats()
    pairs = read_pairs(enumerate(records), tok, ReadOptions(8), stats)
    assert stats.dropped_targets_truncated == 1 and len(pairs) == 2
    batch = PairSource(to_pair_rows(pairs, tok, 7), 2, 2, 1, 0, 0, False).next_global_batch()[0]
    examples = [vars(parse_pair(tok, r)) for r in records[:2]]
    trl = DataCollatorForPreference(pad_token_id=tok.pad_token_id)(
        [{"prompt_ids": e["prompt"], "chosen_ids": e["chosen"], "rejected_ids": e["rejected"]} for e in examples])
    width = trl["input_ids"].shape[1]
    tokens = torch.cat([batch["tokens"], batch["labels"][:, -1:]], dim=1)[:, :width]
    assert torch.equal(tokens, trl["input_ids"])
    assert torch.equal(batch["loss_mask"][:, :width - 1], trl["completion_mask"][:, 1:].float())


def test_memory_prices_the_reference_copy_and_the_doubled_sequences(tmp_path):
    """method=dpo: a micro-batch of m pairs holds the activations of 2m sequences; a full fine-tune
    adds a frozen copy of each stage's weights, LoRA none (the adapter is disabled instead)."""
    from toolkit import modelspec
    from toolkit.dsconfig import Setup
    from toolkit.memory import estimate
    from toolkit.memory.lora import LoraShape
    from toolkit.memory.params import stage_param_numels
    from toolkit.plan import Cluster, plan
    from toolkit.tinymodels import make_tiny_model

    spec = modelspec.read(make_tiny_model("llama", tmp_path / "hf", num_hidden_layers=4))
    pairs, sequences = (Setup(gpus=8, tp=2, pp=2, micro_batch=m, global_batch=16, precision="bf16") for m in (2, 4))
    sft, dpo = estimate(spec, sequences, 512), estimate(spec, pairs, 512, dpo=True)
    for s, (with_ref, without) in enumerate(zip(dpo.stages, sft.stages)):
        assert with_ref.activations == without.activations
        assert with_ref.reference == sum(stage_param_numels(spec, 2, 2, s)) * 2  # bf16 weights
        assert with_ref.gpu == without.gpu + with_ref.reference
    lora = estimate(spec, pairs, 512, lora=LoraShape(4, ("all-linear",)), dpo=True)
    assert all(s.reference == 0 for s in lora.stages)
    assert "DPO reference weights" in "\n".join(dpo.table())
    assert plan(spec, Cluster(8, 80 << 30, 8), 512, 16, dpo=True).best.memory.peak.reference > 0  # plan prices it too
