"""A user's own chat data, end to end, and the faults around its checkpoints (issue 25, sections 3
and 5). Two launches in all:

- chat conversations as Parquet, read through `datasets` with a ChatML template, fine-tuned with
  LoRA at TP 2; the exported adapter loads with PEFT's AutoPeftModelForCausalLM and generates, and
  the same data with the tiny models' digits-only tokenizer is refused before training; then the
  run's latest checkpoint is damaged and resume=auto falls back to the one before, or names the
  damaged file;
- a disk that fills during a checkpoint save (a real tmpfs of its own, filled while the run waits at
  the save's start): one line with the space needed, nothing lost, `latest` where it was.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.finetune_harness import launch, read_metrics, recipe, recipe_prepare
from toolkit.errors import ToolkitError
from toolkit.tinymodels import build_tokenizer, make_tiny_model

CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"), ("Peru", "Lima"),
            ("Egypt", "Cairo"), ("Chile", "Santiago"), ("Kenya", "Nairobi")]
CHATS = [{"conversation": [{"role": "user", "content": f"What is the capital of {country}?"},
                           {"role": "assistant", "content": f"{city}."}]} for country, city in CAPITALS]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny Llama with a text tokenizer (printable characters and ChatML), converted; the chats as Parquet."""
    import datasets

    from toolkit.convert import hf_to_megatron

    root = tmp_path_factory.mktemp("chat")
    hf = make_tiny_model("llama", root / "hf", dtype="float32", seed=3)
    build_tokenizer(text=True).save_pretrained(hf)
    mc = hf_to_megatron(hf, root / "mc", fmt="torch_dist", progress=False)
    data = root / "chats.parquet"
    datasets.Dataset.from_list(CHATS * 4).to_parquet(data)
    return hf, mc, data


def chat_recipe(directory: Path, mc: Path, data: Path, **overrides) -> Path:
    return recipe(directory, mc, data, data__seq_len=80, data__chat_template="chatml", data__columns={"messages": "conversation"},
                  optim={"lr": 1e-2, "warmup_steps": 0, "schedule": "constant"}, micro_batch=2, global_batch=4, **overrides)


