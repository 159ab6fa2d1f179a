"""Prepared data (issue 39): each source tokenized once into memory-mapped arrays every rank maps.

In process, with the tiny digits tokenizer: the rows and batches from the cache are the in-memory
path's (data.prepared=false), packed and unpacked, SFT and DPO, mixtures included; a second start
opens the cache and still refuses what cannot train; a changed file is another cache; a damaged one
is said in one line and rebuilt; the process pool gives the one-process result; a full disk leaves
nothing. One launch of two processes shows two writers at once make one cache.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from toolkit.errors import ToolkitError
from toolkit.tinymodels import build_tokenizer
from toolkit.train import recipe_data
from toolkit.train.config import load_config
from toolkit.train.data import BatchSource, DataStats, ReadOptions
from toolkit.train.data_sources import DataError, Source, records
from toolkit.train.preference import PairSource
from toolkit.train.prepare_data import PREPARED
from toolkit.train.prepared_store import SampleStore
from toolkit.train.tokenize_pool import tokenize

REPO = Path(__file__).resolve().parents[1]


def _digits(rng, low, high):
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(low, high)))


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Prompt/response records of uneven lengths (some truncated at seq_len 16), a smaller second
    source for mixtures, and preference pairs."""
    root = tmp_path_factory.mktemp("prepared")
    rng = random.Random(0)
    qa = [{"prompt": _digits(rng, 1, 12) + "=", "response": _digits(rng, 1, 12)} for _ in range(40)]
    pairs = [{"prompt": r["prompt"], "chosen": r["response"], "rejected": r["response"][::-1] + "1"} for r in qa]
    return {"qa": _jsonl(root / "qa.jsonl", qa), "small": _jsonl(root / "small.jsonl", qa[:13]),
            "pairs": _jsonl(root / "pairs.jsonl", pairs)}


def _config(run_dir: Path, *overrides):
    return load_config(None, ["model.checkpoint=unused", f"run_dir={run_dir}", "global_batch=4", "micro_batch=1",
                              "data.seq_len=16", *overrides])


def _prepared_dirs(run_dir: Path) -> list[Path]:
    root = run_dir / "data_cache" / PREPARED
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.is_dir() else []


def _same_batches(a, b, global_batches: int) -> None:
    for _ in range(global_batches):
        x, y = a.next_global_batch(), b.next_global_batch()
        assert a.last_counts == b.last_counts
        for bx, by in zip(x, y, strict=True):
            assert bx.keys() == by.keys()
            for key in bx:
                assert bx[key].dtype == by[key].dtype and bx[key].equal(by[key]) if hasattr(bx[key], "dtype") \
                    else bx[key] == by[key], key


CASES = {"sft": ["data.train_file={qa}"], "sft-packed": ["data.train_file={qa}", "data.pack=true"],
         "mixture-packed": ["data.train_file={qa},{small}", "data.weights=1,3", "data.pack=true"],
         "dpo": ["data.train_file={pairs}", "method=dpo"]}


@pytest.mark.parametrize("case", CASES)
def test_rows_and_batches_from_the_cache_are_the_in_memory_ones(files, tmp_path, case):
    overrides = [o.format(**files) for o in CASES[case]]
    memory = recipe_data.read_data(_config(tmp_path / "mem", *overrides, "data.prepared=false"), build_tokenizer())
    cached = recipe_data.read_data(_config(tmp_path / "run", *overrides), build_tokenizer())
    assert _prepared_dirs(tmp_path / "run") and not _prepared_dirs(tmp_path / "mem")
    assert not isinstance(cached.train, list)  # rows made from the mapped arrays
    assert cached.stats.summary() == memory.stats.summary()
    assert list(cached.train) == memory.train
    dpo = case == "dpo"
    for rank in range(2):  # DP 2, shuffled, 25 global batches: past the first epoch
        if dpo:
            a, b = (PairSource(rows, 4, 1, 2, rank, 5, True) for rows in (memory.train, cached.train))
        else:
            a, b = (BatchSource(rows, 4, 1, 2, rank, 5, True, "data.pack=true" in overrides) for rows in
                    (memory.train, cached.train))
        _same_batches(a, b, 25)


