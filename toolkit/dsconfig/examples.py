"""The example configs in ds_configs/, each with the command that regenerates it.

    python -m toolkit.dsconfig.examples          # rewrite ds_configs/ (JSON, YAML and README.md)

Each example is a `toolkit` command line; regenerating runs exactly that command, so the README's
commands are the ones that produced the files. tests/test_ds_configs.py regenerates everything
into a temporary directory and fails on any difference.
"""

from __future__ import annotations

import contextlib
import io
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = "ds_configs"
MODELS = f"{ROOT}/models"


@dataclass(frozen=True)
class Example:
    name: str  # file name without .json
    what: str
    model: str  # directory under ds_configs/models
    gpus: int
    tp: int = 1
    pp: int = 1
    args: str = ""  # the rest of the command line
    extra_files: tuple[str, ...] = ()  # other files the command writes, relative to ds_configs/

    def argv(self, root: str = ROOT) -> list[str]:
        out = f"{root}/{self.name}.json"
        args = self.args.replace("{root}", root)
        layout = ["--gpus", str(self.gpus)] + (["--tp", str(self.tp)] if self.tp > 1 else []) + (
            ["--pp", str(self.pp)] if self.pp > 1 else [])
        return ["ds-config", f"{root}/models/{self.model}", *layout, *shlex.split(args), "-o", out]

    def shell(self) -> str:
        return "toolkit " + shlex.join(self.argv())


EXAMPLES = (
    Example("zero1-bf16-8gpu", "ZeRO-1, bf16, one node", "llama-3-8b", 8,
            args="--zero 1 --micro-batch 4 --global-batch 128 --lr 2e-5 --warmup-steps 100 --total-steps 2000"),
    Example("zero2-bf16-8gpu", "ZeRO-2, bf16, one node", "llama-3-8b", 8,
            args="--zero 2 --micro-batch 2 --global-batch 64 --lr 2e-5 --warmup-steps 100 --total-steps 2000"),
    Example("zero3-bf16-8gpu", "ZeRO-3, bf16, one node", "llama-3-8b", 8,
            args="--zero 3 --micro-batch 2 --global-batch 64 --lr 2e-5 --warmup-steps 100 --total-steps 2000"),
    Example("zero2-fp16-8gpu", "ZeRO-2, fp16 with dynamic loss scaling (V100/T4-class GPUs)", "llama-3-8b", 8,
            args="--zero 2 --fp16 --micro-batch 1 --global-batch 64 --lr 2e-5 --warmup-steps 100 --total-steps 2000"),
    Example("zero3-offload-optimizer-70b-8gpu", "ZeRO-3 + optimizer offload to CPU: 70B on one 8 x 80 GiB node",
            "llama-3-70b", 8, args="--zero 3 --offload-optimizer cpu --micro-batch 1 --global-batch 64 --lr 1e-5 "
                                   "--warmup-steps 50 --total-steps 1000"),
    Example("zero3-offload-all-70b-8gpu", "ZeRO-3 + optimizer and parameter offload to CPU", "llama-3-70b", 8,
            args="--zero 3 --offload-optimizer cpu --offload-param cpu --micro-batch 1 --global-batch 64 "
                 "--lr 1e-5 --warmup-steps 50 --total-steps 1000"),
    Example("zero3-nvme-70b-8gpu", "ZeRO-Infinity: optimizer and parameters on local NVMe (parse-checked only)",
            "llama-3-70b", 8, args="--zero 3 --offload-optimizer nvme --offload-param nvme --nvme-path /local_nvme "
                                   "--micro-batch 1 --global-batch 64 --lr 1e-5 --warmup-steps 50 --total-steps 1000"),
    Example("tp8-pp2-zero1-70b-64gpu", "megatron-core TP 8 x PP 2 + ZeRO-1 over DP 4, the recipe's schedule mode",
            "llama-3-70b", 64, tp=8, pp=2,
            args="--zero 1 --schedule megatron --micro-batch 1 --global-batch 256 --lr 1e-5 --warmup-steps 50 "
                 "--total-steps 1000 --tensorboard runs/tb"),
    Example("tp8-zero3-70b-64gpu", "megatron-core TP 8 + ZeRO-3 over DP 8 (no PP: ZeRO-3 excludes it)",
            "llama-3-70b", 64, tp=8,
            args="--zero 3 --schedule megatron --micro-batch 1 --global-batch 256 --lr 1e-5 --warmup-steps 50 "
                 "--total-steps 1000"),
    Example("tp8-pp8-zero1-70b-512gpu", "64 nodes: TP 8 in a node, PP 8 across nodes, ZeRO-1 over DP 8",
            "llama-3-70b", 512, tp=8, pp=8,
            args="--zero 1 --schedule megatron --micro-batch 1 --global-batch 1024 --lr 1e-5 --warmup-steps 50 "
                 "--total-steps 1000 --csv runs/csv"),
    Example("zero2-bf16-512gpu", "pure data parallelism at 512 GPUs (8B), plain DeepSpeed", "llama-3-8b", 512,
            args="--zero 2 --micro-batch 2 --global-batch 2048 --lr 3e-5 --warmup-steps 100 --total-steps 5000"),
    Example("hf-trainer-zero3-8gpu", "ZeRO-3 with \"auto\" values for the HF Trainer, and an Accelerate config",
            "llama-3-8b", 8, args="--zero 3 --hf-trainer --accelerate-yaml {root}/hf-trainer-zero3-8gpu.accelerate.yaml",
            extra_files=("hf-trainer-zero3-8gpu.accelerate.yaml",)),
)


def regenerate(root: str = ROOT) -> list[Path]:
    """Run every example's command with outputs under `root`; write README.md; return the paths."""
    from toolkit.cli import main

    written = []
    for example in EXAMPLES:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            code = main(example.argv(root))
        if code != 0:
            raise RuntimeError(f"{example.shell()} exited with {code}")
        written.append(Path(root) / f"{example.name}.json")
        written += [Path(root) / f for f in example.extra_files]
    readme = Path(root) / "README.md"
    readme.write_text(readme_text())
    return written + [readme]


def readme_text() -> str:
    lines = [
        "# Example DeepSpeed configs",
        "",
        "Generated by `python -m toolkit.dsconfig.examples`, which runs the command listed for each",
        "file; `tests/test_ds_configs.py` regenerates them and fails on any difference. Every file is",
        "accepted by DeepSpeed's own parser at its data-parallel size (and by `toolkit ds-config check`).",
        "The model configs are in `models/` (published config.json files: Llama-3, 3.1, 3.3 and Qwen3; the",
        "GPU recipes in `recipes/` are checked against them). `toolkit plan -o DIR` writes the DeepSpeed config",
        "of its best layout into DIR/PLAN.md, next to the recipe that builds it.",
        "",
        "| file | what | command |",
        "|---|---|---|",
    ]
    for e in EXAMPLES:
        lines.append(f"| `{e.name}.json` | {e.what} | `{e.shell()}` |")
    lines += [
        "",
        "Files whose command uses `--schedule megatron` are for the toolkit's fine-tuning recipe: megatron-core",
        "runs the micro-batches, so DeepSpeed sees one step per global batch (`gradient_accumulation_steps: 1`,",
        "`managed_gradient_accumulation: false`). The others are for plain DeepSpeed and HF users.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    for path in regenerate(sys.argv[1] if len(sys.argv) > 1 else ROOT):
        print(path)
