"""Data the way users bring it (issue 25, section 3), and data that cannot train refused in one line
before the model is built: formats through `datasets`, splits, column mapping, mixtures, chat
templates, unreadable data, truncation and what it drops. In process: the recipe's own `prepare`
and the loader it calls."""

from __future__ import annotations

import json

import pytest

from tests.finetune_harness import recipe, recipe_prepare
from toolkit.errors import ToolkitError
from toolkit.tinymodels import build_tokenizer
from toolkit.train import recipe_data
from toolkit.train.config import load_config
from toolkit.train.data import DataStats, read_jsonl

PAIRS = [{"prompt": f"{i}{i + 1}=", "response": f"{i + 1}{i}"} for i in range(10)]
CHATS = [{"messages": [{"role": "user", "content": f"{i}{i}"}, {"role": "assistant", "content": f"{i}"}]} for i in range(10)]
# For the digits-only tokenizer every letter is <unk>.
WORDS = [{"messages": [{"role": "user", "content": "what is two plus two"}, {"role": "assistant", "content": "four"}]}]


def _tokenizer(text: bool = False):
    """Digits and a few specials (other characters are <unk>), or with `text` printable ASCII and ChatML."""
    tok = build_tokenizer(text=True) if text else build_tokenizer()
    tok.chat_template = None
    return tok


def _config(tmp_path, *overrides):
    return load_config(None, ["model.checkpoint=unused", f"run_dir={tmp_path / 'run'}", "global_batch=2", "micro_batch=1",
                              "data.seq_len=16", "data.shuffle=false", *overrides])


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _tokens(rows):
    return [r.tokens for r in rows]


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    """The same records as JSONL, JSON, Parquet, CSV, a single Arrow file and a saved DatasetDict."""
    import datasets

    root = tmp_path_factory.mktemp("formats")
    table = datasets.Dataset.from_list(PAIRS)
    files = {"jsonl": _jsonl(root / "d.jsonl", PAIRS)}
    table.to_json(root / "d.json", lines=False)
    files["json"] = root / "d.json"
    table.to_parquet(root / "d.parquet")
    files["parquet"] = root / "d.parquet"
    table.to_csv(root / "d.csv", index=False)
    files["csv"] = root / "d.csv"
    datasets.DatasetDict({"train": table, "test": table.select(range(3))}).save_to_disk(root / "saved")
    files["saved"] = root / "saved"
    table.save_to_disk(root / "single")
    files["arrow"] = next((root / "single").glob("*.arrow"))
    return files


def test_every_format_gives_the_jsonl_rows_and_caches_under_the_run_dir(formats, tmp_path):
    tok = _tokenizer()
    expected = _tokens(recipe_data.read_data(_config(tmp_path, f"data.train_file={formats['jsonl']}"), tok).train)
    for name in ("json", "parquet", "csv", "arrow", "saved"):
        cfg = _config(tmp_path / name, f"data.train_file={formats[name]}")
        assert _tokens(recipe_data.read_data(cfg, tok).train) == expected, name
    assert any((tmp_path / "parquet" / "run" / "data_cache").rglob("*.arrow")), "datasets' cache is under run_dir"
    test = recipe_data.read_data(_config(tmp_path, f"data.train_file={formats['saved']}", "data.valid_split=test"), tok)
    assert _tokens(test.valid) == expected[:3]
    with pytest.raises(ToolkitError, match="has no split 'dev' \\(it has train, test\\)"):
        recipe_data.read_data(_config(tmp_path, f"data.train_file={formats['saved']}", "data.split=dev"), tok)


def test_columns_are_mapped_and_a_missing_column_is_named(tmp_path):
    import datasets

    renamed = [{"question": r["prompt"], "answer": r["response"]} for r in PAIRS]
    datasets.Dataset.from_list(renamed).to_parquet(tmp_path / "qa.parquet")
    tok = _tokenizer()
    expected = recipe_data.read_data(_config(tmp_path, f"data.train_file={_jsonl(tmp_path / 'd.jsonl', PAIRS)}"), tok)
    mapped = recipe_data.read_data(_config(tmp_path, f"data.train_file={tmp_path / 'qa.parquet'}", "data.columns.prompt=question",
                                     "data.columns.response=answer"), tok)
    assert _tokens(mapped.train) == _tokens(expected.train)
    jsonl = recipe_data.read_data(_config(tmp_path, f"data.train_file={_jsonl(tmp_path / 'qa.jsonl', renamed)}",
                                    "data.columns.prompt=question", "data.columns.response=answer"), tok)
    assert _tokens(jsonl.train) == _tokens(expected.train)
    with pytest.raises(ToolkitError, match="has no column query \\(data.columns\\); its columns: question, answer"):
        recipe_data.read_data(_config(tmp_path, f"data.train_file={tmp_path / 'qa.parquet'}", "data.columns.prompt=query"), tok)