def test_a_second_start_opens_the_cache_and_still_refuses_what_cannot_train(files, tmp_path, capfd):
    cfg = _config(tmp_path / "run", f"data.train_file={files['qa']}")
    first = recipe_data.read_data(cfg, build_tokenizer())
    assert "prepared " in capfd.readouterr().err
    (written,) = _prepared_dirs(tmp_path / "run")
    stamp = (written / "tokens.bin").stat().st_mtime_ns
    again = recipe_data.read_data(cfg, build_tokenizer())
    assert "prepared " not in capfd.readouterr().err and (written / "tokens.bin").stat().st_mtime_ns == stamp
    assert list(again.train) == list(first.train)
    for _ in range(2):  # the first start prepares, the second opens the cache: the same one line each time
        with pytest.raises(DataError, match="gives 40 samples, fewer than one global batch of 64") as refused:
            recipe_data.read_data(_config(tmp_path / "run", f"data.train_file={files['qa']}", "global_batch=64"),
                            build_tokenizer())
        assert "\n" not in str(refused.value)
    words = _jsonl(tmp_path / "words.jsonl", [{"text": "hello there"}] * 8)
    for _ in range(2):
        with pytest.raises(DataError, match=r"are the tokenizer's unknown token '<unk>'.*words.jsonl:1"):
            recipe_data.read_data(_config(tmp_path / "run", f"data.train_file={words}"), build_tokenizer())
    assert len(_prepared_dirs(tmp_path / "run")) == 2


def test_a_malformed_line_refuses_and_the_refusal_is_kept_for_the_same_inputs(tmp_path, capfd):
    data = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "1=", "response": "1"}] * 3)
    with open(data, "a") as f:
        f.write("{not json\n")
    cfg = _config(tmp_path / "run", f"data.train_file={data}")
    for _ in range(2):
        with pytest.raises(DataError, match=r"bad.jsonl:4: ") as refused:
            recipe_data.read_data(cfg, build_tokenizer())
        assert "\n" not in str(refused.value)
    assert not _prepared_dirs(tmp_path / "run")
    assert capfd.readouterr().err.count("prepared ") == 0  # neither start wrote a cache
    skipped = recipe_data.read_data(_config(tmp_path / "run", f"data.train_file={data}", "data.malformed=skip",
                                      "global_batch=2"), build_tokenizer())
    assert skipped.stats.skipped_malformed == 1 and len(skipped.train) == 3


