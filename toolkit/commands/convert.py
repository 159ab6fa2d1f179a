"""`toolkit convert {hf-to-megatron,megatron-to-hf,verify}`."""

from __future__ import annotations

import argparse
import math
import textwrap

TO_MEGATRON_HELP = """\
Split an HF checkpoint (config.json + *.safetensors) into megatron-core GPTModel shards for a
TP x PP layout. Reads each tensor slice straight from the safetensors files and writes every
output file as soon as it is complete (memory: about one output file). The result is built under
a temporary name and appears at OUT_DIR only when complete.

Formats:
  torch       Megatron-LM per-rank files: release/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt
              (_EEE: the expert-parallel rank, when --ep > 1)
  torch_dist  megatron-core distributed checkpoint; loads into any TP/PP/EP layout

Supported model_types (the families in toolkit/families/; Mixture-of-Experts ones take --ep):
{families}
Multimodal checkpoints converted as their language model (export back with --into-wrapper):
{wrappers}
"""

VERIFY_HELP = """\
Run the megatron checkpoint in megatron-core on TP x PP local processes (gloo on CPU, NCCL on
GPUs) and the HF model on the same random tokens, then print max |dlogit| over the true vocab,
top-1 agreement and the first decoder layer whose output diverges. Stage lines on stderr show
where it is (the launch imports megatron-core: ~15 s on a small CPU machine). Exits 1 on a mismatch,
including a file whose checksum differs from the conversion metadata.

Tolerances (max |dlogit|): float32 1e-4, bfloat16 5e-2, float16 1e-2.
Memory: the HF model in the chosen dtype in this process (4 bytes/parameter in float32) plus
each worker's shard (4 bytes/parameter / (TP*PP) in float32): about 8 bytes/parameter in all
for float32, 4 for bfloat16.
"""


