"""Conversion benchmark: wall time relative to `cp -r` of the same bytes, and peak memory.

    python benchmarks/convert_bench.py [--sizes 1b,3b,8b] [--workdir DIR] [--tp 2 --pp 2]

For each size, a synthetic Llama (random bf16 weights, written straight to sharded safetensors,
no model instantiated) is copied with `cp -r` (the baseline), then converted by the CLI in a
subprocess while /proc is sampled for its peak anonymous and total RSS. Both clocks run until
the data is on disk (sync). Each is run --repeats times, alternating, after one untimed round (--no-warmup: none), and the
medians compared.

Each conversion's wall time is split into phases that add up to it, from marks the converter
process takes (time.monotonic, one clock for both processes) around the CLI's own run: the
interpreter's start, the imports (torch and the toolkit; DCP for torch_dist; transformers' config
class reads config.json in a forked child meanwhile), validation (up to the output's .partial directory), the records
placed and hashed (up to the metadata file), metadata and rename, the interpreter's exit, and the
final sync. cp's wall is split into its copy and its sync. What the main phase's parts cost
alone is printed next to it (the source bytes copied by the converter's copy path into fresh
files, and the output's checksum (BLAKE3, toolkit.checksum) alone), so the gap to cp is apportioned
by the printout. With several sizes, the per-byte ratio (t_big - t_small) / (cp_big - cp_small) is
printed for each larger size: the cost of each further byte against cp's, which fixed start-up
cannot hide. At 8B (16 GB in bf16) the page cache cannot hold the source and the output together
on a 24 GiB machine, so both sides meet the disk: the conversion users run.
Goals, reported and not gated: time <= 1.3 x cp, peak anonymous memory <= largest output file +
1 GiB and flat in model size.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

GIB = 1 << 30
SHARD_BYTES = 1 * GIB

# Each size's config.json is the published one of its model, kept shrunk in tests/data/published_configs
# with its published sizes in index.json, which are put back: the converter reads what users' files hold
# (an old-style rope_scaling, torch_dtype). "100m" is a quick check, on 1B's file with smaller sizes.
PUBLISHED = Path(__file__).resolve().parents[1] / "tests" / "data" / "published_configs"
SIZES = {
    "100m": ("llama-3.2-1b-instruct",
             dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, head_dim=64, intermediate_size=4096)),
    "1b": ("llama-3.2-1b-instruct", {}),
    "3b": ("llama-3.2-3b", {}),
    "8b": ("llama-3.1-8b", {}),
}


def published_config(size: str) -> dict:
    name, changes = SIZES[size]
    published_sizes = json.loads((PUBLISHED / "index.json").read_text())[name]["original_sizes"]
    return {**json.loads((PUBLISHED / f"{name}.json").read_text()), **published_sizes, **changes}


def hf_tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    from toolkit.convert.to_megatron import expected_hf_tensors
    from toolkit.families import spec_from_config

    family, spec = spec_from_config(cfg)
    return expected_hf_tensors(family, spec)


def write_synthetic_llama(directory: Path, size: str) -> int:
    """Random bf16 weights in ~1 GiB safetensors shards with an index; returns the parameter count."""
    import torch
    from safetensors.torch import save_file

    cfg = published_config(size)
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


class Run(NamedTuple):
    spawned: float  # time.monotonic() of each moment
    exited: float
    synced: float
    peak_anon: int
    peak_total: int
    cpu: float  # the process's user + system seconds (the kernel's write-back threads not included)

    @property
    def wall(self) -> float:
        return self.synced - self.spawned


def _rss_of_tree(pid: int) -> tuple[int, int]:
    """RssAnon and VmRSS of a process and its children (the converter's forked config reader: pages
    they share copy-on-write count in each, so this overstates)."""
    anon = total = 0
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        for p in [pid, *map(int, children)]:
            status = Path(f"/proc/{p}/status").read_text()
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            anon += int(fields.get("RssAnon", "0 kB").split()[0]) * 1024
            total += int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass  # gone meanwhile
    return anon, total


def run_sampled(cmd: list[str]) -> Run:
    """Run `cmd`, sampling /proc every 20 ms for its (and its children's) peak RssAnon and VmRSS.

    The clock runs until the data is on disk (`sync` before and after): otherwise whichever
    command runs second pays for the first one's dirty-page write-back."""
    os.sync()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    spawned = time.monotonic()
    proc = subprocess.Popen(cmd)
    peak_anon = peak_total = 0
    while proc.poll() is None:
        anon, total = _rss_of_tree(proc.pid)
        peak_anon, peak_total = max(peak_anon, anon), max(peak_total, total)
        time.sleep(0.02)
    if proc.wait():
        raise SystemExit(f"{cmd} failed with exit code {proc.returncode}")
    exited = time.monotonic()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    os.sync()
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return Run(spawned, exited, time.monotonic(), peak_anon, peak_total, cpu)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def largest_file(path: Path) -> int:
    return max(p.stat().st_size for p in path.rglob("*") if p.is_file())


# The CLI's run with marks taken in its process (argv: marks file, then the CLI's arguments). The
# imports the CLI makes first come first, so they are timed on their own (DCP's, for torch_dist, is
# made after the fork below, as the CLI makes it); transformers' config class is not imported here: the converter has it read config.json in a forked child while it writes
# (toolkit/convert/spec_guess.py), and the last mark says whether this process imported it after
# all (a guess the class contradicted). An audit hook (sys.addaudithook: Python's documented
# events, nothing of the converter patched) marks the creation of the .partial output directory
# (everything validated) and the opening of the metadata file (every record placed and hashed).
TIMED_CLI = """
import gc, json, sys, time
marks = [("started", time.monotonic())]
gc.disable()  # as the CLI's convert command imports them
import torch, toolkit.cli, toolkit.convert.to_megatron
gc.enable()
marks.append(("torch and toolkit imported", time.monotonic()))
def note(event, args):
    if event == "os.mkdir" and ".partial-" in str(args[0]) and len(marks) == 2:
        marks.append(("validated", time.monotonic()))
    elif event == "open" and str(args[0]).endswith("toolkit_checkpoint.json") and len(marks) == 3:
        marks.append(("records placed and hashed", time.monotonic()))
sys.addaudithook(note)
marks_file, sys.argv = sys.argv[1], ["toolkit", *sys.argv[2:]]
code = toolkit.cli.main()
marks.append(("published", time.monotonic()))
marks.append(("transformers imported here", "transformers" in sys.modules))
with open(marks_file, "w") as f:
    json.dump(marks, f)
sys.exit(code)
"""
PHASE_NAMES = ("interpreter start", "torch + toolkit imports", "validation",
               "records placed and hashed (and DCP's import, for torch_dist)", "metadata + rename", "interpreter exit", "final sync")


def convert_timed(src: Path, out: Path, fmt: str, tp: int, pp: int) -> tuple[Run, list[float]]:
    """One conversion by the CLI; its run and the phases of its wall time (PHASE_NAMES, adding up to it)."""
    marks_file = out.parent / f".marks-{fmt}.json"
    cmd = [sys.executable, "-c", TIMED_CLI, str(marks_file), "convert", "hf-to-megatron", str(src), str(out),
           "--tp", str(tp), "--pp", str(pp), "--format", fmt, "--no-progress"]
    run = run_sampled(cmd)
    *timed, (_, imported_transformers) = json.loads(marks_file.read_text())
    marks_file.unlink()
    if len(timed) != 5:
        raise SystemExit(f"expected 5 marks from the converter, got {len(timed)}: did the CLI change?")
    if imported_transformers:
        print(f"note: this {fmt} conversion imported transformers itself (the class contradicted the guess)", flush=True)
    points = [run.spawned, *(t for _, t in timed), run.exited, run.synced]
    return run, [b - a for a, b in zip(points, points[1:])]


ALONE = """
import os, shutil, sys, time
from pathlib import Path
from toolkit.checksum import file_digest
from toolkit.convert.range_copy import ByteRange, copy_ranges
src, out, scratch = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
files = [p for p in (out / "release").rglob("*") if p.is_file()]
os.sync(); t = time.monotonic(); [file_digest(p) for p in files]; hashing = time.monotonic() - t
shutil.rmtree(out); os.sync()  # the copy below then has the page cache the converter had
scratch.mkdir()
t = time.monotonic()
for f in sorted(src.glob("*.safetensors")):  # fresh files, as cp and the converter write
    fd = os.open(scratch / f.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    copy_ranges([ByteRange(f, 0, f.stat().st_size)], fd, 0); os.close(fd)
copying = time.monotonic() - t
os.sync(); syncing = time.monotonic() - t - copying
print(hashing, copying, syncing)
"""


def alone(src: Path, out: Path, workdir: Path) -> tuple[float, float, float]:
    """The converted output's checksum alone (BLAKE3 on its own threads; the output is then removed); the source files
    copied by the converter's copy path (toolkit.convert.range_copy) into fresh files, and that
    copy's sync."""
    scratch = workdir / "alone-copy"
    result = subprocess.run([sys.executable, "-c", ALONE, str(src), str(out), str(scratch)],
                            check=True, capture_output=True, text=True)
    shutil.rmtree(scratch)
    hashing, copying, syncing = map(float, result.stdout.split()[-3:])
    return hashing, copying, syncing


def phase_row(fmt: str, runs: list[Run], phases: list[list[float]], cp: list[Run]) -> str:
    """The median run's phases, beside the median cp run's copy and sync."""
    i = sorted(range(len(runs)), key=lambda k: runs[k].wall)[len(runs) // 2]
    j = sorted(range(len(cp)), key=lambda k: cp[k].wall)[len(cp) // 2]
    parts = ", ".join(f"{name} {t:.2f}" for name, t in zip(PHASE_NAMES, phases[i]))
    return (f"    {fmt} median run {runs[i].wall:.2f} s = {parts} s (CPU {runs[i].cpu:.1f} s) | cp -r median run "
            f"{cp[j].wall:.2f} s = copy {cp[j].exited - cp[j].spawned:.2f}, final sync {cp[j].synced - cp[j].exited:.2f} s "
            f"(CPU {cp[j].cpu:.1f} s)")


class SizeResult(NamedTuple):
    rows: list[str]
    walls: dict[str, float]  # median conversion wall time by format
    cp_wall: float


def bench(size: str, workdir: Path, tp: int, pp: int, repeats: int, warmup: bool) -> SizeResult:
    """cp -r and each format's conversion, alternated `repeats` times; medians. With `warmup`, one
    untimed round of each first: the first cp -r after the source is written runs at 8B about twice
    as long as the later ones (the page cache still holds the source's freshly written pages)."""
    src = workdir / f"llama-{size}"
    params = write_synthetic_llama(src, size)
    if warmup:
        run_sampled(["cp", "-r", str(src), str(workdir / "cp-baseline")])
        shutil.rmtree(workdir / "cp-baseline")
        for fmt in ("torch", "torch_dist"):
            convert_timed(src, workdir / f"out-{fmt}", fmt, tp, pp)
            shutil.rmtree(workdir / f"out-{fmt}")
    cp: list[Run] = []
    runs: dict[str, list[Run]] = {"torch": [], "torch_dist": []}
    phases: dict[str, list[list[float]]] = {"torch": [], "torch_dist": []}
    biggest: dict[str, int] = {}
    for repeat in range(repeats):
        cp.append(run_sampled(["cp", "-r", str(src), str(workdir / "cp-baseline")]))
        shutil.rmtree(workdir / "cp-baseline")
        for fmt in ("torch", "torch_dist"):
            out = workdir / f"out-{fmt}"
            run, split = convert_timed(src, out, fmt, tp, pp)
            runs[fmt].append(run)
            phases[fmt].append(split)
            biggest[fmt] = largest_file(out / "release")
            if fmt == "torch" and repeat == repeats - 1:
                hashing, copying, syncing = alone(src, out, workdir)
            else:
                shutil.rmtree(out)
    shutil.rmtree(src)
    cp_wall = statistics.median(r.wall for r in cp)
    rows, walls = [], {}
    for fmt in ("torch", "torch_dist"):
        wall = walls[fmt] = statistics.median(r.wall for r in runs[fmt])
        anon = max(r.peak_anon for r in runs[fmt])
        rows.append(
            f"{size:>3} {params / 1e9:5.2f}B {fmt:<10} TP{tp}xPP{pp}  {wall:7.1f} s  cp {cp_wall:6.1f} s  "
            f"ratio {wall / cp_wall:4.2f}x  (runs {[round(r.wall, 1) for r in runs[fmt]]}, cp {[round(r.wall, 1) for r in cp]})  "
            f"peak anon {anon / GIB:5.2f} GiB  largest file {biggest[fmt] / GIB:5.2f} GiB"
        )
        print(rows[-1], flush=True)
    phase_rows = [phase_row(fmt, runs[fmt], phases[fmt], cp) for fmt in ("torch", "torch_dist")]
    phase_rows.append(f"    alone: the source files copied by range_copy into fresh files {copying:.2f} s + sync {syncing:.2f} s; "
                      f"checksums of the torch output {hashing:.2f} s")
    print("\n".join(phase_rows), flush=True)
    return SizeResult(rows + phase_rows, walls, cp_wall)


def per_byte_rows(results: dict[str, SizeResult]) -> list[str]:
    """(t_size - t_smallest) / (cp_size - cp_smallest) for each larger size and format."""
    sizes = list(results)
    small = results[sizes[0]]
    rows = []
    for size in sizes[1:]:
        big = results[size]
        extra_cp = big.cp_wall - small.cp_wall
        for fmt, wall in big.walls.items():
            ratio = (wall - small.walls[fmt]) / extra_cp if extra_cp > 0 else float("nan")
            rows.append(f"per byte {sizes[0]}->{size} {fmt:<10} ({wall:.1f} - {small.walls[fmt]:.1f}) / "
                        f"({big.cp_wall:.1f} - {small.cp_wall:.1f}) = {ratio:4.2f}x")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1b,3b,8b", help=f"comma-separated, smallest first: {', '.join(SIZES)}")
    parser.add_argument("--workdir", default=None, help="scratch directory (needs ~3x the largest model on disk)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-warmup", action="store_true", help="time from the first run (no untimed round first)")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}", flush=True)
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="convert-bench-") as tmp:
        results = {size: bench(size, Path(tmp), args.tp, args.pp, args.repeats, not args.no_warmup) for size in args.sizes.split(",")}
    rows = [r for result in results.values() for r in result.rows] + per_byte_rows(results)
    print(f"\nsummary (median of {args.repeats}; wall time vs cp -r of the same bytes, sync included on both sides; "
          "peak anonymous memory of the converter's processes)")
    print("\n".join(rows))
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
