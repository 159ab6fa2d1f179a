"""Peak memory of `toolkit ckpt reshard` (issue 13: bounded by the largest tensor shard).

One short fine-tuning run (TP1 x PP2, 2 processes, one step) writes a checkpoint of a model larger
than the tests' (default: hidden 512, 4 layers, vocabulary 8192, ~30 M parameters); it is then
resharded to TP2 x PP1 in a fresh process, which reports the high-water mark of its own memory
(RssAnon + RssShmem, sampled every millisecond: not the page cache of the files it maps or
copies) above what it held after its imports (and the lazy ones opening a checkpoint makes),
and that of its whole resident set (which counts the memory-mapped input and scratch pages the
kernel may evict). Printed beside them: the largest tensor shard of the input's and of the
output's rank files, the largest output rank file, the checkpoint's size, and the ratio of the
peak to the largest output shard.

The bound (toolkit.convert.reslice): one output shard is resident at a time, built from the
memory-mapped input and written before the next is built, plus a small constant (the 1 MiB
buffer and thread that hash the file behind the writes, the unpickled rank-file headers): peak <=
largest output shard + about 5 MiB, whatever the model's size. train/ is copied file by file in the kernel (no process memory).

    python benchmarks/reshard_bench.py [--hidden 512] [--layers 4] [--vocab 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20


def write_checkpoint(root: Path, hidden: int, layers: int, vocab: int) -> Path:
    from toolkit.convert import hf_to_megatron
    from toolkit.tinymodels import make_tiny_model

    hf = make_tiny_model("llama", root / "hf", dtype="float32", hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4, vocab_size=vocab,
                         max_position_embeddings=256)
    mc = hf_to_megatron(hf, root / "mc", fmt="torch_dist", vocab_divisor=1, progress=False)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": "0123456789" * 3}) + "\n" for _ in range(64)))
    run = root / "run"
    overrides = [f"model.checkpoint={mc}", f"data.train_file={data}", "data.seq_len=32", "micro_batch=2",
                 "global_batch=2", "steps=1", "save_every=1", f"run_dir={run}", "precision=fp32", "export_hf=false",
                 "parallel.pp=2", "resume=none"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    str(REPO / "recipes" / "finetune.py"), *overrides], env=env, check=True, capture_output=True)
    return run


def measure(source: str, out: str) -> None:
    """In the child: reshard, print the peak anonymous and resident memory above the post-import level (MiB)."""
    import toolkit.train.reshard as reshard_module
    from toolkit.convert.megatron_checkpoint import MegatronCheckpoint
    from toolkit.train.checkpoint_info import resolve

    MegatronCheckpoint.open(resolve(Path(source)) / "model")  # its lazy imports (transformers' configs) first
    anon_before, rss_before = _own_mib(), _status_mib("VmRSS")
    peak, done = [anon_before], threading.Event()

    def sample():
        while not done.wait(SAMPLE_S):
            peak[0] = max(peak[0], _own_mib())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    reshard_module.reshard(source, out, tp=2, pp=1)
    done.set()
    sampler.join()
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({"own_peak_above_imports_mib": peak[0] - anon_before,
                      "rss_peak_above_imports_mib": rss_peak - rss_before}))


SAMPLE_S = 0.001


def _own_mib() -> float:
    """The process's own memory: private anonymous pages and shared anonymous ones (an anonymous
    mmap can be either)."""
    return _status_mib("RssAnon") + _status_mib("RssShmem")


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise KeyError(field)


def largest(release: Path) -> tuple[float, float]:
    """(largest tensor shard, largest rank file) of a per-rank checkpoint, MiB."""
    import torch

    tensor = rank_file = 0
    for path in release.rglob("model_optim_rng.pt"):
        state = torch.load(path, weights_only=False, mmap=True)["model"]
        tensor = max(tensor, *(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t)))
        rank_file = max(rank_file, path.stat().st_size)
    return tensor / MIB, rank_file / MIB


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        measure(sys.argv[2], sys.argv[3])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run = write_checkpoint(root, args.hidden, args.layers, args.vocab)
        child = subprocess.run([sys.executable, __file__, "--child", str(run), str(root / "out")], check=True,
                               capture_output=True, text=True)
        peaks = json.loads(child.stdout.strip().splitlines()[-1])
        tensor, rank_file = largest(root / "out")
        input_tensor, _ = largest(run / "checkpoints")
        size = sum(p.stat().st_size for p in (run / "checkpoints").rglob("*") if p.is_file()) / MIB
    peak = peaks["own_peak_above_imports_mib"]
    print(f"reshard TP1 x PP2 -> TP2 x PP1 of a {size:.0f} MiB checkpoint (hidden {args.hidden}, {args.layers} layers, "
          f"vocabulary {args.vocab}): peak own memory above imports {peak:.1f} MiB (resident set, page cache of mapped "
          f"files included: {peaks['rss_peak_above_imports_mib']:.1f} MiB); largest tensor shard: output "
          f"{tensor:.1f} MiB, input {input_tensor:.1f} MiB; largest output rank file {rank_file:.1f} MiB")
    print(f"peak / largest output shard = {peak / tensor:.2f} (bound: one shard + about 5 MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
