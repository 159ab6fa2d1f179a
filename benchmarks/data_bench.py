"""Prepared data (issue 39), on CPU, all ratios from the same run:

1. Preparation throughput: ours (`toolkit data prepare`'s path: key, tokenize on --num-proc
   processes, write, hash) against `datasets.load_dataset("json").map(tokenize, batched=True,
   num_proc=N)` with the same tokenizer and chat template, its tokenize function making the same
   tokens and loss masks the way LLaMA-Factory does (every prefix of a conversation rendered with
   the template, the rendered texts encoded in one batched call of the fast tokenizer, each turn's
   tokens the difference of two prefixes); its output is checked equal to ours. Goal: ours >= 1x.
2. Per-rank peak RSS (a fresh process that opens the data as a rank does and takes a few global
   batches) at two data sizes 10x apart, prepared and in memory (data.prepared=false, today's
   path): the growth per token. Goal: <= 4 bytes a token prepared.
3. A second start of the larger size: the rank's time from its data read to its first batch,
   against the same with a tiny data set. Goal: within a few seconds. (The model's build is the
   same whatever the data, so the difference is the data's.)

The tokenizer is a byte-level BPE of --vocab tokens trained with `tokenizers` on the synthetic
text; conversations are 1-3 exchanges of Zipf-distributed pseudo-words (about 800 tokens each, as the issue
sizes them).

    python benchmarks/data_bench.py [--small 2000] [--num-proc 2] [--json OUT]
    python benchmarks/data_bench.py --small 100000 --only-prepare    # 1M conversations: prepare only
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 2048
GLOBAL_BATCH, MICRO = 32, 4
BATCHES_READ = 8  # global batches a rank takes after opening the data
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_CONVERSATIONS = 10_000  # the BPE's training text: enough for its 32k merges, minutes less at 1M


def synthetic_conversations(n: int, seed: int):
    """`n` conversations of 1-3 user/assistant exchanges, words drawn from a Zipf law over 30k pseudo-words."""
    import numpy as np

    rng = np.random.default_rng(0)  # the same words at every size (the tokenizer is trained on one)
    syllables = [c + v for c, v in zip(rng.choice(list("bcdfghklmnprstvz"), 600),
                                       rng.choice(["a", "e", "i", "o", "u", "ai", "ou", "ea"], 600))]
    parts = rng.integers(0, len(syllables), (60000, 3))
    counts = rng.integers(1, 4, 60000)
    words = list(dict.fromkeys("".join(syllables[k] for k in row[:c]) for row, c in zip(parts, counts)))[:30000]
    rng.shuffle(words)  # frequency unrelated to spelling
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(1.0 / np.arange(1, len(words) + 1) ** 1.1)
    cdf /= cdf[-1]
    words = np.array(words, dtype=object)

    def text(lo: int, hi: int) -> str:
        drawn = words[np.searchsorted(cdf, rng.random(int(rng.integers(lo, hi))))]
        ends = np.flatnonzero(rng.random(len(drawn)) < 0.1)  # about ten words a sentence
        for start in np.concatenate([[0], ends + 1])[:-1] if len(ends) else [0]:
            drawn[start] = drawn[start].capitalize()
        for end in ends:
            drawn[end] = drawn[end] + ("." if end % 5 else "?")
        return " ".join(drawn) + "."

    for _ in range(n):
        messages = []
        for _ in range(int(rng.integers(1, 4))):
            messages += [{"role": "user", "content": text(10, 80)}, {"role": "assistant", "content": text(60, 450)}]
        yield {"messages": messages}


def write_jsonl(path: Path, n: int, seed: int) -> Path:
    with open(path, "w") as f:
        for record in synthetic_conversations(n, seed):
            f.write(json.dumps(record) + "\n")
    return path


def train_tokenizer(directory: Path, corpus: Path, vocab: int) -> Path:
    """A byte-level BPE (Qwen's or Llama 3's kind) trained on the synthetic text (its first
    TOKENIZER_CONVERSATIONS conversations), saved with ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from toolkit.train.chat_templates import NAMED

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def texts():
        with open(corpus) as f:
            for line in itertools.islice(f, TOKENIZER_CONVERSATIONS):
                for m in json.loads(line)["messages"]:
                    yield m["content"]

    core.train_from_iterator(texts(), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = NAMED["chatml"]
    tok.save_pretrained(directory)
    return directory


def recipe_overrides(work: Path, data: Path, cache: Path, num_proc: int, prepared: bool = True) -> list[str]:
    return [f"model.checkpoint={work / 'ckpt'}", f"run_dir={work / 'run'}", f"data.train_file={data}",
            "data.chat_template=chatml", f"data.seq_len={SEQ_LEN}", f"global_batch={GLOBAL_BATCH}",
            f"micro_batch={MICRO}", f"data.num_proc={num_proc}", f"data.cache_dir={cache}",
            f"data.prepared={str(prepared).lower()}", "data.pack=true"]


def ours(work: Path, data: Path, cache: Path, num_proc: int) -> tuple[float, int]:
    """Seconds to prepare `data` (nothing cached) and the tokens read."""
    from toolkit.train import recipe_data
    from toolkit.train.config import load_config

    shutil.rmtree(cache, ignore_errors=True)
    cfg = load_config(None, recipe_overrides(work, data, cache, num_proc))
    began = time.perf_counter()
    rows = recipe_data.read_data(cfg, recipe_data.load_tokenizer(cfg))
    return time.perf_counter() - began, rows.stats.tokens


def _baseline_map(tokenizer):
    def tokenize(batch):
        texts, spans = [], []
        for messages in batch["messages"]:
            spans.append((len(texts), len(messages)))
            texts += [tokenizer.apply_chat_template(messages[: i + 1], tokenize=False) for i in range(len(messages))]
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
        ids, masks = [], []
        for (start, count), messages in zip(spans, batch["messages"]):
            tokens, mask = [], []
            for i in range(count):
                prefix = encoded[start + i]
                added = prefix[len(tokens):]
                tokens += added
                mask += [int(messages[i]["role"] == "assistant")] * len(added)
            ids.append(tokens[: SEQ_LEN + 1])
            masks.append(mask[: SEQ_LEN + 1])
        return {"input_ids": ids, "loss_mask": masks}

    return tokenize


def baseline(work: Path, data: Path, num_proc: int):
    """Seconds for load_dataset("json") + map(batched=True, num_proc) into a fresh `datasets` cache."""
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(work / "ckpt" / "hf")
    cache = work / "hf_datasets_cache"
    shutil.rmtree(cache, ignore_errors=True)
    began = time.perf_counter()
    table = datasets.load_dataset("json", data_files=str(data), split="train", cache_dir=str(cache))
    mapped = table.map(_baseline_map(tokenizer), batched=True, num_proc=num_proc, remove_columns=table.column_names)
    seconds = time.perf_counter() - began
    return seconds, mapped


def rank_worker(args) -> None:
    """One rank's start: read the data as the recipe does, deal out BATCHES_READ global batches."""
    began = time.perf_counter()
    from toolkit.runtime.distributed import ParallelInfo  # noqa: F401  (the recipe's imports, before the baseline)
    from toolkit.train import recipe_data
    from toolkit.train.config import load_config
    from toolkit.train.data import BatchSource

    imported = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cfg = load_config(None, json.loads(args.rank_worker))
    start = time.perf_counter()
    rows = recipe_data.read_data(cfg, recipe_data.load_tokenizer(cfg))
    source = BatchSource(rows.train, GLOBAL_BATCH, MICRO, 8, 3, cfg.seed, True, True)
    source.next_global_batch()
    first = time.perf_counter() - start
    for _ in range(BATCHES_READ - 1):
        source.next_global_batch()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    now, anon, file = (int(status[key].split()[0]) * 1024 for key in ("VmRSS", "RssAnon", "RssFile"))
    print(json.dumps({"peak_rss": peak, "rss_end": now, "rss_anon_end": anon, "rss_file_end": file,
                      "after_imports_rss": imported, "first_batch_s": first, "tokens": rows.stats.tokens,
                      "rows": len(rows.train), "process_s": time.perf_counter() - began}))


def run_rank(overrides: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RANK": "3", "LOCAL_RANK": "3"}
    out = subprocess.run([sys.executable, __file__, "--rank-worker", json.dumps(overrides)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_same_output(work: Path, data: Path, cache: Path, mapped, num_proc: int) -> None:
    """The baseline tokenizes as we do: the same tokens and masks, sample for sample (on the first 200)."""
    from toolkit.train import recipe_data
    from toolkit.train.config import load_config

    cfg = load_config(None, recipe_overrides(work, data, cache, num_proc) + ["data.pack=false"])
    rows = recipe_data.read_data(cfg, recipe_data.load_tokenizer(cfg)).train
    store = rows.items
    for i in range(min(200, len(store))):
        sample = store[i]
        assert sample.tokens == mapped[i]["input_ids"] and sample.loss_mask == mapped[i]["loss_mask"], i


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", type=int, default=2000, help="conversations of the smaller size (the larger: 10x)")
    parser.add_argument("--tiny", type=int, default=200, help="conversations of the tiny set (time to first batch)")
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--only-prepare", action="store_true", help="the larger size's preparation and one rank's "
                        "memory and second start (against the tiny set's), nothing else (for the 1M-conversation figures)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--rank-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_worker:
        rank_worker(args)
        return 0
    sys.path.insert(0, str(REPO))
    work = Path(tempfile.mkdtemp(prefix="data-bench-"))
    try:
        return _bench(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _bench(args, work: Path) -> int:
    import transformers  # noqa: F401  (imported before any timing, as a job has it)

    figures = {"num_proc": args.num_proc, "vocab": args.vocab, "cores": os.cpu_count()}
    began = time.perf_counter()
    sizes = {"tiny": args.tiny, "small": args.small, "large": 10 * args.small}
    data = {name: write_jsonl(work / f"{name}.jsonl", n, seed=i) for i, (name, n) in enumerate(sizes.items())
            if not (args.only_prepare and name == "small")}
    print(f"wrote {', '.join(f'{n:,} ({name})' for name, n in sizes.items())} conversations in "
          f"{time.perf_counter() - began:.0f} s", flush=True)
    began = time.perf_counter()
    train_tokenizer(work / "ckpt" / "hf", data["small" if "small" in data else "large"], args.vocab)
    from transformers import AutoTokenizer

    figures["vocab"] = len(AutoTokenizer.from_pretrained(work / "ckpt" / "hf"))
    print(f"trained a byte-level BPE of {figures['vocab']:,} tokens in {time.perf_counter() - began:.0f} s", flush=True)

    # Throughput at the larger size, where neither side's fixed costs (process pools, a tokenizer's load) count
    seconds, tokens = ours(work, data["large"], work / "cache-large", args.num_proc)
    figures["ours"] = {"conversations": sizes["large"], "seconds": seconds, "tokens": tokens,
                       "conversations_per_s": sizes["large"] / seconds, "tokens_per_s": tokens / seconds}
    print(f"ours: {sizes['large']:,} conversations, {tokens:,} tokens in {seconds:.1f} s "
          f"({tokens / seconds:,.0f} tokens/s, {sizes['large'] / seconds:,.0f} conversations/s)", flush=True)
    if not args.only_prepare:
        seconds_b, mapped = baseline(work, data["large"], args.num_proc)
        check_same_output(work, data["large"], work / "cache-large", mapped, args.num_proc)
        figures["datasets_map"] = {"seconds": seconds_b, "tokens_per_s": tokens / seconds_b}
        figures["prepare_speedup"] = seconds_b / seconds
        print(f"datasets.load_dataset('json').map(batched=True, num_proc={args.num_proc}): {seconds_b:.1f} s; "
              f"ours {seconds_b / seconds:.2f}x as fast (same tokens and masks)", flush=True)
        for name in ("tiny", "small"):  # prepared, for the ranks' second start
            ours(work, data[name], work / f"cache-{name}", args.num_proc)

    if args.only_prepare:  # the tiny set too, for the second start's baseline
        ours(work, data["tiny"], work / "cache-tiny", args.num_proc)
    ranks = {}
    for name in (["tiny", "large"] if args.only_prepare else ["tiny", "small", "large"]):
        ranks[name] = run_rank(recipe_overrides(work, data[name], work / f"cache-{name}", args.num_proc))
        print(f"rank, prepared, {name}: peak RSS {ranks[name]['peak_rss'] / 2**20:,.0f} MiB (at the end "
              f"{ranks[name]['rss_end'] / 2**20:,.0f} MiB: "
              f"{ranks[name]['rss_anon_end'] / 2**20:,.0f} MiB anonymous, {ranks[name]['rss_file_end'] / 2**20:,.0f} MiB "
              f"file-backed), {ranks[name]['tokens']:,} tokens, first batch after {ranks[name]['first_batch_s']:.2f} s",
              flush=True)
    figures["ranks_prepared"] = ranks
    figures["second_start_extra_s"] = ranks["large"]["first_batch_s"] - ranks["tiny"]["first_batch_s"]
    if args.only_prepare:
        print(f"second start of {sizes['large']:,} conversations: first batch "
              f"{figures['second_start_extra_s']:+.2f} s against {sizes['tiny']:,}", flush=True)
    else:
        growth = (ranks["large"]["peak_rss"] - ranks["small"]["peak_rss"]) / (ranks["large"]["tokens"] -
                                                                              ranks["small"]["tokens"])
        figures["rss_growth_bytes_per_token"] = growth
        figures["rss_end_growth_bytes_per_token"] = (ranks["large"]["rss_end"] - ranks["small"]["rss_end"]) / (
            ranks["large"]["tokens"] - ranks["small"]["tokens"])
        memory = {name: run_rank(recipe_overrides(work, data[name], work / "cache-memory", args.num_proc, prepared=False))
                  for name in ("small", "large")}
        figures["ranks_in_memory"] = memory
        growth_memory = (memory["large"]["peak_rss"] - memory["small"]["peak_rss"]) / (memory["large"]["tokens"] -
                                                                                        memory["small"]["tokens"])
        figures["rss_growth_bytes_per_token_in_memory"] = growth_memory
        extra = figures["second_start_extra_s"]
        print(f"per-rank RSS growth: prepared {growth:.2f} bytes/token (at the end "
              f"{figures['rss_end_growth_bytes_per_token']:.2f}), in memory {growth_memory:.1f} bytes/token "
              f"; second start of {sizes['large']:,} conversations: first "
              f"batch {extra:+.2f} s against {sizes['tiny']:,} (in memory: "
              f"{memory['large']['first_batch_s']:.1f} s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