def test_a_changed_data_file_is_prepared_again(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": f"{i}=", "response": f"{i}"} for i in range(6)])
    cfg = _config(tmp_path / "run", f"data.train_file={data}", "data.shuffle=false")
    before = recipe_data.read_data(cfg, build_tokenizer())
    _jsonl(data, [{"prompt": f"{i}=", "response": f"{i}{i}"} for i in range(6)])  # same name, new content
    after = recipe_data.read_data(cfg, build_tokenizer())
    assert len(_prepared_dirs(tmp_path / "run")) == 2
    assert [r.tokens for r in after.train] != [r.tokens for r in before.train]
    assert [r.tokens for r in after.train] == [r.tokens for r in
                                               recipe_data.read_data(_config(tmp_path / "mem", f"data.train_file={data}",
                                                                       "data.prepared=false"), build_tokenizer()).train]
    # a changed option (seq_len) is another cache too; pack and shuffle only arrange the same one
    recipe_data.read_data(_config(tmp_path / "run", f"data.train_file={data}", "data.pack=true", "global_batch=2"),
                    build_tokenizer())
    assert len(_prepared_dirs(tmp_path / "run")) == 2
    recipe_data.read_data(_config(tmp_path / "run", f"data.train_file={data}", "data.seq_len=8"), build_tokenizer())
    assert len(_prepared_dirs(tmp_path / "run")) == 3


@pytest.mark.parametrize("damage", ["tokens.bin", "offsets.bin", "meta.json"])
def test_a_damaged_cache_is_said_in_one_line_and_prepared_again(files, tmp_path, capfd, damage):
    cfg = _config(tmp_path / "run", f"data.train_file={files['qa']}")
    expected = list(recipe_data.read_data(cfg, build_tokenizer()).train)
    (written,) = _prepared_dirs(tmp_path / "run")
    path = written / damage
    if damage == "meta.json":
        path.write_text(path.read_text()[:50])  # half-written
    else:
        os.truncate(path, path.stat().st_size - 8)
    capfd.readouterr()
    again = recipe_data.read_data(cfg, build_tokenizer())
    lines = [line for line in capfd.readouterr().err.splitlines() if " is damaged: " in line]
    assert len(lines) == 1 and damage in lines[0] and lines[0].endswith("preparing it again"), lines
    assert list(again.train) == expected
    assert [p.name for p in _prepared_dirs(tmp_path / "run")] == [written.name]


def test_a_changed_byte_is_caught_by_the_full_check(files, tmp_path, capfd):
    cfg = _config(tmp_path / "run", f"data.train_file={files['qa']}")
    expected = list(recipe_data.read_data(cfg, build_tokenizer()).train)
    (written,) = _prepared_dirs(tmp_path / "run")
    tokens = np.memmap(written / "tokens.bin", dtype=np.uint32, mode="r+")
    tokens[3] += 1  # same size: only the BLAKE3 digest tells
    tokens.flush()
    del tokens
    assert list(recipe_data.read_data(cfg, build_tokenizer()).train) != expected  # sizes alone cannot see it
    capfd.readouterr()
    checked = recipe_data.read_data(_config(tmp_path / "run", f"data.train_file={files['qa']}", "data.verify_prepared=true"),
                              build_tokenizer())
    assert "tokens.bin does not have the BLAKE3 digest" in capfd.readouterr().err
    assert list(checked.train) == expected


CHATS = [{"messages": [{"role": "user", "content": f"what is {i} + {i}?"}, {"role": "assistant", "content": f"{2 * i}"},
                       {"role": "user", "content": "and twice that?"}, {"role": "assistant", "content": f"{4 * i}."}]}
         for i in range(11)]


@pytest.mark.parametrize("kind", ["sft", "dpo", "messages"])
def test_the_process_pool_gives_the_one_process_result(files, tmp_path, kind):
    """Chunks on two processes (conversations' turns rendered in one batched call per chunk) against
    the in-memory path's read_samples / read_pairs, one record at a time."""
    from toolkit.train.chat_templates import NAMED
    from toolkit.train.data import read_samples
    from toolkit.train.preference import read_pairs

    tok, opts = build_tokenizer(text=kind == "messages"), ReadOptions(17)
    if kind == "messages":
        tok.chat_template = NAMED["chatml"]
    path = {"sft": files["qa"], "dpo": files["pairs"], "messages": _jsonl(tmp_path / "chats.jsonl", CHATS)}[kind]
    method = "dpo" if kind == "dpo" else "sft"
    named = lambda: records(Source(str(path)), opts.columns, tmp_path)  # noqa: E731

    expected_stats = DataStats()
    if method == "dpo":
        samples = [s for pair in read_pairs(named(), tok, opts, expected_stats) for s in pair]
    else:
        samples = read_samples(named(), tok, opts, expected_stats)
    chunks = list(tokenize(named(), tok, opts, method, 2, 3))
    assert len(chunks) > 2  # the pool ran, on many chunks
    stats = DataStats()
    for c in chunks:
        stats.add(c.stats)
    assert stats.summary() == expected_stats.summary() and stats.unk_example == expected_stats.unk_example
    tokens, mask, lengths = (np.concatenate([getattr(c, name) for c in chunks]) for name in ("tokens", "loss_mask",
                                                                                           "lengths"))
    assert tokens.tolist() == [t for s in samples for t in s.tokens]
    assert mask.tolist() == [m for s in samples for m in s.loss_mask]
    assert lengths.tolist() == [len(s.tokens) for s in samples]
    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "1=", "response": "1"}] * 7 + [{"x": 1}] + [{"y": 1}] * 7)
    with pytest.raises(DataError, match=r"bad.jsonl:8: expected keys"):  # the first bad line, as one process says it
        list(tokenize(records(Source(str(bad)), opts.columns, tmp_path), tok, opts, "sft", 2, 2))


