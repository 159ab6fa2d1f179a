"""Helpers for the fine-tuning tests: a tiny model, data with unequal lengths, launching the
recipe under torchrun; the independent single-process HF reference is toolkit/parity/reference.py."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

# The HF + torch AdamW reference lives in the library (toolkit parity runs it for users): one copy.
from toolkit.parity.reference import (GRAD_NORM_TOLERANCE, LOSS_TOLERANCE_FP32, differences,  # noqa: F401
                                      document_loss, hf_reference, peft_model, reference_lr_factor,
                                      recipe_rows, reference_rows, reference_samples, settings)

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "finetune.py"


def write_uneven_data(path: Path, n: int, seed: int = 0) -> Path:
    """Prompts and responses of different lengths, so micro-batches hold different token counts
    and a mean of per-micro-batch means would differ from the true mean."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        prompt = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 9))) + "="
        response = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 10)))
        lines.append(json.dumps({"prompt": prompt, "response": response}))
    path.write_text("\n".join(lines) + "\n")
    return path


def recipe(tmp: Path, checkpoint: Path, data: Path, **overrides) -> Path:
    cfg = {
        "model": {"checkpoint": str(checkpoint)},
        "data": {"train_file": str(data), "seq_len": 24, "shuffle": False},
        "optim": {"lr": 2e-3, "warmup_steps": 3, "schedule": "cosine", "weight_decay": 0.1, "clip_grad": 1.0},
        "precision": "fp32",
        "micro_batch": 2,
        "global_batch": 16,
        "steps": 10,
        "log_every": 1,
        "run_dir": str(tmp / "run"),
        "export_hf": False,
    }
    for key, value in overrides.items():
        section, _, name = key.partition("__")
        if name:
            cfg.setdefault(section, {})[name] = value
        else:
            cfg[key] = value
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def recipe_config(tmp: Path, overrides: list[str]):
    """The recipe's TrainConfig for the test recipe plus `overrides` (load_config's checks run)."""
    from toolkit.train.config import load_config

    data = write_uneven_data(tmp / "data.jsonl", 4)
    return load_config(str(recipe(tmp, tmp / "ckpt", data)), overrides)


def recipe_prepare():
    """recipes/finetune.py's `prepare` (every check before any process group), to call in process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_recipe", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.prepare


def assert_refused_in_one_line(tmp: Path, overrides: list[str], message: str) -> None:
    """The recipe's config refuses `overrides` before anything starts, with one line matching `message`."""
    import pytest

    from toolkit.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as refused:
        recipe_config(tmp, overrides)
    assert "\n" not in str(refused.value)


def launcher_command(nprocs: int, launcher: str) -> list[str]:
    if launcher == "fork":  # the ranks forked from one pre-imported process (tests/forkrun.py)
        return [sys.executable, str(REPO / "tests" / "forkrun.py"), str(nprocs)]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nprocs)]
    # DeepSpeed's launcher starts one process per "GPU"; on CPU it must be told how many.
    from toolkit.runtime.launch import free_port

    return [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(nprocs), "--master_port", str(free_port())]


class ForkServer:
    """tests/forkrun.py --serve, started at the first launch of this test process: each later launch
    forks its ranks from libraries imported once (about 4 s of CPU a launch less), not again per launch."""

    def __init__(self):
        self.proc = self.path = None

    def run(self, nprocs: int, argv: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
        import socket
        import tempfile

        if self.proc is None or self.proc.poll() is not None:
            self._start()
        with tempfile.TemporaryDirectory() as out:
            stdout, stderr = Path(out) / "stdout", Path(out) / "stderr"
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(self.path)
                conn.settimeout(timeout)
                stream = conn.makefile("rw")
                stream.write(json.dumps({"nprocs": nprocs, "script": argv[0], "args": argv[1:], "env": env,
                                         "cwd": os.getcwd(), "stdout": str(stdout), "stderr": str(stderr)}) + "\n")
                stream.flush()
                pid = json.loads(stream.readline())["pid"]
                try:
                    code = json.loads(stream.readline())["code"]
                except (TimeoutError, socket.timeout):
                    os.killpg(pid, signal.SIGKILL)
                    raise subprocess.TimeoutExpired(argv, timeout) from None
            return subprocess.CompletedProcess(argv, code, stdout.read_text(errors="replace"),
                                               stderr.read_text(errors="replace"))

    def _start(self) -> None:
        import atexit
        import shutil
        import tempfile

        directory = tempfile.mkdtemp(prefix="forkrun-")
        atexit.register(shutil.rmtree, directory, True)
        self.path = str(Path(directory) / "socket")
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "forkrun.py"), "--serve", self.path],
                                     env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready", "tests/forkrun.py --serve did not start"
        atexit.register(self.proc.kill)


