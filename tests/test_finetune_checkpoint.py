"""Training checkpoints: exact resume after SIGKILL, torn saves never picked, export to HF."""

from __future__ import annotations

import json
import signal

import pytest
import torch
from safetensors.torch import load_file

from tests.finetune_harness import kill_tree, launch, read_metrics, recipe, wait_for, write_uneven_data
from toolkit.convert import hf_to_megatron


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory):
    from toolkit.tinymodels import make_tiny_model

    root = tmp_path_factory.mktemp("ckpt")
    hf = make_tiny_model("llama-odd-vocab", root / "hf", dtype="float32", num_hidden_layers=4, vocab_size=250)
    mc = hf_to_megatron(hf, root / "mc", fmt="torch_dist", progress=False)
    return hf, mc, write_uneven_data(root / "data.jsonl", 300)


@pytest.mark.multiprocess
def test_resume_after_sigkill_repeats_the_uninterrupted_losses(model_and_data, tmp_path):
    hf, mc, data = model_and_data
    parallel = {"tp": 1, "pp": 2, "zero_stage": 1}
    straight_dir, killed_dir = tmp_path / "straight", tmp_path / "killed"
    straight_dir.mkdir(), killed_dir.mkdir()
    launch(4, recipe(straight_dir, mc, data, parallel=parallel, save_every=5))
    straight = read_metrics(straight_dir / "run")

    # Second run: pause rank 0 in its 2nd save (step 10) between the shard writes and the marker, then SIGKILL all.
    flag = tmp_path / "paused"
    cfg = recipe(killed_dir, mc, data, parallel=parallel, save_every=5)
    proc = launch(4, cfg, env={"TOOLKIT_FAULT_PAUSE": f"checkpoint-before-marker@2:{flag}"}, wait=False,
                  launcher="torchrun")  # a kill under the real launcher
    wait_for(flag.exists, proc)
    kill_tree(proc.pid)
    proc.wait()
    checkpoints = killed_dir / "run" / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step_0000005", "a torn save must never become latest"
    assert (checkpoints / ".step_0000010.partial").is_dir() and not (checkpoints / "step_0000010").exists()

    launch(4, cfg, "resume=auto")
    resumed = read_metrics(killed_dir / "run")
    assert [m["step"] for m in resumed] == list(range(1, 11)), "every step logged exactly once"
    assert [m["loss"] for m in resumed] == [m["loss"] for m in straight], "fp32 resume must be exact"
    assert [m["grad_norm"] for m in resumed[5:]] == [m["grad_norm"] for m in straight[5:]]


@pytest.mark.multiprocess
def test_sigterm_saves_after_the_current_step_and_the_run_resumes(model_and_data, tmp_path):
    """Slurm's preemption (and `scancel`) sends SIGTERM to every process of the job step: each
    rank finishes the same step, a checkpoint is saved, the ranks exit 99, and resume=auto goes on."""
    import psutil

    hf, mc, data = model_and_data
    cfg = recipe(tmp_path, mc, data, parallel={"tp": 1, "pp": 1, "zero_stage": 1}, steps=500,
                 optim={"lr": 1e-3, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.0, "clip_grad": 1.0})
    proc = launch(2, cfg, wait=False, launcher="torchrun")  # signals as the real launcher passes them on
    metrics = tmp_path / "run" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, proc)
    for worker in psutil.Process(proc.pid).children(recursive=True):
        worker.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=300)[0]
    assert "SIGTERM received: saved step" in output, output[-3000:]
    step = int(output.split("SIGTERM received: saved step ")[1].split(",")[0])
    assert step < 500 and (tmp_path / "run" / "checkpoints" / "latest").read_text() == f"step_{step:07d}"

    launch(2, cfg, "resume=auto", f"steps={step + 2}")
    logged = read_metrics(tmp_path / "run")
    assert [m["step"] for m in logged][-2:] == [step + 1, step + 2]
    assert all(m["lr"] == 1e-3 for m in logged), "a constant schedule simply continues"