def test_a_mixture_takes_each_source_in_its_share(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", PAIRS[:6])
    b = _jsonl(tmp_path / "b.jsonl", [{"text": "7" * 5}, {"text": "8" * 5}])
    tok = _tokenizer()
    got = recipe_data.read_data(_config(tmp_path, f"data.train_file={a},{b}", "data.weights=1,3"), tok)
    assert got.stats.mixture == {str(a): 2, str(b): 6} and len(got.train) == 8
    texts = {tuple(t) for t in _tokens(got.train)}
    assert sum(1 for t in _tokens(got.train) if t[0] in tok.convert_tokens_to_ids(["7", "8"])) == 6
    assert len(texts) == 4, "two of a, and b's two samples repeated to fill its share"
    again = recipe_data.read_data(_config(tmp_path, f"data.train_file={a},{b}", "data.weights=1,3"), tok)
    assert _tokens(again.train) == _tokens(got.train), "the mixture is deterministic"
    with pytest.raises(ToolkitError, match="data.weights has 1 values for 2 data sets"):
        recipe_data.read_data(_config(tmp_path, f"data.train_file={a},{b}", "data.weights=1"), tok)


def test_a_hub_name_offline_is_one_line(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 sets at import
    with pytest.raises(ToolkitError, match="no-such-org/no-such-set is not a local file or directory.*HF_HUB_OFFLINE") as e:
        recipe_data.read_data(_config(tmp_path, "data.train_file=no-such-org/no-such-set"), _tokenizer())
    assert "\n" not in str(e.value)
    with pytest.raises(ToolkitError, match="data file .*typo.parquet does not exist"):
        recipe_data.read_data(_config(tmp_path, f"data.train_file={tmp_path / 'typo.parquet'}"), _tokenizer())


def test_chat_templates_set_by_name_or_file_and_refused_with_the_reason(tmp_path):
    data = _jsonl(tmp_path / "chat.jsonl", CHATS)
    with pytest.raises(ToolkitError, match="has `messages` but the tokenizer has no chat template: set data.chat_template"):
        recipe_data.read_data(_config(tmp_path, f"data.train_file={data}"), _tokenizer())
    chatml = recipe_data.read_data(_config(tmp_path, f"data.train_file={data}", "data.chat_template=chatml", "data.seq_len=64"),
                             _tokenizer(text=True))
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}"
                        "{% else %}={% endif %}{% endfor %}")
    own = recipe_data.read_data(_config(tmp_path, f"data.train_file={data}", f"data.chat_template={template}"), _tokenizer())
    tok = _tokenizer()
    first = own.train[0]
    trained = [t for t, m in zip(first.tokens[1:], first.loss_mask[1:]) if m]
    assert tok.convert_ids_to_tokens(trained) == ["0", "</s>"] and len(chatml.train) == 10
    template.write_text("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}")
    with pytest.raises(ToolkitError, match="does not render assistant turn 2's content in that turn"):
        recipe_data.read_data(_config(tmp_path, f"data.train_file={data}", f"data.chat_template={template}"), _tokenizer())
    template.write_text("{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ToolkitError, match="renders turn 2 by changing what the earlier turns rendered"):
        recipe_data.read_data(_config(tmp_path, f"data.train_file={data}", f"data.chat_template={template}"), _tokenizer())
    with pytest.raises(ToolkitError, match="data.chat_template=nope: neither a file nor a known name"):
        recipe_data.read_data(_config(tmp_path, f"data.train_file={data}", "data.chat_template=nope"), _tokenizer())


def test_data_the_tokenizer_cannot_read_is_refused_with_the_count_and_an_example(tmp_path):
    data = _jsonl(tmp_path / "words.jsonl", WORDS * 4)
    with pytest.raises(ToolkitError, match=r"words.jsonl: \d+ of \d+ tokens \(\d+%\) are the tokenizer's unknown token "
                                           r"'<unk>', above data.max_unk_share=0.05.*e.g. .*words.jsonl:1: ") as e:
        recipe_data.read_data(_config(tmp_path, f"data.train_file={data}", "data.chat_template=chatml"), _tokenizer())
    assert "\n" not in str(e.value)


def test_truncation_side_and_the_samples_it_drops_are_counted(tmp_path):
    long_prompt = [{"prompt": "1" * 30 + "=", "response": "2"}, *PAIRS]
    data = _jsonl(tmp_path / "d.jsonl", long_prompt)
    right = recipe_data.read_data(_config(tmp_path, f"data.train_file={data}"), _tokenizer())
    assert (right.stats.truncated, right.stats.dropped_targets_truncated, len(right.train)) == (1, 1, 10)
    left = recipe_data.read_data(_config(tmp_path, f"data.train_file={data}", "data.truncation=left"), _tokenizer())
    assert (left.stats.truncated, left.stats.dropped_targets_truncated, len(left.train)) == (1, 0, 11)
    assert left.train[0].tokens[15:17] == _tokenizer().convert_tokens_to_ids(["2", "</s>"]), "the response is kept"
    assert "dropped_targets_truncated" in right.stats.summary()
    only_long = _jsonl(tmp_path / "long.jsonl", long_prompt[:1] * 3)
    with pytest.raises(ToolkitError, match=r"holds no usable samples \(3 read: 3 every trained token cut by truncation\)"
                                           ".*data.truncation"):
        recipe_data.read_data(_config(tmp_path, f"data.train_file={only_long}"), _tokenizer())


def test_invalid_utf8_in_a_jsonl_line_is_named_by_file_and_line(tmp_path):
    """Defect (section 5): a UnicodeDecodeError on every rank, where other malformed lines get file:line."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "12"}\n{"text": "1\xff2"}\n{"text": "3"}\n')
    with pytest.raises(ToolkitError, match=f"{path}:2: not valid UTF-8"):
        read_jsonl(path, _tokenizer(), 64, "truncate", "error", DataStats())
    stats = DataStats()
    assert len(read_jsonl(path, _tokenizer(), 64, "truncate", "skip", stats)) == 2 and stats.skipped_malformed == 1


@pytest.mark.parametrize("prepared", ["true", "false"])
def test_images_in_the_data_are_refused_in_one_line_naming_the_line_whatever_malformed_says(tmp_path, prepared):
    """Defect: a conversation with an image (TRL's and LLaMA-Factory's formats) failed in the chat template
    ("can only concatenate str (not "list") to str"), and an `images` column beside text messages trained on
    the text alone, silently. Both are refused naming the line, also under data.malformed=skip, and for DPO's
    pairs; the prepared cache and the in-memory path alike."""
    image_part = {"role": "user", "content": [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "12"}]}
    cases = {
        "part": ([*CHATS[:3], {"messages": [image_part, {"role": "assistant", "content": "3"}]}], ":4: ",
                 "messages[0].content[0] is of type 'image'", ()),
        "column": ([*CHATS[:2], {**CHATS[2], "images": ["cat.png"]}], ":3: ", "its `images` column", ()),
        "dpo": ([{"prompt": [image_part], "chosen": [{"role": "assistant", "content": "1"}],
                  "rejected": [{"role": "assistant", "content": "2"}]}] * 2, ":1: ",
                "prompt[0].content[0] is of type 'image'", ("method=dpo",)),
    }
    for name, (records, line, where, extra) in cases.items():
        data = _jsonl(tmp_path / f"{name}.jsonl", records)
        with pytest.raises(ToolkitError, match="the data holds images") as err:
            recipe_data.read_data(_config(tmp_path, f"data.train_file={data}", "data.chat_template=chatml",
                                          "data.seq_len=64", "data.malformed=skip", f"data.prepared={prepared}",
                                          f"data.cache_dir={tmp_path / name}", *extra), _tokenizer(text=True))
        message = str(err.value)
        assert f"{data}{line}" in message and where in message and "\n" not in message, (name, message)
    kept = [p for name in cases for p in (tmp_path / name).rglob("*")  # the stored refusal and the writers' lock only
            if p.is_file() and not p.name.endswith((".refused", ".prepare-lock"))]
    assert not kept, f"a cache for data that cannot train: {kept}"


@pytest.fixture(scope="module")
def converted(tiny_hf, tmp_path_factory):
    from toolkit.convert import hf_to_megatron

    return hf_to_megatron(tiny_hf["llama"], tmp_path_factory.mktemp("mc") / "mc", fmt="torch", progress=False)


def test_prepare_refuses_data_that_cannot_train_before_the_model(converted, tmp_path, monkeypatch):
    """Defect (section 5): a data set smaller than one global batch trained silently by repeating
    samples. Now `prepare` (every check before any process group or model) refuses it, and data
    the tokenizer cannot read."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    prepare = recipe_prepare()
    data = _jsonl(tmp_path / "d.jsonl", PAIRS[:5])
    path = recipe(tmp_path, converted, data, global_batch=8, micro_batch=1)
    with pytest.raises(ToolkitError, match=f"{data} gives 5 samples, fewer than one global batch of 8: every step would "
                                           "repeat samples"):
        prepare(str(path), [])
    words = _jsonl(tmp_path / "words.jsonl", WORDS * 8)
    with pytest.raises(ToolkitError, match="are the tokenizer's unknown token"):
        prepare(str(path), [f"data.train_file={words}", "data.chat_template=chatml"])
    run = prepare(str(path), ["global_batch=4"])
    assert len(run.data.train) == 5 and run.data.stats.samples == 5


@pytest.mark.parametrize("inside", [False, True])
def test_a_run_dir_that_is_a_file_is_refused_with_the_config(tmp_path, inside):
    """Defect (section 5): FileExistsError traceback after the ranks started."""
    from tests.finetune_harness import assert_refused_in_one_line

    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    run_dir = a_file / "run" if inside else a_file
    what = f"lies inside {a_file}, which is" if inside else "is"
    assert_refused_in_one_line(tmp_path, [f"run_dir={run_dir}"], f"run_dir={run_dir} {what} an existing file, not a directory")
