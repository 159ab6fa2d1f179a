"""`toolkit parity`: the quick start's model passes; a checkpoint converted with a wrong RoPE base
fails at step 1's loss, pointing at the conversion; bad input is one line and writes nothing.

The two launches use tests/forkrun.py to start the ranks (the import cost of torchrun's fresh
interpreters is most of a tiny run here); `toolkit parity` itself launches with torchrun, as the
quick start does (toolkit/runtime/recipe_launch.py: launch_recipe), which is the only difference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.finetune_harness import launcher_command
from toolkit.errors import ParityError
from toolkit.parity import ParityRequest, judge, run_parity
from toolkit.parity.verdict import FORWARD, UPDATE

REPO = Path(__file__).resolve().parents[1]
QUICKSTART_RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
STEPS = 3
WRONG_ROPE_BASE = 500000.0  # Llama 3's, where the quick start's model has 10000


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """The quick start's tiny Llama and data, converted as the quick start converts it (TP2 x PP2),
    and a copy converted with a wrong RoPE base (TP1 x PP1, so that its run is one process)."""
    from toolkit.convert import hf_to_megatron
    from toolkit.examples import write_reversal_task
    from toolkit.quickstart import TINY
    from toolkit.tinymodels import make_tiny_model

    root = tmp_path_factory.mktemp("parity")
    hf = make_tiny_model("llama", root / "hf", dtype="float32", **TINY)
    train, _, _ = write_reversal_task(root / "data")
    good = hf_to_megatron(hf, root / "mc-tp2-pp2", tp=2, pp=2, progress=False)
    wrong = hf_to_megatron(hf, root / "mc-wrong-rope", progress=False)
    meta_file = Path(wrong) / "toolkit_checkpoint.json"
    meta = json.loads(meta_file.read_text())
    assert meta["spec"]["rope_theta"] == 10000.0
    meta["spec"]["rope_theta"] = WRONG_ROPE_BASE  # as a converter that wrote another model's RoPE base
    meta_file.write_text(json.dumps(meta))
    return {"hf": hf, "train": train, "good": good, "wrong": wrong}


def request(quickstart, checkpoint: str, nprocs: int, *overrides: str, **more) -> ParityRequest:
    return ParityRequest(str(QUICKSTART_RECIPE), [f"model.checkpoint={quickstart[checkpoint]}",
                                                  f"data.train_file={quickstart['train']}", *overrides],
                         steps=STEPS, launcher=launcher_command(nprocs, "fork"), **more)


@pytest.mark.multiprocess
def test_parity_passes_on_the_quickstart_model_at_tp2_pp2(quickstart, tmp_path):
    lines = []
    verdict = run_parity(request(quickstart, "good", 4, workdir=str(tmp_path / "kept")), log=lines.append)
    print("\n".join(lines))
    assert verdict.ok, "\n".join(lines)
    assert [p.step for p in verdict.pairs] == [1, 2, 3]
    assert lines[-1].startswith("PASS (loss within 1e-05, grad norm within 0.0001 relative, 3 steps)")
    assert "TP 2 x PP 2 x DP 1, 4 processes" in lines[0]
    assert json.loads((tmp_path / "kept" / "megatron-run" / "resolved_config.json").read_text())["config"]["precision"] == "fp32"


@pytest.mark.multiprocess
def test_parity_fails_at_step_one_loss_on_a_checkpoint_converted_with_the_wrong_rope_base(quickstart, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # where the run goes, to see it removed
    lines = []
    verdict = run_parity(request(quickstart, "wrong", 1, "parallel.tp=1", "parallel.pp=1"), log=lines.append)
    print("\n".join(lines))
    assert not verdict.ok
    assert verdict.first_divergence == (1, "loss")
    assert verdict.pairs[0].loss_diff > 2 * verdict.loss_tolerance  # measured 2.8e-5 against the 1e-5 bar
    assert lines[-1].startswith("FAIL (loss within 1e-05, grad norm within 0.0001 relative): the loss diverges "
                                "first at step 1") and lines[-1].endswith(FORWARD)
    assert "RoPE base" in lines[-1]
    assert list(tmp_path.iterdir()) == []  # the temporary run directory is gone


def test_a_divergence_after_a_matching_first_step_points_at_the_setup():
    metrics = [{"step": 1, "loss": 2.0, "grad_norm": 3.0}, {"step": 2, "loss": 1.9, "grad_norm": 2.5}]
    verdict = judge(metrics, [2.0, 1.8], [3.0, 2.5], 1e-5, 1e-4)
    assert verdict.first_divergence == (2, "loss") and verdict.suggestion() == UPDATE
    assert "FAIL" in verdict.summary() and "setup" in verdict.summary()
    nan = judge([{"step": 1, "loss": float("nan"), "grad_norm": 3.0}], [2.0], [3.0], 1e-5, 1e-4)
    assert nan.first_divergence == (1, "loss")  # a NaN is never within tolerance
    norm = judge([{"step": 1, "loss": 2.0, "grad_norm": 6.0}], [2.0], [3.0], 1e-5, 1e-4)
    assert norm.first_divergence == (1, "grad norm") and "gradient reduction" in norm.suggestion()


def test_the_reference_trains_on_the_assistant_turns_of_a_chat_and_on_nothing_else():
    from toolkit.parity.reference import encode_record
    from toolkit.tinymodels import build_tokenizer
    from toolkit.train.chat_templates import NAMED

    chat = [{"role": "user", "content": "Capital of Peru?"}, {"role": "assistant", "content": "Lima."},
            {"role": "user", "content": "And Chile?"}, {"role": "assistant", "content": "Santiago."}]
    tokenizer = build_tokenizer(text=True)
    tokenizer.chat_template = NAMED["chatml"]
    tokens, mask = encode_record(tokenizer, {"dialogue": chat}, {"messages": "dialogue"})
    trained = tokenizer.decode([t for t, m in zip(tokens, mask) if m])
    assert trained == "<|im_start|>assistant\nLima.<|im_end|>\n<|im_start|>assistant\nSantiago.<|im_end|>\n"
    assert tokenizer.decode(tokens) == tokenizer.apply_chat_template(chat, tokenize=False)


def cli(args: list[str], capsys) -> tuple[int, str]:
    from toolkit.cli import main

    code = main(["parity", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    ("messages", r"^error: .*train\.jsonl:1: the data has messages but the tokenizer has no chat template: set "
                 r"data\.chat_template="),
    ("columns", r"^error: .*train\.jsonl:1: the reference reads prompt/response, messages or text records, not "
                r"\['question'\]$"),
    ("no-hf", r"^error: .* is not an HF model directory \(no config\.json\): give --hf DIR"),
    ("steps", r"^error: --steps must be at least 1, not 0$"),
    ("workdir", r"^error: --workdir .* is not empty: give a new or empty directory$"),
    ("nprocs", r"^error: --nprocs 3 is not a multiple of TP x PP x EP = 4"),
    ("lora", r"^error: a LoRA recipe needs peft\.init_from=ADAPTER_DIR"),
    ("shrink-odd", r"^error: --shrink-layers 3 is not divisible by the recipe's PP 2 x VPP 1"),
    ("shrink-all", r"^error: --shrink-layers 4: give a number of layers from 1 to 3 \(the model has 4\)$"),
])
def test_bad_input_is_one_line_and_writes_nothing(quickstart, tmp_path, capsys, monkeypatch, change, message):
    import re

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    data, checkpoint = quickstart["train"], Path(quickstart["good"])
    args = ["--config", str(QUICKSTART_RECIPE), f"model.checkpoint={checkpoint}"]
    if change in ("messages", "columns"):
        data = tmp_path / "train.jsonl"
        record = {"messages": [{"role": "user", "content": "1="}]} if change == "messages" else {"question": "1="}
        data.write_text(json.dumps(record) + "\n")
    if change == "no-hf":
        checkpoint = tmp_path / "mc"
        shutil.copytree(quickstart["good"], checkpoint)
        meta = json.loads((checkpoint / "toolkit_checkpoint.json").read_text())
        meta["hf_source"] = str(tmp_path / "moved-away")
        (checkpoint / "toolkit_checkpoint.json").write_text(json.dumps(meta))
        args[2] = f"model.checkpoint={checkpoint}"
    args.append(f"data.train_file={data}")
    args += {"steps": ["--steps", "0"], "workdir": ["--workdir", str(tmp_path)], "nprocs": ["--nprocs", "3"],
             "lora": ["peft.enabled=true"], "shrink-odd": ["--shrink-layers", "3"],
             "shrink-all": ["--shrink-layers", "4"]}.get(change, [])
    before = sorted(tmp_path.rglob("*"))
    code, err = cli(args, capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and re.search(message, err.strip()), err
    assert sorted(tmp_path.rglob("*")) == before  # nothing written, the temporary directory included


def test_a_model_too_big_for_one_process_is_refused_with_what_it_needs(tmp_path):
    from toolkit import modelspec
    from toolkit.memory import GIB
    from toolkit.memory.params import total_params
    from toolkit.parity.fit import reference_bytes, refuse_unless_fits

    # Llama 3.1 8B's published sizes (its tests/data copy is shrunk)
    config = json.loads((REPO / "tests" / "data" / "published_configs" / "llama-3.1-8b.json").read_text())
    config.update(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256)
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = modelspec.read(tmp_path / "config.json")
    needed = reference_bytes(spec, seq_len=2048, global_batch=8)
    assert needed > 16 * total_params(spec)  # fp32 weights, gradients, AdamW's two moments, and activations
    with pytest.raises(ParityError, match=r"^the HF reference does not fit in one process: about .* for 8\.03B "
                                          r"parameters .* and 24\.00 GiB is free in host memory") as refused:
        refuse_unless_fits(needed, 24 * GIB, "cpu", total_params(spec))
    assert "\n" not in str(refused.value)
    refuse_unless_fits(needed, needed, "cpu", total_params(spec))  # exactly enough passes


def test_a_shrunk_copy_is_the_models_first_layers_and_is_said_plainly(quickstart, tmp_path, monkeypatch):
    """--shrink-layers: the copy computes what the HF model cut after its first 2 layers computes, and
    a machine too small for the whole model (its free memory set below the reference's need, the one
    stand-in here: this machine cannot be made smaller) is told the --shrink-layers that fits."""
    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.convert.metadata import CheckpointMeta
    from toolkit.parity import fit, plan
    from toolkit.parity.shrink import shrink_hf, shrunk_spec

    copy = shrink_hf(Path(quickstart["hf"]), tmp_path / "hf-2", 2)
    whole = AutoModelForCausalLM.from_pretrained(quickstart["hf"], dtype=torch.float32)
    whole.model.layers = whole.model.layers[:2]
    whole.config.num_hidden_layers = 2
    tokens = torch.tensor([[1, 5, 7, 3, 9, 2]])
    shrunk = AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32)
    assert torch.equal(shrunk(tokens).logits, whole(tokens).logits)
    assert sum(p.numel() for p in shrunk.parameters()) == sum(p.numel() for p in whole.parameters())

    header = plan(request(quickstart, "good", 4, shrink_layers=2)).header()
    assert header[-1].startswith("  ON A SHRUNK COPY: the first 2 of the model's 4 layers, converted again")

    spec = CheckpointMeta.read(Path(quickstart["good"])).model_spec
    two_layers = fit.reference_bytes(shrunk_spec(spec, 2), 16, 64)
    monkeypatch.setattr(fit, "free_bytes", lambda device: two_layers)
    with pytest.raises(ParityError, match=r"does not fit in one process: .*, or on a shrunk copy of the model: "
                                          r"--shrink-layers 2 \(a copy of its first 2 layers\) fits$"):
        plan(request(quickstart, "good", 4))