@pytest.mark.multiprocess
def test_deepspeed_launcher_wandb_offline_and_resume_on_another_layout(model_and_data, tmp_path):
    """One run under the `deepspeed` launcher with W&B offline, then a resume at TP=2 goes on
    from the layout-independent state (tests/test_finetune_elastic.py checks its numbers)."""
    hf, mc, data = model_and_data
    wandb = {"enabled": True, "mode": "offline", "run_id": "test-run-1", "project": "toolkit-tests"}
    launch(2, recipe(tmp_path, mc, data, parallel={"tp": 1, "pp": 1, "zero_stage": 1}, steps=2, wandb=wandb),
           launcher="deepspeed", env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    run = tmp_path / "run"
    assert [m["step"] for m in read_metrics(run)] == [1, 2]
    offline = list((run / "wandb").glob("offline-run-*-test-run-1"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb")), "the offline W&B run holds our records"
    resolved = json.loads((run / "resolved_config.json").read_text())
    assert resolved["deepspeed"]["gradient_accumulation_steps"] == 1 and "wandb" not in resolved["deepspeed"]
    from toolkit.dsconfig import check

    report = check(resolved["deepspeed"], gpus=2, tp=1, pp=1)
    assert report.ok, report.lines()
    from toolkit.wandb_offline import read_runs

    logged = read_runs(run / "wandb")["test-run-1"].config  # the resolved config, as W&B holds it
    assert logged["deepspeed"] == resolved["deepspeed"] and logged["layout"] == resolved["layout"]
    assert logged["config"]["optim"]["lr"] == resolved["config"]["optim"]["lr"]

    # The resume at TP=2 logs a table of greedy generations at its one eval (the last step, after
    # which the exported HF model holds the very weights that generated them).
    valid = write_uneven_data(tmp_path / "valid.jsonl", 16, seed=1)
    samples = {"sample_generations": 3, "sample_new_tokens": 6}
    cfg = recipe(tmp_path, mc, data, parallel={"tp": 2, "pp": 1, "zero_stage": 1}, steps=4, export_hf=True,
                 data__valid_file=str(valid),
                 wandb={**wandb, **samples})
    launch(2, cfg, "resume=auto", env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4]
    assert_generations_table(read_runs(run / "wandb")["test-run-1"], run / "hf", valid, step=4, count=3, new_tokens=6)


def assert_generations_table(wandb_run, hf_dir, valid, step: int, count: int, new_tokens: int) -> None:
    """The eval_samples table, read back from the offline run's files, against HF's own greedy
    `generate` on the same weights and prompts cut from the data here (tokens before the response)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.finetune_harness import reference_samples

    (row,) = [r for r in wandb_run.history if r["_step"] == step]
    assert row["eval_samples/_type"] == "table-file" and row["eval_samples/nrows"] == count
    segment = wandb_run.segments[-1]
    table = json.loads((segment.path.parent / "files" / row["eval_samples/path"]).read_text())
    assert table["columns"] == ["step", "prompt", "reference", "output"]
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    expected = []
    for tokens, mask in reference_samples(tokenizer, valid, 25)[:count]:
        prompt = tokens[:mask.index(1)]
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        text = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        expected.append([step, text(prompt), text(tokens[len(prompt):]), text(out[0, len(prompt):].tolist())])
    assert table["data"] == expected


@pytest.mark.multiprocess
def test_export_at_tp2_pp2_equals_the_trained_model_and_matches_megatron_logits(model_and_data, tmp_path):
    from transformers import AutoModelForCausalLM

    from toolkit.convert.megatron_checkpoint import MegatronCheckpoint
    from toolkit.convert.parity import verify_many
    from toolkit.splits.kinds import merge_shards

    hf, mc, data = model_and_data
    launch(4, recipe(tmp_path, mc, data, parallel={"tp": 2, "pp": 2, "zero_stage": 1}, steps=4, export_hf=True))
    run = tmp_path / "run"
    step_dir = run / "checkpoints" / "step_0000004"
    exported = load_file(run / "hf" / "model.safetensors")
    AutoModelForCausalLM.from_pretrained(run / "hf")  # loads
    original = load_file(hf / "model.safetensors")
    assert set(exported) == set(original) and any(not torch.equal(exported[k], original[k]) for k in original)

    # Independent path: DeepSpeed's own per-model-parallel-rank module files (fp32 training, so
    # module weights are the master weights), merged with the conversion split rules.
    # weights_only=False: these are files this test just wrote, and DeepSpeed stores non-tensor objects.
    ckpt = MegatronCheckpoint.open(step_dir / "model")
    geo = ckpt.layout.geometry(ckpt.spec)
    ds_states = {}
    for pp_rank in range(2):
        for tp_rank in range(2):
            mp_rank = pp_rank * 2 + tp_rank  # megatron-core orders the model-parallel group TP-fastest
            state = torch.load(step_dir / "ds" / f"mp_rank_{mp_rank:02d}_model_states.pt", weights_only=False)["module"]
            ds_states[(tp_rank, pp_rank)] = state
    from toolkit.convert.naming import to_canonical

    for row in ckpt.family.rows_for(ckpt.spec):
        for layer in range(4) if row.per_layer else [None]:
            pp_rank = 0 if layer is None and row.megatron.startswith("embedding") else (1 if layer is None else layer // 2)
            local = row.megatron_name(None if layer is None else layer % 2)
            shards = [{to_canonical(k): v for k, v in ds_states[(t, pp_rank)].items()}[local] for t in range(2)]
            for name, tensor in zip(row.hf_names(layer), merge_shards(row.split, shards, geo)):
                assert torch.equal(exported[name], tensor.float()), name

    (report,) = verify_many([(run / "hf", step_dir / "model")])
    assert report.ok and report.max_logit_diff < 1e-4, "\n".join(report.lines())
