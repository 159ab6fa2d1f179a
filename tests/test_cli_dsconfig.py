"""`toolkit ds-config`, `ds-config check`, `memory`: thin shells, one-line errors, lazy imports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "ds_configs" / "models" / "llama-3-8b")


def toolkit(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolkit", *argv], capture_output=True, text=True, cwd=ROOT)


def test_help_imports_neither_torch_nor_deepspeed():
    code = ("import sys\nfrom toolkit.cli import build_parser\nbuild_parser().format_help()\n"
            "heavy = [m for m in ('torch', 'deepspeed', 'megatron', 'transformers') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr


def test_write_then_check_round_trip_and_exit_codes(tmp_path):
    out = tmp_path / "z2.json"
    run = toolkit("ds-config", MODEL, "--nodes", "2", "--zero", "2", "--micro-batch", "2", "--global-batch", "64",
                  "-o", str(out))
    assert run.returncode == 0, run.stderr
    assert "TP 1 x PP 1 x DP 16, ZeRO-2" in run.stderr
    assert json.loads(out.read_text())["gradient_accumulation_steps"] == 2
    assert toolkit("ds-config", "check", str(out), "--gpus", "16").returncode == 0
    wrong = toolkit("ds-config", "check", str(out), "--gpus", "8")
    assert wrong.returncode == 1
    assert "64 != train_micro_batch_size_per_gpu x gradient_accumulation_steps x DP = 2 x 2 x 8 = 32" in wrong.stdout


def test_refusal_is_one_line_without_traceback():
    run = toolkit("ds-config", MODEL, "--gpus", "16", "--pp", "2", "--zero", "3")
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("error: ZeRO-3 cannot be combined")
    both = toolkit("ds-config", MODEL, "--gpus", "8", "--bf16", "--fp16")
    assert both.stderr == "error: fp16 and bf16 cannot both be enabled (DeepSpeed asserts); choose one\n"


def test_memory_says_what_would_fit():
    run = toolkit("memory", str(ROOT / "ds_configs" / "models" / "llama-3-70b"), "--gpus", "8", "--zero", "3",
                  "--recompute", "full", "--gpu-memory", "80GiB")
    assert run.returncode == 1, run.stderr
    assert "does not fit" in run.stdout and "nothing fits in 8 x 80 GiB without offload" in run.stdout
    assert "optimizer states" in run.stdout and "activations" in run.stdout


def test_memory_suggests_recompute_when_the_same_layout_would_fit():
    run = toolkit("memory", MODEL, "--gpus", "8", "--zero", "3", "--micro-batch", "2", "--seq-len", "8192",
                  "--gpu-memory", "80GiB")
    assert run.returncode == 1, run.stderr
    assert "note: the same layout fits with --recompute full" in run.stdout


def test_model_can_be_a_converted_checkpoint(tmp_path):
    """A checkpoint written by `toolkit convert` carries the ModelSpec it was built from."""
    from toolkit.convert.metadata import CheckpointMeta
    from toolkit.dsconfig import Setup, build
    from toolkit.modelspec import read

    spec = read(MODEL)
    CheckpointMeta(format="torch_dist", layer_spec="local", tp=2, pp=1, vocab_divisor=128,
                   vocab_size=spec.vocab_size, padded_vocab_size=spec.vocab_size, spec=spec.to_dict()).write(tmp_path)
    assert read(tmp_path) == spec
    assert build(Setup(gpus=8, zero=2), read(tmp_path)) == build(Setup(gpus=8, zero=2), spec)
    assert read(Path(MODEL) / "config.json") == spec


def test_no_total_steps_gives_a_constant_lr_and_the_summary_says_so(tmp_path, capsys):
    from toolkit.cli import main

    out = tmp_path / "z1.json"
    assert main(["ds-config", MODEL, "--gpus", "8", "-o", str(out)]) == 0
    config = json.loads(out.read_text())
    assert "scheduler" not in config and config["optimizer"]["params"]["lr"] == 1e-5
    summary = capsys.readouterr().err
    assert "constant LR 1e-05 (--lr not given: the default; no --total-steps, so no decay schedule)" in summary
    assert main(["ds-config", MODEL, "--gpus", "8", "--warmup-steps", "50", "--lr", "2e-5", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["scheduler"]["type"] == "WarmupLR"
    assert "constant LR 2e-05 after 50 warmup steps (no --total-steps" in capsys.readouterr().err
    assert main(["ds-config", MODEL, "--gpus", "8", "--lr", "2e-5", "--total-steps", "500", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["scheduler"]["params"]["total_num_steps"] == 500
    assert "cosine LR decay from 2e-05 to 0 at step 500\n" in capsys.readouterr().err


def test_nonsense_values_are_one_line_errors(tmp_path, capsys):
    from toolkit.cli import main

    for flags, message in ((["--lr", "nan"], "lr must be a finite number >= 0 (got nan)"),
                           (["--gradient-clipping", "-1"], "gradient_clipping must be a finite number >= 0"),
                           (["--scheduler", "cosine"], "WarmupCosineLR decays the LR to its minimum")):
        assert main(["ds-config", MODEL, "--gpus", "8", *flags, "-o", str(tmp_path / "x.json")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "x.json").exists()


def test_a_batch_or_step_count_that_is_not_an_integer_is_one_line(capsys):
    from toolkit.cli import main

    for flags, message in ((["--micro-batch", "inf"], "argument --micro-batch: invalid int value: 'inf'"),
                           (["--global-batch", "nan"], "argument --global-batch: invalid int value: 'nan'"),
                           (["--total-steps", "2.5"], "argument --total-steps: invalid int value: '2.5'")):
        with pytest.raises(SystemExit) as exited:
            main(["ds-config", MODEL, "--gpus", "8", *flags])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err == f"error: {message} (see toolkit ds-config --help)\n", err