@pytest.mark.multiprocess
def test_chat_parquet_lora_at_tp2_exports_an_adapter_peft_loads_and_damaged_checkpoints_fall_back(chat_model, tmp_path,
                                                                                                     monkeypatch, capsys):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf, mc, data = chat_model
    cfg = chat_recipe(tmp_path, mc, data, parallel={"tp": 2}, steps=8, save_every=4, keep_last=2,
                      peft={"enabled": True, "r": 4, "alpha": 8.0, "base_model_name_or_path": str(hf)})
    prepare = recipe_prepare()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    # The same data and template with the digits-only tokenizer: refused before any process group.
    digits_mc = tmp_path / "digits-mc"
    shutil.copytree(mc, digits_mc)
    build_tokenizer().save_pretrained(digits_mc / "hf")
    with pytest.raises(ToolkitError, match=r"chats.parquet: \d+ of \d+ tokens \(\d+%\) are the tokenizer's unknown token") as e:
        prepare(str(cfg), [f"model.checkpoint={digits_mc}", "peft.enabled=false"])
    assert "\n" not in str(e.value)

    result = launch(2, cfg)
    assert "dropped_targets_truncated': 0" in result.stdout and "'samples': 32" in result.stdout, result.stdout[-2000:]
    losses = [m["loss"] for m in read_metrics(tmp_path / "run")]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.3, losses  # 5.55 -> 4.99 measured; a random tiny model learns slowly

    run = tmp_path / "run"
    assert json.loads((run / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(hf)
    tok = AutoTokenizer.from_pretrained(hf)
    tok.chat_template = None
    prompt = "<|im_start|>user\nWhat is the capital of Peru?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    tuned = AutoPeftModelForCausalLM.from_pretrained(run / "adapter").eval()
    base = AutoModelForCausalLM.from_pretrained(hf).eval()
    with torch.no_grad():
        out = tuned.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
        assert not torch.allclose(tuned(input_ids=ids).logits, base(input_ids=ids).logits), "the adapter changes the model"
    answer = tok.decode(out[0, ids.shape[1]:])
    assert out.shape[1] > ids.shape[1] and isinstance(answer, str)

    # Defect (section 5): resume=auto on a damaged latest checkpoint was a raw PytorchStreamReader
    # error on every rank. Now: the newest intact one, said once; or one line naming the file.
    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step_0000008"
    damaged = checkpoints / "step_0000008" / "ranks" / "rank_00001.pt"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    capsys.readouterr()
    resumed = prepare(str(cfg), ["resume=auto"])
    assert resumed.resume_from == checkpoints / "step_0000004"
    said = capsys.readouterr().out
    assert f"step_0000008 is damaged ({damaged} is not a readable torch file" in said and "resuming from step_0000004" in said
    older = checkpoints / "step_0000004" / "ds" / "mp_rank_01_model_states.pt"
    older.write_bytes(older.read_bytes()[:100])
    with pytest.raises(ToolkitError, match=f"step_0000008, the latest checkpoint, is damaged \\({damaged} .*no older one "
                                           "is intact"):
        prepare(str(cfg), ["resume=auto"])
    with pytest.raises(ToolkitError, match=f"resume={checkpoints / 'step_0000004'}: the checkpoint is damaged \\({older}"):
        prepare(str(cfg), [f"resume={checkpoints / 'step_0000004'}"])


def _fill(mount: Path, leave: int) -> None:
    """Fill the filesystem until `leave` bytes are free."""
    free = shutil.disk_usage(mount).free - leave
    with open(mount / "filler", "wb") as f:
        while free > 0:
            chunk = min(free, 1 << 20)
            f.write(b"\0" * chunk)
            free -= chunk


@pytest.mark.multiprocess
@pytest.mark.parametrize("fills_in", ["deepspeed", "torch_dist"])
def test_a_disk_that_fills_during_a_save_is_one_line_and_loses_nothing(chat_model, small_fs, tmp_path, fills_in):
    """Defect (section 5): raw exceptions from every rank. The run waits at the start of its second
    save (TOOLKIT_FAULT_PAUSE) while the test fills its disk: to a quarter of a checkpoint (DeepSpeed's
    files fill it), or to all but half of the layout-independent train/ state (megatron-core's torch_dist
    writer fills it; its failure is DCP's CheckpointException, a BaseException, and the writer differs
    between megatron-core releases: every lane runs this). Two ranks: the line comes once (the rank
    that hit the full disk; the other's collective breaks when it leaves), and every rank exits non-zero."""
    small_disk = small_fs("64m")
    from tests.finetune_harness import wait_for
    from toolkit.train import checkpoint
    from toolkit.train.checkpoint_verify import damage

    hf, mc, data = chat_model
    cfg = chat_recipe(small_disk, mc, data, steps=4, save_every=2, data__cache_dir=str(tmp_path / "cache"))
    flag = tmp_path / "paused"
    proc = launch(2, cfg, env={"TOOLKIT_FAULT_PAUSE": f"checkpoint-start@2:{flag}"}, wait=False)
    wait_for(flag.exists, proc)
    checkpoints = small_disk / "run" / "checkpoints"
    first = checkpoints / "step_0000002"
    size = sum(f.stat().st_size for f in first.rglob("*") if f.is_file())
    train = sum(f.stat().st_size for f in (first / "train").rglob("*") if f.is_file())
    _fill(small_disk, size // 4 if fills_in == "deepspeed" else size - train // 2)
    flag.unlink()
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in output, output[-4000:]
    assert f"the disk under {checkpoints} is full: saving step_0000004 needs about " in errors[0], errors
    assert "(the size of step_0000002)" in errors[0] and "latest still names step_0000002" in errors[0], errors
    assert (checkpoints / "latest").read_text() == "step_0000002" and damage(first) is None
    assert sorted(p.name for p in checkpoints.iterdir()) == [".step_0000004.disk_full", "latest", "step_0000002"], \
        "the partial save is removed (the note tells the ranks that one of them said it)"
    assert [m["step"] for m in read_metrics(small_disk / "run")] == [1, 2, 3, 4]
    (small_disk / "filler").unlink()
    assert checkpoint.find_resumable(small_disk / "run").path == first
    assert os.path.ismount(small_disk)


def test_a_rank_that_looks_after_the_partial_save_is_removed_stays_silent(tmp_path, monkeypatch):
    """Defect (seen in CI: a traceback beside the one line). Both ranks' torch_dist writes fail; the
    first rank sees the full disk and removes the partial save; the second looks only then, sees free
    space and a short write worded "unexpected pos 704 vs 598" without the errno, so only the note can
    tell it that the disk was why. Here the second rank looks at the moment of the removal."""
    import errno

    from toolkit.errors import ReportedByAnotherRank
    from toolkit.train import checkpoint

    root = tmp_path / "checkpoints"
    tmp, final = root / ".step_0000004.partial", root / "step_0000004"
    (tmp / "train").mkdir(parents=True)
    (tmp / "train" / "shard.distcp").write_bytes(b"x" * 100)
    note = root / ".step_0000004.disk_full"
    short_write = RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    rmtree, second = shutil.rmtree, []

    def removal_meanwhile_the_second_rank_looks(path, *args, **kwargs):
        rmtree(path, *args, **kwargs)
        if Path(path) == tmp and not second:
            second.append(checkpoint._told_disk_full(short_write, root, tmp, final, note))

    monkeypatch.setattr(shutil, "rmtree", removal_meanwhile_the_second_rank_looks)
    first = checkpoint._told_disk_full(OSError(errno.ENOSPC, "No space left on device"), root, tmp, final, note)
    assert isinstance(first, checkpoint.CheckpointError) and "is full: saving step_0000004" in str(first), first
    assert isinstance(second[0], ReportedByAnotherRank), f"the second rank would raise its own traceback: {second}"
    assert checkpoint._told_disk_full(RuntimeError("another failure"), tmp_path / "elsewhere", tmp, final,
                                      tmp_path / "elsewhere" / "note") is None, "a failure that is not the disk"