ABANDONING = """
import faulthandler, json, sys
from pathlib import Path
from toolkit.tinymodels import build_tokenizer
from toolkit.train.data import ReadOptions
from toolkit.train.data_sources import Source, records
from toolkit.train.tokenize_pool import tokenize

path, tok, opts = Path(sys.argv[1]), build_tokenizer(), ReadOptions(17)
path.write_text("".join(json.dumps({"text": "0123456789" * 3}) + "\\n" for _ in range(5000)))
for i in range(100):
    faulthandler.dump_traceback_later(30, exit=True)  # a close that hangs: the stacks, exit code 1
    chunks = tokenize(records(Source(str(path)), opts.columns, path.parent), tok, opts, "sft", 2, 64)
    for _ in range(1 + i % 5):
        next(chunks)
    chunks.close()
    faulthandler.cancel_dump_traceback_later()
"""


def test_a_pool_abandoned_mid_stream_shuts_down_every_time(tmp_path):
    """A full disk or a refusal stops the reader while chunks are in flight: the pool must shut down.
    multiprocessing.Pool.terminate() hung there within 24-27 abandoned pools (its task handler
    waiting for the task queue's lock; seen hanging the full-disk test below for 13 minutes)."""
    done = subprocess.run([sys.executable, "-c", ABANDONING, str(tmp_path / "d.jsonl")], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_full_disk_while_preparing_is_one_line_and_leaves_no_cache(tmp_path, small_fs):
    """Short rows first, so that the projection from the first chunk fits and the disk fills later."""
    fs = small_fs("256k")
    rows = [{"text": "1"}] * 600 + [{"text": "0123456789" * 3}] * 4000  # 17 tokens each: ~400 kB of arrays
    data = _jsonl(tmp_path / "big.jsonl", rows)
    cfg = _config(tmp_path / "run", f"data.train_file={data}", f"data.cache_dir={fs}")
    with pytest.raises(ToolkitError, match="no space left on the device while preparing") as refused:
        recipe_data.read_data(cfg, build_tokenizer())
    assert "\n" not in str(refused.value)
    prepared = fs / PREPARED
    assert not [p for p in prepared.iterdir() if p.is_dir() or "partial" in p.name]  # no cache, no partial
    assert not [p for p in prepared.iterdir() if p.name.endswith(".refused")]  # a full disk is not the data's verdict
    with pytest.raises(ToolkitError, match="no space left"):  # the next start tries again
        recipe_data.read_data(cfg, build_tokenizer())
    # long rows first: the first chunk's projection says it will not fit, before the disk is full
    _jsonl(data, rows[600:] + rows[:600])
    with pytest.raises(ToolkitError, match=r"big.jsonl will not fit: preparing its 4,600 rows needs about .* free "
                                           r"under .*: free space or set data.cache_dir"):
        recipe_data.read_data(cfg, build_tokenizer())
    assert not [p for p in prepared.iterdir() if p.is_dir()]


WRITER = """
import sys
from toolkit.tinymodels import build_tokenizer
from toolkit.train import recipe_data
from toolkit.train.config import load_config
cfg = load_config(None, ["model.checkpoint=unused", "run_dir=" + sys.argv[1], "global_batch=4", "micro_batch=1",
                         "data.seq_len=16", "data.train_file=" + sys.argv[2]])
rows = recipe_data.read_data(cfg, build_tokenizer()).train
print("rows", [r.tokens for r in rows])
"""


@pytest.mark.multiprocess
def test_two_processes_preparing_at_once_make_one_cache(files, tmp_path):
    """The first writer is held just before its rename (toolkit.atomic's fault point) while a second
    process starts: the second waits on the lock, then opens the first one's cache."""
    flag = tmp_path / "paused"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-c", WRITER, str(tmp_path / "run"), str(files["qa"])]
    first = subprocess.Popen(args, env={**env, "TOOLKIT_FAULT_PAUSE": f"before-rename:{flag}"}, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not flag.exists():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.05)
    second = subprocess.Popen(args, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    waiting = second.stdout.readline()  # its first line, once it has found the lock held
    assert f"waiting for process {first.pid} on " in waiting, waiting
    assert not _prepared_dirs(tmp_path / "run")  # nothing published yet
    flag.unlink()
    out1, err1 = first.communicate(timeout=120)
    out2, err2 = second.communicate(timeout=120)
    assert first.returncode == 0 and second.returncode == 0, err1 + err2
    assert "prepared " in err1 and "prepared " not in err2  # one tokenized and wrote; the other opened it
    assert out1.splitlines()[-1] == out2.splitlines()[-1]
    (cache,) = _prepared_dirs(tmp_path / "run")
    assert not [p for p in cache.parent.iterdir() if "partial" in p.name]
    SampleStore.open(cache, verify=True)


def _recipe_with_tokenizer(tmp_path: Path, data: Path, **data_keys) -> Path:
    """A recipe whose model.checkpoint holds only the tokenizer, which is all `toolkit data` reads."""
    import yaml

    from toolkit.convert.metadata import HF_DIR

    build_tokenizer().save_pretrained(tmp_path / "ckpt" / HF_DIR)
    recipe = {"model": {"checkpoint": str(tmp_path / "ckpt")}, "run_dir": str(tmp_path / "run"), "global_batch": 4,
              "micro_batch": 1, "data": {"train_file": str(data), "seq_len": 16, **data_keys}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_data_prepare_ahead_then_inspect_and_a_damaged_cache_refused_in_one_line(files, tmp_path, capfd):
    from toolkit.cli import main

    recipe = _recipe_with_tokenizer(tmp_path, files["qa"], pack=True)
    assert main(["data", "prepare", "--config", str(recipe), "micro_batch=2"]) == 0
    out = capfd.readouterr().out
    assert "data ready: 39 packed rows (633 tokens read)" in out and "every check passed" in out
    (cache,) = _prepared_dirs(tmp_path / "run")
    cfg = load_config(str(recipe), [])
    recipe_data.read_data(cfg, recipe_data.load_tokenizer(cfg))  # the run's start: opens what `data prepare` wrote
    assert "prepared " not in capfd.readouterr().err

    assert main(["data", "inspect", str(tmp_path / "run" / "data_cache"), "--verify"]) == 0
    shown = capfd.readouterr().out
    assert "sft: 40 samples, 587 tokens (264 trained)" in shown and "BLAKE3 of every array" in shown and "truncated 13" in shown
    assert main(["data", "inspect", str(cache), "--json"]) == 0
    (described,) = json.loads(capfd.readouterr().out)
    assert described["rows"] == 40 and described["key"]["options"]["max_tokens"] == 17

    os.truncate(cache / "targets.bin", 3)
    assert main(["data", "inspect", str(cache)]) == 2
    err = capfd.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "targets.bin is 3 bytes" in err, err
    assert main(["data", "prepare", "--config", str(recipe), "global_batch=64"]) == 2  # rebuilt, then refused
    err = capfd.readouterr().err
    assert "fewer than one global batch of 64" in err.splitlines()[-1]
    assert main(["data", "inspect", str(cache), "--verify"]) == 0  # the rebuilt cache is whole
