"""Fine-tuning data and configuration: formats, masking, batching, and early, clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from toolkit.errors import ToolkitError
from toolkit.tinymodels import build_tokenizer
from toolkit.train.config import load_config
from toolkit.train.data import BatchSource, DataStats, collate, load_rows, pack_rows, parse_line, read_jsonl


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}={% else %}"
        "{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    )
    return tok


def write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_prompt_is_masked_and_eos_appended(tokenizer):
    s = parse_line(tokenizer, {"prompt": "12=", "response": "21"})
    assert s.tokens[-1] == tokenizer.eos_token_id
    assert s.loss_mask == [0, 0, 0, 1, 1, 1]


def test_messages_count_only_assistant_turns(tokenizer):
    s = parse_line(tokenizer, {"messages": [{"role": "user", "content": "12"}, {"role": "assistant", "content": "21"},
                                            {"role": "user", "content": "3"}, {"role": "assistant", "content": "3"}]})
    assert tokenizer.decode(s.tokens).replace(" ", "") == "12=21</s>3=3</s>"
    assert s.loss_mask == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


def test_text_counts_every_token(tokenizer):
    assert parse_line(tokenizer, {"text": "123"}).loss_mask == [1, 1, 1, 1]


def test_malformed_line_names_file_and_line(tokenizer, tmp_path):
    path = write(tmp_path / "d.jsonl", [{"prompt": "1=", "response": "1"}, "{not json", {"text": "1"}])
    with pytest.raises(ToolkitError, match=r"d\.jsonl:2"):
        read_jsonl(path, tokenizer, 64, "truncate", "error", DataStats())
    stats = DataStats()
    assert len(read_jsonl(path, tokenizer, 64, "truncate", "skip", stats)) == 2 and stats.skipped_malformed == 1


def test_missing_and_empty_data_files(tokenizer, tmp_path):
    with pytest.raises(ToolkitError, match="does not exist"):
        read_jsonl(tmp_path / "nope.jsonl", tokenizer, 64, "truncate", "error", DataStats())
    with pytest.raises(ToolkitError, match="no usable samples"):
        read_jsonl(write(tmp_path / "e.jsonl", []), tokenizer, 64, "truncate", "error", DataStats())


def test_overlong_samples_are_truncated_or_dropped_and_counted(tokenizer, tmp_path):
    path = write(tmp_path / "d.jsonl", [{"prompt": "1=", "response": "1"}, {"prompt": "1234567=", "response": "7654321"}])
    stats = DataStats()
    samples = read_jsonl(path, tokenizer, 10, "truncate", "error", stats)
    assert stats.truncated == 1 and max(len(s.tokens) for s in samples) == 10
    stats = DataStats()
    assert len(read_jsonl(path, tokenizer, 10, "drop", "error", stats)) == 1 and stats.dropped_overlong == 1


def test_padding_never_counts_in_the_loss(tokenizer, tmp_path):
    rows, _ = load_rows(write(tmp_path / "d.jsonl", [{"prompt": "1=", "response": "1"}]), tokenizer, 8, False, "truncate", "error")
    batch = collate(rows, packed=False)
    assert batch["tokens"].shape == (1, 8) and batch["loss_mask"].sum() == 2  # "1" and EOS


def test_packed_rows_mask_attention_across_documents(tokenizer):
    samples = [parse_line(tokenizer, {"prompt": "1=", "response": "1"}), parse_line(tokenizer, {"prompt": "22=", "response": "22"})]
    (row,) = pack_rows(samples, 12, tokenizer.pad_token_id)
    mask = collate([row], packed=True)["attention_mask"][0, 0]  # True = masked
    assert not mask[5, 4] and mask[5, 3], "token 5 (second document) must not see token 3 (first document)"
    assert mask[2, 3], "causal"


def test_each_dp_rank_reads_its_own_part_and_resume_continues(tokenizer, tmp_path):
    path = write(tmp_path / "d.jsonl", [{"prompt": f"{i}=", "response": str(i)} for i in range(10)])
    rows, _ = load_rows(path, tokenizer, 8, False, "truncate", "error")
    sources = [BatchSource(rows, 4, 1, 2, r, seed=3, shuffle=True, packed=False) for r in range(2)]
    first = [torch.cat([b["tokens"] for b in s.next_global_batch()]) for s in sources]
    assert not torch.equal(first[0], first[1])
    again = BatchSource(rows, 4, 1, 2, 1, seed=3, shuffle=True, packed=False)
    again.load_state_dict(sources[1].state_dict())
    assert torch.equal(torch.cat([b["tokens"] for b in again.next_global_batch()]),
                       torch.cat([b["tokens"] for b in sources[1].next_global_batch()]))



@pytest.mark.parametrize("packed", [False, True])
def test_global_token_counts_equal_the_sum_of_every_dp_ranks_micro_batches(tokenizer, tmp_path, packed):
    """The loss normaliser is counted from the whole global batch on every rank, without a
    collective: it must equal what each DP rank's collated micro-batches hold, summed."""
    path = write(tmp_path / "d.jsonl", [{"prompt": f"{i}" * (i % 4 + 1) + "=", "response": str(i)} for i in range(13)])
    rows, _ = load_rows(path, tokenizer, 10, packed, "truncate", "error")
    sources = [BatchSource(rows, 4, 1, 2, r, seed=1, shuffle=True, packed=packed) for r in range(2)]
    for _ in range(5):  # past the end of an epoch too
        parts = [s.next_global_batch() for s in sources]
        loss_tokens = sum(int(b["loss_mask"].sum()) for part in parts for b in part)
        real_tokens = sum(int(b["real_tokens"]) for part in parts for b in part)
        assert loss_tokens > 0
        for s in sources:
            assert (s.last_counts.loss_tokens, s.last_counts.real_tokens) == (loss_tokens, real_tokens)

