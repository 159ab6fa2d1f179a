"""The exported LoRA adapter is a directory HF loads as is: its base_model_name_or_path names the HF
model the checkpoint was converted from (not the megatron checkpoint, which
AutoPeftModelForCausalLM cannot load), and it holds the tokenizer."""

from __future__ import annotations

import json

import torch

from tests.finetune_harness import write_peft_adapter


def test_exported_adapter_loads_with_auto_peft_model_and_holds_the_tokenizer(tmp_path):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    from toolkit.convert import hf_to_megatron
    from toolkit.convert.metadata import HF_DIR, CheckpointMeta
    from toolkit.lora import peft_dir
    from toolkit.tinymodels import make_tiny_model
    from toolkit.train import build, checkpoint
    from toolkit.train.config import config_from_mapping

    hf = make_tiny_model("llama", tmp_path / "hf", dtype="float32", num_hidden_layers=2, vocab_size=250)
    mc = hf_to_megatron(hf, tmp_path / "mc", fmt="torch_dist", progress=False)
    meta = CheckpointMeta.read(mc)
    cfg = config_from_mapping({"model": {"checkpoint": str(mc)}, "data": {"train_file": "train.jsonl"},
                               "peft": {"enabled": True, "r": 4, "alpha": 8, "target_modules": "q_proj,v_proj"}})
    plan = build.lora_plan(cfg, meta)  # the recipe's LoRA settings, as a run resolves them

    # A run's checkpoint as the trainer leaves it: the adapter written by our writer (weights from
    # HF PEFT itself), `latest` naming it; then the export the recipe makes at the end.
    step = tmp_path / "run" / checkpoint.CHECKPOINTS / "step_0000001"
    tensors = peft_dir.read_tensors(write_peft_adapter(hf, tmp_path / "peft", ["q_proj", "v_proj"], r=4, alpha=8))
    peft_dir.write(step / checkpoint.ADAPTER_EXPORT, tensors, plan.settings, plan.base, plan.base_name)
    (step / "train_state.json").write_text(json.dumps({"step": 1}))
    (step.parent / checkpoint.LATEST).write_text(step.name)
    exported = checkpoint.export_adapter(tmp_path / "run", mc / HF_DIR)

    assert json.loads((exported / peft_dir.CONFIG).read_text())["base_model_name_or_path"] == str(hf.resolve())
    model = AutoPeftModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert not (exported / "config.json").exists(), "an adapter directory holds no model config"
    ids = tokenizer("12345=", return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4)
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(hf).get_vocab()
    # An explicit peft.base_model_name_or_path (a hub name, say) still wins.
    named = config_from_mapping({"model": {"checkpoint": str(mc)}, "data": {"train_file": "train.jsonl"},
                                 "peft": {"enabled": True, "base_model_name_or_path": "meta-llama/Llama-3.1-8B"}})
    assert build.lora_plan(named, meta).base_name == "meta-llama/Llama-3.1-8B"