FORK_SERVER = ForkServer()


def launch(nprocs: int, recipe_path: Path, *overrides: str, env: dict | None = None, wait: bool = True,
           launcher: str | None = None, expect_failure: bool = False, script: Path = RECIPE):
    """`script`: the recipe, or a test's wrapper that patches something and then runs it."""
    # Forked ranks save each rank the imports (tests/forkrun.py); CUDA must not be forked, so torchrun there.
    launcher = launcher or ("torchrun" if torch.cuda.is_available() else "fork")
    cmd = [*launcher_command(nprocs, launcher), str(script), "--config", str(recipe_path), *overrides]
    # os.environ carries TOOLKIT_STRICT_DEVICES=1 from tests/conftest.py: device-strict collectives.
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if not wait:
        return subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    if launcher == "fork" and "PYTHONPATH" not in (env or {}):  # another PYTHONPATH: other libraries to import
        result = FORK_SERVER.run(nprocs, [str(script), "--config", str(recipe_path), *overrides], full_env, timeout=900)
    else:
        result = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=900)
    if expect_failure:
        assert result.returncode != 0, result.stdout[-4000:]
    else:
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-6000:]
    return result


def kill_tree(pid: int) -> None:
    """SIGKILL the launcher and every rank: torchrun starts its workers in sessions of their own,
    so killing the launcher's process group would orphan them."""
    import psutil

    parent = psutil.Process(pid)
    for proc in [parent, *parent.children(recursive=True)]:
        proc.send_signal(signal.SIGKILL)


def wait_for(condition, proc, seconds: float = 600) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)