def recipe_file(tmp_path, **extra):
    cfg = {"model": {"checkpoint": str(tmp_path)}, "data": {"train_file": "x.jsonl"}, **extra}
    path = tmp_path / "r.yaml"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["parallel.pp=2", "parallel.zero_stage=2"], "ZeRO-2/3 do not work with pipeline parallelism"),
        (["precision=fp16,bf16"], "fp16 and bf16 cannot both be enabled"),
        (["precision=[bf16, fp16]"], "fp16 and bf16 cannot both be enabled"),
        (["loss_scale.initial_scale_power=40"], "loss_scale.initial_scale_power.*<= 32"),
        (["parallel.zero_stage=0"], "zero_stage must be 1, 2 or 3"),
        (["optim.lrr=1"], "unknown config key 'optim.lrr'"),
        (["steps=abc"], "steps"),
        (["parallel.recompute=sometimes"], "recompute"),
        # Values that make no sense: refused when read, never truncated or passed on.
        (["optim.lr=nan"], "optim.lr.*finite"),
        (["optim.lr=-1e-4"], "optim.lr.*must be .*> 0"),
        (["optim.clip_grad=-1"], "optim.clip_grad.*must be .*>= 0"),
        (["steps=2.5"], "steps.*whole number"),
        (["log_every=0"], "log_every.*must be an integer >= 1"),
        (["keep_last=0"], "keep_last.*must be an integer >= 1"),
        (["optim.betas=[0.9]"], "optim.betas.*list of 2"),
        (["optim.betas=[0.9, 1.5]"], "optim.betas.*must be .*< 1"),
        (["global_batch=inf"], "global_batch.*finite"),
        (["micro_batch=true"], "micro_batch.*number"),
        (["optim.min_lr=1"], "min_lr 1 is above optim.lr"),
        (["resume=/no/such/checkpoint"], "resume=/no/such/checkpoint"),
    ],
)
def test_bad_recipe_values_are_refused(tmp_path, overrides, match):
    with pytest.raises(ToolkitError, match=match):
        load_config(recipe_file(tmp_path), overrides)


def test_overrides_reach_nested_fields(tmp_path):
    cfg = load_config(recipe_file(tmp_path), ["optim.lr=1e-4", "parallel.tp=2", "optim.betas=[0.9, 0.95]", "wandb.run_id=none"])
    assert (cfg.optim.lr, cfg.parallel.tp, cfg.optim.betas, cfg.wandb.run_id) == (1e-4, 2, (0.9, 0.95), None)
    text = load_config(recipe_file(tmp_path), ["run_dir=`touch x` $(y)", "wandb.project=a: b"])
    assert (text.run_dir, text.wandb.project) == ("`touch x` $(y)", "a: b"), "text fields take the value verbatim"


