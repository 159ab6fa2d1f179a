"""The built-in example job run by the README's first command.

Creates a tiny Llama (random weights, saved with save_pretrained), converts it to megatron-core
TP=2 x PP=2, checks the megatron logits against HF on 4 CPU/GPU processes, converts back to HF
and checks that every tensor round-trips bit-exactly.
"""

from __future__ import annotations

from pathlib import Path

from toolkit.errors import VerificationError


def run(workdir: str | Path, tp: int = 2, pp: int = 2, log=print) -> None:
    import torch
    from safetensors.torch import load_file

    from toolkit.convert import hf_to_megatron, megatron_to_hf, verify
    from toolkit.tinymodels import make_tiny_model

    workdir = Path(workdir)
    hf_dir = workdir / "tiny-llama-hf"
    mcore_dir = workdir / f"tiny-llama-tp{tp}-pp{pp}"
    back_dir = workdir / "tiny-llama-roundtrip-hf"
    if not hf_dir.exists():
        log(f"[1/4] creating a tiny Llama at {hf_dir}")
        make_tiny_model("llama", hf_dir, dtype="bfloat16")
    log(f"[2/4] converting to megatron-core TP={tp} PP={pp} at {mcore_dir}")
    hf_to_megatron(hf_dir, mcore_dir, tp=tp, pp=pp, overwrite=True)
    log(f"[3/4] comparing megatron-core logits with HF on {tp * pp} processes")
    report = verify(hf_dir, mcore_dir)
    for line in report.lines():
        log("      " + line)
    if not report.ok:
        raise VerificationError("megatron-core logits do not match the HF model")
    log(f"[4/4] converting back to HF at {back_dir}")
    megatron_to_hf(mcore_dir, back_dir, overwrite=True)
    original, restored = load_file(hf_dir / "model.safetensors"), load_file(back_dir / "model.safetensors")
    same = set(original) == set(restored) and all(torch.equal(original[k], restored[k]) for k in original)
    if not same:
        raise VerificationError("round trip HF -> megatron -> HF is not bit-exact")
    log(f"      round trip bit-exact: {len(original)} tensors equal")
    log("quickstart finished")