def register(sub) -> None:
    convert = sub.add_parser("convert", help="convert checkpoints between HF and megatron-core")
    csub = convert.add_subparsers(dest="convert_command", metavar="SUBCOMMAND", required=True)

    from toolkit.families import FAMILIES  # no torch: cheap at start-up

    from toolkit.convert.wrapper import WRAPPERS  # no torch either

    families = ", ".join(t for family in FAMILIES for t in family.model_types)
    wrappers = ", ".join(f"{w.model_type} ({w.architecture})" for w in WRAPPERS)
    p = csub.add_parser("hf-to-megatron", help="HF checkpoint -> megatron-core TP x PP shards",
                        description=TO_MEGATRON_HELP.format(families=textwrap.fill(families, 96, initial_indent="  ",
                                                                                   subsequent_indent="  "), wrappers="  " + wrappers), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hf_dir", help="HF model directory (config.json, *.safetensors, tokenizer files)")
    p.add_argument("out_dir", help="output directory (must not exist or be empty, unless --overwrite)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size for Mixture-of-Experts models (default 1): each EP rank holds "
                        "experts/EP experts, split over TP as well")
    p.add_argument("--format", dest="fmt", choices=("torch", "torch_dist"), default="torch")
    p.add_argument("--layer-spec", choices=("te", "local"), default=None,
                   help="parameter names in torch-format files: Transformer Engine (what GPU training uses) or "
                        "megatron-core's local spec; default: the spec the model needs where it converts for one "
                        "only (local for multi-latent attention: DeepSeek-V3, Kimi-K2), else te")
    p.add_argument("--vocab-divisor", type=int, default=128,
                   help="pad the vocab with zero rows to a multiple of this x TP (Megatron-LM's "
                        "make_vocab_size_divisible_by; default 128)")
    p.add_argument("--verbose", action="store_true",
                   help="also print which config.json keys were read, and the values transformers' config class "
                        "gave the keys the file leaves out")
    _add_output_flags(p)
    p.set_defaults(func=_to_megatron)

    p = csub.add_parser("megatron-to-hf", help="megatron-core shards -> HF safetensors directory",
                        description="Merge TP x PP shards back into an HF directory that "
                                    "AutoModelForCausalLM.from_pretrained loads. Vocab padding is stripped.")
    p.add_argument("megatron_dir", help="checkpoint written by hf-to-megatron, or a Megatron-LM torch-format checkpoint "
                                        "(with --adapter: a LoRA run's RUN/checkpoints/step_N)")
    p.add_argument("out_dir")
    p.add_argument("--adapter", action="store_true",
                   help="export the LoRA adapter of a training checkpoint as an HF PEFT directory")
    p.add_argument("--merge", action="store_true",
                   help="with --adapter: the whole HF model with the adapter merged in (fp32, then the base's dtype)")
    p.add_argument("--hf-config", help="HF config.json (or model directory) for checkpoints not written by this toolkit")
    p.add_argument("--max-shard-gb", type=positive_float, default=4.0, help="split the safetensors output above this size")
    p.add_argument("--into-wrapper", metavar="HF_DIR",
                   help="write the language model back into the multimodal checkpoint it was converted from (Gemma 3 "
                        "4B/12B/27B): its vision tower, projector and config copied unchanged")
    _add_output_flags(p)
    p.set_defaults(func=_to_hf)

    p = csub.add_parser("verify", help="compare megatron-core logits with the HF model",
                        description=VERIFY_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hf_dir")
    p.add_argument("megatron_dir")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--seq-len", type=positive_int, default=32)
    p.add_argument("--batch", type=positive_int, default=2)
    p.add_argument("--cpu", action="store_true",
                   help="run the TP x PP processes on CPU (gloo) even where CUDA is present; without it, "
                        "TP x PP processes need as many GPUs")
    p.add_argument("--no-progress", action="store_true", help="no stage lines on stderr")
    p.set_defaults(func=_verify)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _add_output_flags(p) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help="replace a non-empty OUT_DIR: the new result is built aside, then swapped in with "
                        "two renames and the old one deleted")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _to_megatron(args) -> int:
    import gc

    gc.disable()  # during the imports (torch's): their collections were 0.35-0.45 s of 2.0-2.4 s here, before the first byte
    try:
        from toolkit.convert import hf_to_megatron
    finally:
        gc.enable()

    out = hf_to_megatron(args.hf_dir, args.out_dir, tp=args.tp, pp=args.pp, ep=args.ep, fmt=args.fmt,
                         layer_spec=args.layer_spec, vocab_divisor=args.vocab_divisor, overwrite=args.overwrite,
                         progress=_progress(args))
    experts = f" EP={args.ep}" if args.ep > 1 else ""
    print(f"wrote {args.fmt} checkpoint TP={args.tp} PP={args.pp}{experts} to {out}")
    if args.verbose:
        from toolkit.convert.hf_config import config_reading

        print("\n".join(config_reading(args.hf_dir).lines()))
    return 0


def _to_hf(args) -> int:
    from toolkit.convert import megatron_to_hf
    from toolkit.errors import ConversionError

    if args.merge and not args.adapter:
        raise ConversionError("--merge merges a LoRA adapter: give --adapter with a LoRA run's checkpoint")
    if args.adapter and args.into_wrapper:
        raise ConversionError("--into-wrapper writes a whole model: it does not combine with --adapter")
    if args.adapter:
        from toolkit.lora.export import export_adapter

        out = export_adapter(args.megatron_dir, args.out_dir, merge=args.merge, overwrite=args.overwrite,
                             progress=_progress(args))
        print(f"wrote {'HF model with the adapter merged' if args.merge else 'HF PEFT adapter'} to {out}")
        return 0

    out = megatron_to_hf(args.megatron_dir, args.out_dir, hf_config=args.hf_config, overwrite=args.overwrite,
                         max_shard_bytes=int(args.max_shard_gb * (1 << 30)), progress=_progress(args),
                         wrapper=args.into_wrapper)
    print(f"wrote HF checkpoint to {out}")
    return 0


def _verify(args) -> int:
    from toolkit.convert import verify

    report = verify(args.hf_dir, args.megatron_dir, dtype=args.dtype, seq_len=args.seq_len, batch=args.batch,
                    cpu=args.cpu, progress=not args.no_progress)
    print("\n".join(report.lines()))
    return 0 if report.ok else 1


def _progress(args) -> bool | None:
    return False if args.no_progress else None
