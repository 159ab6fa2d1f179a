"""The built-in example job run by the README's first command, end to end on CPU:

  1. create a tiny Llama (random weights, save_pretrained) and a digit-reversal task
  2. convert it to megatron-core TP=2 x PP=2 and check its logits against HF on 4 processes
  3. plan: rank the layouts for 4 processes and estimate this one's memory per process
  4. fine-tune it with recipes/finetune.py (megatron-core TP/PP + DeepSpeed ZeRO-1) on 4 processes;
     its DeepSpeed config comes from the generator (RUN_DIR/resolved_config.json)
  5. the recipe exports the result to HF; greedy generation must answer >= 90% of held-out prompts

With `lora=True` a LoRA adapter on the result then learns a second task (toolkit.quickstart_lora, steps 6-8).

Its 4 processes run on CPU unless the machine has a GPU for each (toolkit.runtime.recipe_launch): on a
1-GPU box the tiny example still runs, and every step of it is checked the same way.
"""

from __future__ import annotations

from pathlib import Path

from toolkit.errors import VerificationError
from toolkit.examples import REQUIRED_ACCURACY
from toolkit.runtime.recipe_launch import RECIPE_DIR, launch_recipe, on_cpu

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=16, max_position_embeddings=64)


def run(workdir: str | Path, tp: int = 2, pp: int = 2, steps: int | None = None, log=print, lora: bool = False) -> float:
    from toolkit.convert import hf_to_megatron, verify
    from toolkit.examples import exact_match, write_reversal_task
    from toolkit.tinymodels import make_tiny_model

    workdir = Path(workdir).absolute()
    hf_dir, mcore_dir, run_dir = workdir / "tiny-llama-hf", workdir / f"tiny-llama-tp{tp}-pp{pp}", workdir / "run"
    steps_total = 8 if lora else 5
    log(f"[1/{steps_total}] creating a tiny Llama and a digit-reversal task in {workdir}")
    if not hf_dir.exists():
        make_tiny_model("llama", hf_dir, dtype="float32", **TINY)
    train, valid, held_out = write_reversal_task(workdir / "data")

    log(f"[2/{steps_total}] converting to megatron-core TP={tp} PP={pp} and comparing logits with HF on {tp * pp} processes")
    hf_to_megatron(hf_dir, mcore_dir, tp=tp, pp=pp, overwrite=True, progress=False)
    report = verify(hf_dir, mcore_dir, cpu=on_cpu(tp * pp))
    for line in report.lines():
        log("      " + line)
    if not report.ok:
        raise VerificationError("megatron-core logits do not match the HF model")
    before = exact_match(hf_dir, held_out)

    log(f"[3/{steps_total}] planning layouts for {tp * pp} processes (toolkit plan)")
    _show_plan(mcore_dir, tp * pp, log)

    log(f"[4/{steps_total}] fine-tuning at TP={tp} x PP={pp} with DeepSpeed ZeRO-1 (recipes/tiny-cpu.yaml)")
    overrides = [f"model.checkpoint={mcore_dir}", f"data.train_file={train}", f"data.valid_file={valid}",
                 f"run_dir={run_dir}", f"parallel.tp={tp}", f"parallel.pp={pp}", "resume=none"]
    if steps:
        overrides.append(f"steps={steps}")
    launch_recipe(tp * pp, RECIPE_DIR / "tiny-cpu.yaml", overrides, run_dir)

    log(f"[5/{steps_total}] greedy generation with the exported HF model ({run_dir / 'hf'})")
    after = exact_match(run_dir / "hf", held_out)
    log(f"      exact match on {len(held_out)} held-out prompts: {before:.1%} before fine-tuning, {after:.1%} after")
    if after < REQUIRED_ACCURACY:
        raise VerificationError(f"the fine-tuned model answered only {after:.1%} of held-out prompts")
    if lora:
        from toolkit import quickstart_lora

        quickstart_lora.run(workdir, run_dir / "hf", tp=tp, pp=pp, log=log)
    log("quickstart finished")
    return after


def _show_plan(checkpoint: Path, processes: int, log) -> None:
    from toolkit.convert.metadata import CheckpointMeta
    from toolkit.memory import GIB
    from toolkit.plan import Cluster, plan

    spec = CheckpointMeta.read(checkpoint).model_spec
    result = plan(spec, Cluster(gpus=processes, gpu_memory=4 * GIB, gpus_per_node=processes), seq_len=16,
                  global_batch=64, precision="fp32")
    for candidate in result.ranked[:3]:
        # The planner's tok/s figure models GPUs; on this CPU run it would only mislead.
        log("      " + candidate.explain(result.cluster).rsplit(" -> ", 1)[0])
    log(f"      ({len(result.ranked)} layouts fit. The example runs TP2 x PP2, so DP is 1 on 4 processes: it shows "
        "tensor and pipeline parallelism; data parallelism is shown by the tests, e.g. TP2 x PP2 x DP2 on 8)")