def copy_stopped_at_step_5(run_dir: Path, out_dir: Path) -> None:
    """out_dir/run: a copy of a 10-step run (saved at steps 5 and 10) as if it had stopped after its
    step-5 checkpoint: step 10 and its metrics never written."""
    import shutil

    shutil.copytree(run_dir, out_dir / "run")
    checkpoints = out_dir / "run" / "checkpoints"
    shutil.rmtree(checkpoints / "step_0000010")
    (checkpoints / "latest").write_text("step_0000005")
    metrics = out_dir / "run" / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()[:5]))


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def write_peft_adapter(hf_dir: Path, out: Path, targets, r: int = 4, alpha: float = 8.0, use_rslora: bool = False,
                       seed: int = 0, target_parameters=None) -> Path:
    """An adapter saved by HF PEFT itself for the HF model: PEFT's initialisation, then B drawn
    non-zero so that the adapter changes the model from the first step. `target_parameters`:
    PEFT's LoRA on fused (3-D) expert weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, use_rslora=use_rslora,
                        target_parameters=target_parameters)
    peft = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    peft.save_pretrained(out)
    return out


STEPS = 10
# bf16 rounds weights and activations: a loss within 2e-2 of the fp32 reference over 10 steps, and
# the gradient norm within 2e-2 relative (measured up to 6.1e-3: PP2 untied; 2.2e-3 Gemma 3 at TP2
# with SP; 2.8e-3 FSDP; 4.7e-3 LoRA at PP2). A wrong loss scale (x2) stays within the loss bar (2.4e-3) and is 1.0 off
# on the gradient norm (tests/test_finetune_parity.py's guard).
LOSS_TOLERANCE_BF16 = 2e-2
GRAD_NORM_TOLERANCE_BF16 = 2e-2
# The variants parity_setup builds as Gemma 3's 4B / 12B / 27B and Qwen3.5 are published: the tiny text model
# inside Gemma3ForConditionalGeneration / Qwen3_5ForConditionalGeneration (toolkit.tinymodels)
GEMMA3_WRAPPER, QWEN3_5_WRAPPER = "gemma3-multimodal", "qwen3.5-multimodal"
# The text models inside the vision-language wrappers of 2026 (issue 40), each as its wrapper class is published:
# Qwen3-VL (Qwen3VLForConditionalGeneration), GLM-4.6V-Flash (Glm46VForConditionalGeneration, the dense glm4v_text)
# and Ministral 3 (Mistral3ForConditionalGeneration)
QWEN3_VL_WRAPPER, GLM46V_FLASH_WRAPPER, MINISTRAL3_WRAPPER = "qwen3-vl-multimodal", "glm4.6v-flash-multimodal", \
    "ministral3-multimodal"
# name -> toolkit.tinymodels variant; each with 4 layers and a vocab of 250 padded to 256. Gemma 3 and Qwen3.5 as
# the wrappers: their fine-tunes cover the text models they convert to (Gemma 3's text checkpoint's own fine-tune
# at TP2 x PP2 x DP2 is tests/test_sequence_parallel.py's)
PARITY_MODELS = {"untied": "llama-odd-vocab", "tied": "llama-tied", "qwen3": "qwen3", "phi3": "phi3",
                 "phi4-mini": "phi4-mini", "gemma3-wrapper": GEMMA3_WRAPPER, "olmo2": "olmo2", "olmo3": "olmo3",
                 "smollm3": "smollm3", "qwen3.5-wrapper": QWEN3_5_WRAPPER, "olmo-hybrid": "olmo-hybrid",
                 "nemotron-3": "nemotron-h", "qwen3-vl-wrapper": QWEN3_VL_WRAPPER,
                 "glm4.6v-flash-wrapper": GLM46V_FLASH_WRAPPER, "ministral3-wrapper": MINISTRAL3_WRAPPER}
# Nemotron-H's tiny variant with Nemotron 3's MoE layers (E: 4 experts top-2 by the sigmoid router with its expert
# bias, one shared expert) among its Mamba-2, attention and MLP layers, each kind on both PP 2 stages
NEMOTRON3_LAYERS = {"hybrid_override_pattern": "M-*EM*E-", "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48}
OF_NAME = {"nemotron-3": NEMOTRON3_LAYERS}


# Recipe keys that change the run but not the HF reference: the layout, the run's precision and
# loss scaling, the MoE dispatcher, where and how often it writes. Every other key (data, optim,
# steps, batch sizes, LoRA, the MoE router's aux loss and dtype...) keys the reference cache.
RUN_ONLY_KEYS = ("parallel", "precision", "loss_scale", "run_dir", "export_hf", "save_every", "log_every",
                 "model.checkpoint", "moe.dispatcher", "wandb")


def reference_key(cfg_path: Path, *extra) -> str:
    """The recipe at `cfg_path` less RUN_ONLY_KEYS, with `extra` (the HF model, an adapter...), as
    one string: two recipes that share it have the same HF reference. Settings given to the launch
    on its command line are not in it: give the ones that change the reference in the recipe."""
    cfg = yaml.safe_load(cfg_path.read_text())
    for dotted in RUN_ONLY_KEYS:
        section, _, name = dotted.partition(".")
        if name:
            cfg.get(section, {}).pop(name, None)
        else:
            cfg.pop(section, None)
    return json.dumps([cfg, *map(str, extra)], sort_keys=True)


class ReferenceCache:
    """HF reference results computed once per reference_key: a guard of 2 steps, or a recipe with
    another learning rate, gets its own reference, not whichever was computed first."""

    def __init__(self):
        self.results: dict[str, object] = {}

    def get(self, cfg_path: Path, compute, *extra):
        key = reference_key(cfg_path, *extra)
        if key not in self.results:
            self.results[key] = compute()
        return self.results[key]


def hf_eval_loss_after_training(hf_dir: Path, data: Path, valid: Path, cfg_path: Path) -> float:
    """The reference's eval loss at the end of a run: HF trained over the recipe's steps (hf_reference),
    then the token-weighted mean loss over every full global batch of `valid` (at least one), one
    forward per document, as recipes/finetune.py evaluates at its last step."""
    cfg = settings(cfg_path)
    data_cfg, steps, batch = cfg["data"], cfg["steps"], cfg["global_batch"]
    trained = {}
    hf_reference(hf_dir, data, cfg, steps, on_step=lambda step, model: trained.update(model=model))
    rows = recipe_rows(hf_dir, valid, data_cfg)
    assert len(rows) >= batch, f"{valid}: fewer rows than a global batch ({len(rows)} < {batch})"
    with torch.no_grad():
        loss, _ = document_loss(trained["model"].eval(), rows[:len(rows) // batch * batch], cfg, "cpu")
    return float(loss)


def parity_setup(root: Path, models: dict):
    """Tiny fp32 HF models converted to torch_dist, uneven data, and `reference(name, cfg_path)`:
    the HF reference of model `name` for the recipe at cfg_path (its steps), computed once."""
    from toolkit.convert import hf_to_megatron
    from functools import partial

    from toolkit.tinymodels import (make_tiny_gemma3_multimodal, make_tiny_glm4v_multimodal,
                                    make_tiny_mistral3_multimodal, make_tiny_model, make_tiny_qwen3_5_multimodal,
                                    make_tiny_qwen3_vl_multimodal)

    data = write_uneven_data(root / "data.jsonl", 300)
    built = {}
    gemma3_layers = {"layer_types": ["sliding_attention", "full_attention"] * 2}
    # OLMo-Hybrid at its class's init std (its tiny variant's 0.1 sharpens it for the logit guards). Trained 10 steps
    # at 0.1 the losses match HF's within 6.7e-6 and the first step's gradient norm within 4e-7 relative, at TP1 as
    # at TP2xPP2, but later norms drift apart (8.4e-4 at TP1, 4.6e-4 at TP2xPP2, growing with the step): the
    # optimizer amplifying fp32 rounding of two different kernels, not a layout's sum (TP1 drifts as much).
    # At 0.02: 2.1e-6 and 5.5e-6.
    of_variant = {"gemma3": gemma3_layers, GEMMA3_WRAPPER: gemma3_layers, "olmo-hybrid": {"initializer_range": 0.02}}
    wrappers = {GEMMA3_WRAPPER: make_tiny_gemma3_multimodal, QWEN3_5_WRAPPER: make_tiny_qwen3_5_multimodal,
                QWEN3_VL_WRAPPER: make_tiny_qwen3_vl_multimodal,
                GLM46V_FLASH_WRAPPER: partial(make_tiny_glm4v_multimodal, glm46v=True, dense=True),
                MINISTRAL3_WRAPPER: partial(make_tiny_mistral3_multimodal, text_variant="ministral3")}
    for name, variant in models.items():
        size = dict(dtype="float32", num_hidden_layers=4, vocab_size=250, **of_variant.get(variant, {}), **OF_NAME.get(name, {}))
        wrapper = wrappers.get(variant)
        hf = wrapper(root / f"hf-{name}", **size) if wrapper else make_tiny_model(variant, root / f"hf-{name}", **size)
        built[name] = (hf, hf_to_megatron(hf, root / f"mc-{name}", fmt="torch_dist", progress=False))
    cache = ReferenceCache()

    def reference(name, cfg_path):
        steps = yaml.safe_load(cfg_path.read_text())["steps"]
        return cache.get(cfg_path, lambda: hf_reference(built[name][0], data, cfg_path, steps), built[name][0])

    return root, data, built, reference


def run_against_reference(setup, tmp_path: Path, nprocs: int, model: str, pack: bool = False, script: Path = RECIPE,
                          env: dict | None = None, **overrides) -> tuple[list[dict], float, float]:
    """Launch `script` (the recipe, or a guard's wrapper) on the recipe with `overrides`: (its
    metrics, and its differences from the HF reference of the same recipe)."""
    _, data, models, reference = setup
    cfg = recipe(tmp_path, models[model][1], data, data__pack=pack, **overrides)
    launch(nprocs, cfg, script=script, env=env)
    metrics = read_metrics(tmp_path / "run")
    return (metrics, *differences(metrics, *reference(model, cfg)))


def compare_with_reference(setup, tmp_path: Path, nprocs: int, model: str, tolerance: float = LOSS_TOLERANCE_FP32,
                           pack: bool = False, norm_tolerance: float = GRAD_NORM_TOLERANCE, **overrides) -> list[dict]:
    """Launch the recipe; at every one of its STEPS steps its loss within `tolerance` of the HF
    reference, and its gradient norm within `norm_tolerance` (relative, as `differences`)."""
    metrics, loss, norm = run_against_reference(setup, tmp_path, nprocs, model, pack, **overrides)
    print(f"{model} x {nprocs} processes: max |loss - reference| {loss:.1e}, grad norm relative {norm:.1e}")
    assert len(metrics) == STEPS
    assert loss < tolerance, (f"max |loss - reference| = {loss:.2e}", [m["loss"] for m in metrics])
    assert norm < norm_tolerance, (f"grad norm relative {norm:.2e}", [m["grad_norm"] for m in metrics])
    return metrics
