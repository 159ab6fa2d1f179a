"""Conversion benchmark: wall time relative to `cp -r` of the same bytes, and peak memory.

    python benchmarks/convert_bench.py [--sizes 1b,3b] [--workdir DIR] [--tp 2 --pp 2]

For each size, a synthetic Llama (random bf16 weights, written straight to sharded safetensors,
no model instantiated) is copied with `cp -r` (the baseline), then converted in a subprocess
while /proc is sampled for its peak anonymous and total RSS. Both clocks run until the data
is on disk (sync). Each is run --repeats times, alternating, and the medians compared. The
converter process's start-up (imports) is printed on its own, and one more conversion per
format, in-process, is split into phases (validation, records placed and hashed, the final
sync) next to what its parts cost alone (sha256 of the output on one thread, a kernel copy of
the source files), so the gap to cp can be apportioned. Goals, reported and not gated:
time <= 1.3 x cp, peak anonymous memory <= largest output file + 1 GiB and flat in model size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 1 << 30
SHARD_BYTES = 1 * GIB

# Llama-3.2-1B and -3B shapes (tied embeddings, GQA with 8 KV heads).
SIZES = {
    "100m": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, intermediate_size=4096),  # a quick check
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, intermediate_size=8192),
    "3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, intermediate_size=8192),
}
COMMON = dict(num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=8192,
              rms_norm_eps=1e-5, model_type="llama", architectures=["LlamaForCausalLM"], dtype="bfloat16",
              rope_parameters={"rope_type": "default", "rope_theta": 500000.0})


def hf_tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    from toolkit.convert.to_megatron import expected_hf_tensors
    from toolkit.families import spec_from_config

    family, spec = spec_from_config(cfg)
    return expected_hf_tensors(family, spec)


def write_synthetic_llama(directory: Path, size: str) -> int:
    """Random bf16 weights in ~1 GiB safetensors shards with an index; returns the parameter count."""
    import torch
    from safetensors.torch import save_file

    cfg = {**COMMON, **SIZES[size]}
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    shapes = hf_tensor_shapes(cfg)
    gen = torch.Generator().manual_seed(0)
    shards, current, current_bytes, params = [], {}, 0, 0
    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=torch.bfloat16)
        t.view(-1)[:] = torch.rand(min(t.numel(), 1 << 20), generator=gen).to(torch.bfloat16).repeat(-(-t.numel() // (1 << 20)))[: t.numel()]
        current[name] = t
        current_bytes += t.numel() * 2
        params += t.numel()
        if current_bytes >= SHARD_BYTES:
            shards.append(current)
            save_file(current, directory / f"part-{len(shards)}.safetensors", metadata={"format": "pt"})
            current, current_bytes = {}, 0
    if current:
        shards.append(current)
        save_file(current, directory / f"part-{len(shards)}.safetensors", metadata={"format": "pt"})
    weight_map = {n: f"part-{i}.safetensors" for i, s in enumerate(shards, 1) for n in s}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return params


def run_sampled(cmd: list[str]) -> tuple[float, int, int]:
    """Run `cmd`, sampling /proc every 20 ms: (wall seconds, peak RssAnon bytes, peak VmRSS bytes).

    The clock runs until the data is on disk (`sync` before and after): otherwise whichever
    command runs second pays for the first one's dirty-page write-back."""
    os.sync()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd)
    peak_anon = peak_total = 0
    while proc.poll() is None:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except FileNotFoundError:
            break
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        peak_anon = max(peak_anon, int(fields.get("RssAnon", "0 kB").split()[0]) * 1024)
        peak_total = max(peak_total, int(fields.get("VmRSS", "0 kB").split()[0]) * 1024)
        time.sleep(0.02)
    if proc.wait():
        raise SystemExit(f"{cmd} failed with exit code {proc.returncode}")
    os.sync()
    return time.perf_counter() - start, peak_anon, peak_total


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def largest_file(path: Path) -> int:
    return max(p.stat().st_size for p in path.rglob("*") if p.is_file())


def startup_seconds(fmt: str) -> float:
    """What the converter process spends on start-up: interpreter and imports (torch, transformers
    for the config check, torch.distributed.checkpoint for torch_dist only), median of 3."""
    code = "import transformers, toolkit.convert.to_megatron, toolkit.cli"
    code += ", toolkit.convert.dist_format" if fmt == "torch_dist" else ""
    return statistics.median(run_sampled([sys.executable, "-c", code])[0] for _ in range(3))


