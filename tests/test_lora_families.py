"""LoRA on the families whose layers the toolkit builds itself (toolkit/layers.py): Gemma 3 and
OLMo 2 put a norm after o_proj and down_proj, and PEFT adds the adapter's delta to the linear's
output before that norm. Megatron-core with the imported adapter at TP2 must give PeftModel's
logits (tests/test_lora.py covers training; this covers where the delta enters)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.finetune_harness import write_peft_adapter
from tests.test_lora import held_out_tokens, peft_logits
from toolkit.convert import hf_to_megatron

LOGIT_TOLERANCE = 1e-4  # fp32


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["gemma3", "olmo2"])
def test_post_norm_families_with_an_adapter_give_peft_logits_at_tp2(tmp_path, variant):
    from toolkit.runtime.launch import run_on_processes
    from toolkit.tinymodels import make_tiny_model

    hf = make_tiny_model(variant, tmp_path / "hf", dtype="float32", vocab_size=250)
    megatron = hf_to_megatron(hf, tmp_path / "mc", fmt="torch_dist", progress=False)
    adapter = write_peft_adapter(hf, tmp_path / "adapter", "all-linear", r=4, alpha=8.0)
    tokens = held_out_tokens()
    [(ours, _)], _ = run_on_processes("tests.mp_workers:lora_logits", 2, str(megatron), tokens,
                                      [{"adapter": str(adapter), "tp": 2}])
    worst = float((torch.tensor(ours) - peft_logits(hf, adapter, tokens)).abs().max())
    print(f"{variant}: max |logit difference| vs PeftModel.from_pretrained: {worst:.2e}")
    assert worst < LOGIT_TOLERANCE, worst


def test_lora_on_a_mixture_of_experts_family_is_refused_in_one_line(tmp_path):
    from toolkit.errors import AdapterError
    from toolkit.families import family_named
    from toolkit.families.spec import read_spec
    from toolkit.lora import targets
    from toolkit.tinymodels import make_tiny_model

    hf = make_tiny_model("mixtral", tmp_path / "hf", dtype="float32")
    spec = read_spec(json.loads((hf / "config.json").read_text()), family_named("mixtral"))
    with pytest.raises(AdapterError, match=r"^LoRA is not supported yet for Mixture-of-Experts families \(mixtral\)"):
        targets.resolve(family_named("mixtral"), spec, ["q_proj"])