def test_checkpoint_and_layout_checks(tiny_hf, tmp_path):
    from toolkit.convert import hf_to_megatron
    from toolkit.train import build

    mc = hf_to_megatron(tiny_hf["mistral"], tmp_path / "mc", fmt="torch_dist", progress=False)
    ok = load_config(recipe_file(tmp_path, model={"checkpoint": str(mc)}))
    with pytest.raises(ToolkitError, match="expects llama"):
        build.read_checkpoint_meta(load_config(recipe_file(tmp_path, model={"checkpoint": str(mc), "family": "llama"})))
    with pytest.raises(ToolkitError, match="exceeds the model's max_position_embeddings"):
        build.read_checkpoint_meta(load_config(recipe_file(tmp_path, model={"checkpoint": str(mc)}), ["data.seq_len=4096"]))
    with pytest.raises(ToolkitError, match="sliding window"):
        build.read_checkpoint_meta(load_config(recipe_file(tmp_path, model={"checkpoint": str(mc)}), ["data.pack=true"]))
    meta = build.read_checkpoint_meta(ok)
    with pytest.raises(ToolkitError, match="not divisible by TP\\*PP"):
        build.check_layout(load_config(recipe_file(tmp_path, model={"checkpoint": str(mc)}), ["parallel.tp=4"]), 6, meta)
    with pytest.raises(ToolkitError, match="global_batch 8 is not divisible by micro_batch 3"):
        build.check_layout(load_config(recipe_file(tmp_path, model={"checkpoint": str(mc)}), ["micro_batch=3"]), 2, meta)
    with pytest.raises(ToolkitError, match=r"parallel.tp=8 parallel.pp=1 does not fit .*attention heads are not divisible"):
        build.check_layout(load_config(recipe_file(tmp_path, model={"checkpoint": str(mc)}), ["parallel.tp=8"]), 8, meta)
    assert build.check_layout(ok, 4, meta) == 4


def test_packing_is_refused_on_the_transformer_engine_path(tiny_hf, tmp_path, monkeypatch):
    """TE has no document mask without cu_seqlens, which the trainer doesn't build. Transformer
    Engine cannot be installed on this CPU machine, so the layer-spec choice is what stands in."""
    from toolkit.convert import hf_to_megatron
    from toolkit.train import build

    mc = hf_to_megatron(tiny_hf["llama"], tmp_path / "mc", fmt="torch_dist", progress=False)
    cfg = load_config(recipe_file(tmp_path, model={"checkpoint": str(mc)}), ["data.pack=true"])
    build.read_checkpoint_meta(cfg)  # the local spec (here) packs
    import toolkit.model

    monkeypatch.setattr(toolkit.model, "running_layer_spec", lambda: "te")
    with pytest.raises(ToolkitError, match="packing is not supported on the Transformer Engine path"):
        build.read_checkpoint_meta(cfg)


def test_a_checkpoint_without_tokenizer_is_one_line_before_training(tiny_hf, tmp_path):
    from toolkit.convert import hf_to_megatron
    from toolkit.train import recipe_data

    mc = hf_to_megatron(tiny_hf["llama"], tmp_path / "mc", fmt="torch_dist", progress=False)
    cfg = load_config(recipe_file(tmp_path, model={"checkpoint": str(mc)}))
    assert recipe_data.load_tokenizer(cfg) is not None
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (mc / "hf" / name).unlink(missing_ok=True)
    with pytest.raises(ToolkitError, match=r"has no tokenizer .*copy the HF model's tokenizer files into"):
        recipe_data.load_tokenizer(cfg)


PACKING_TOLERANCE = 1e-4  # fp32; RoPE is relative, so shifted positions differ only by rounding


@pytest.mark.multiprocess
def test_packed_and_unpacked_documents_give_the_same_token_losses(tiny_hf, tmp_path):
    from toolkit.convert import hf_to_megatron
    from toolkit.runtime.launch import run_on_processes

    mc = hf_to_megatron(tiny_hf["llama-fp32"], tmp_path / "mc", fmt="torch_dist", progress=False)
    docs = [{"prompt": "123=", "response": "321"}, {"prompt": "98765=", "response": "56789"}, {"text": "4444"}]
    (diff,) = run_on_processes("tests.mp_workers:packed_vs_unpacked_losses", 1, str(mc), docs, 32)
    assert diff < PACKING_TOLERANCE