PHASES = """
import os, sys, time, hashlib
from pathlib import Path
from toolkit.convert import hf_to_megatron
from toolkit.convert.to_megatron import check_tensors
from toolkit.convert.hf_config import checked_spec
from toolkit.convert.hf_source import HFCheckpoint, check_weight_dtypes, config_dtype
from toolkit.convert.metadata import sha256
from toolkit.convert.range_copy import ByteRange, copy_ranges
src, out, fmt, tp, pp = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
import transformers.utils.type_validators  # imports are start-up, timed on their own
if fmt == "torch_dist":
    import toolkit.convert.dist_format
os.sync()
t = time.perf_counter()
hf = HFCheckpoint(src); family, spec = checked_spec(hf.config, hf.dir / "config.json", hf.tensors)
check_tensors(hf, family, spec); check_weight_dtypes(hf.tensors, config_dtype(hf.config))
validate = time.perf_counter() - t
t = time.perf_counter()
hf_to_megatron(src, out, tp=tp, pp=pp, fmt=fmt, progress=False)
convert = time.perf_counter() - t
t = time.perf_counter(); os.sync(); sync = time.perf_counter() - t
files = [p for p in (out / "release").rglob("*") if p.is_file()]
t = time.perf_counter(); [sha256(p) for p in files]; hashing = time.perf_counter() - t
scratch = out.parent / "phase-copy"
t = time.perf_counter()
for f in sorted(src.glob("*.safetensors")):
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    copy_ranges([ByteRange(f, 0, f.stat().st_size)], fd, 0); os.close(fd)
copying = time.perf_counter() - t
os.unlink(scratch); os.sync()
print(f"{validate:.2f} {convert:.2f} {sync:.2f} {hashing:.2f} {copying:.2f}")
"""


def phases(src: Path, workdir: Path, fmt: str, tp: int, pp: int) -> str:
    """One in-process conversion split into phases, and what its parts cost alone."""
    out = workdir / f"phases-{fmt}"
    result = subprocess.run([sys.executable, "-c", PHASES, str(src), str(out), fmt, str(tp), str(pp)],
                            check=True, capture_output=True, text=True)
    shutil.rmtree(out)
    validate, convert, sync, hashing, copying = map(float, result.stdout.split()[-5:])
    return (f"    phases ({fmt}): start-up {startup_seconds(fmt):.2f} s, validation {validate:.2f} s, "
            f"conversion {convert:.2f} s (validation again, records copied or written and hashed behind, "
            f"metadata), final sync {sync:.2f} s; alone: sha256 of the output on one thread {hashing:.2f} s, "
            f"copy_file_range of the source files {copying:.2f} s")


def bench(size: str, workdir: Path, tp: int, pp: int, repeats: int) -> list[str]:
    """cp -r and each format's conversion, alternated `repeats` times; medians."""
    src = workdir / f"llama-{size}"
    params = write_synthetic_llama(src, size)
    times: dict[str, list[float]] = {"cp": [], "torch": [], "torch_dist": []}
    anon: dict[str, int] = {}
    biggest: dict[str, int] = {}
    for _ in range(repeats):
        times["cp"].append(run_sampled(["cp", "-r", str(src), str(workdir / "cp-baseline")])[0])
        shutil.rmtree(workdir / "cp-baseline")
        for fmt in ("torch", "torch_dist"):
            out = workdir / f"out-{fmt}"
            cmd = [sys.executable, "-m", "toolkit", "convert", "hf-to-megatron", str(src), str(out),
                   "--tp", str(tp), "--pp", str(pp), "--format", fmt, "--no-progress"]
            wall, peak_anon, _ = run_sampled(cmd)
            times[fmt].append(wall)
            anon[fmt] = max(anon.get(fmt, 0), peak_anon)
            biggest[fmt] = largest_file(out / "release")
            shutil.rmtree(out)
    phase_rows = [phases(src, workdir, fmt, tp, pp) for fmt in ("torch", "torch_dist")]
    shutil.rmtree(src)
    cp = statistics.median(times["cp"])
    rows = []
    for fmt in ("torch", "torch_dist"):
        wall = statistics.median(times[fmt])
        rows.append(
            f"{size:>3} {params / 1e9:5.2f}B {fmt:<10} TP{tp}xPP{pp}  {wall:7.1f} s  cp {cp:6.1f} s  "
            f"ratio {wall / cp:4.2f}x  (runs {[round(t, 1) for t in times[fmt]]}, cp {[round(t, 1) for t in times['cp']]})  "
            f"peak anon {anon[fmt] / GIB:5.2f} GiB  largest file {biggest[fmt] / GIB:5.2f} GiB"
        )
        print(rows[-1], flush=True)
    print("\n".join(phase_rows), flush=True)
    return rows + phase_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1b,3b")
    parser.add_argument("--workdir", default=None, help="scratch directory (needs ~3x the largest model on disk)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}", flush=True)
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="convert-bench-") as tmp:
        rows = [r for size in args.sizes.split(",") for r in bench(size, Path(tmp), args.tp, args.pp, args.repeats)]
    print(f"\nsummary (median of {args.repeats}; wall time vs cp -r of the same bytes, sync included on both sides; "
          "peak anonymous memory of the converter process)")
    print("\n".join(rows))
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
