"""Image + text conversations are encoded as transformers' own processor encodes them (toolkit.train.vlm_data).

The processor is a tiny Qwen3-VL one built from transformers' classes (toolkit.tinymodels.make_tiny_qwen3_vl_processor)
and loaded back with AutoProcessor. The reference is that processor's apply_chat_template called directly on the
same conversation, with the images as paths that transformers opens itself; the loss mask's reference is found in
the ids, turn by turn, without rendering prefixes.
"""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from tests.vlm_reference import trained_mask
from toolkit.tinymodels import make_tiny_qwen3_vl_processor
from toolkit.train.data import parse_line
from toolkit.train.data_sources import DataError, Source, records
from toolkit.train.vlm_data import IGNORE_INDEX, VLMStats, encode_vlm_conversation, load_processor

SEQ_LEN = 512  # longer than every conversation here


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    return load_processor(make_tiny_qwen3_vl_processor(tmp_path_factory.mktemp("qwen3-vl-processor")))


@pytest.fixture
def images(tmp_path):
    """Two images of different sizes (and so token counts) beside the data file, in their own folder."""
    (tmp_path / "pics").mkdir()
    torch.manual_seed(0)
    for name, (w, h) in {"small.png": (28, 28), "wide.png": (84, 56)}.items():
        pixels = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8).numpy()
        Image.fromarray(pixels).save(tmp_path / "pics" / name)
    return tmp_path


def trl_record(first="pics/small.png", second="pics/wide.png") -> dict:
    return {"messages": [
        {"role": "user", "content": [{"type": "image", "image": first}, {"type": "text", "text": "Which is wider?"},
                                     {"type": "image", "image": second}]},
        {"role": "assistant", "content": [{"type": "text", "text": "The second."}]},
        {"role": "user", "content": [{"type": "text", "text": "By how much?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Three to one."}]}]}


def reference(processor, directory):
    """transformers' processor on the same conversation, reading the images from absolute paths itself."""
    record = trl_record(str(directory / "pics/small.png"), str(directory / "pics/wide.png"))
    return processor.apply_chat_template(record["messages"], tokenize=True, return_dict=True)


def encode(processor, record, directory, seq_len=SEQ_LEN, stats=None):
    return encode_vlm_conversation(processor, record, directory, seq_len, f"{directory}/data.jsonl:3", stats or VLMStats())


def assert_is_reference(sample, expected):
    assert sample.input_ids == expected["input_ids"][0]
    assert torch.equal(sample.pixel_values, expected["pixel_values"])
    assert torch.equal(sample.image_grid_thw, expected["image_grid_thw"])
    assert sample.per_token == {"mm_token_type_ids": expected["mm_token_type_ids"][0]}


def test_ids_and_pixels_are_the_processors_own_for_images_of_two_sizes(processor, images):
    expected = reference(processor, images)
    sample = encode(processor, trl_record(), images)
    assert_is_reference(sample, expected)
    # 28 x 28 resizes to one 32 x 32 block, 84 x 56 to 96 x 64: 6 tokens
    assert sample.image_grid_thw.tolist() == [[1, 2, 2], [1, 4, 6]]
    assert sample.input_ids.count(processor.image_token_id) == 1 + 6


def test_sharegpt_placeholders_and_datasets_bytes_give_the_same_sample(processor, images):
    expected = reference(processor, images)
    sharegpt = {"messages": [{"role": "user", "content": "<image>Which is wider?<image>"},
                             {"role": "assistant", "content": "The second."},
                             {"role": "user", "content": "By how much?"}, {"role": "assistant", "content": "Three to one."}],
                "images": ["pics/small.png", "pics/wide.png"]}
    assert_is_reference(encode(processor, sharegpt, images), expected)
    as_bytes = trl_record({"bytes": (images / "pics/small.png").read_bytes(), "path": None},
                          {"bytes": (images / "pics/wide.png").read_bytes(), "path": "wide.png"})
    assert_is_reference(encode(processor, as_bytes, images), expected)


def test_a_parquet_file_of_datasets_images_reads_as_the_files(processor, images):
    """TRL's layout (image parts without a source, an `images` column of the Image feature), through data_sources."""
    import datasets

    record = trl_record()
    for message in record["messages"]:
        for part in message["content"]:
            part.setdefault("text", None)
            part["image"] = None
    record["images"] = [str(images / "pics/small.png"), str(images / "pics/wide.png")]
    table = datasets.Dataset.from_list([record]).cast_column("images", datasets.Sequence(datasets.Image()))
    table.to_parquet(str(images / "data.parquet"))
    (where, row), = records(Source(str(images / "data.parquet")), {"messages": "messages", "images": "images"},
                            images / "cache")
    assert_is_reference(encode_vlm_conversation(processor, row, images, SEQ_LEN, where, VLMStats()),
                        reference(processor, images))


def test_exif_rotation_and_palette_images_read_as_transformers_reads_a_path(processor, tmp_path):
    """A JPEG whose EXIF turns it a quarter (84 x 56 stored, 56 x 84 shown) and a palette PNG: given as paths, as
    bytes or decoded (as `datasets` gives them), each is the image transformers makes of the path."""
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    Image.new("RGB", (84, 56), (200, 30, 30)).save(tmp_path / "turned.jpg", exif=exif)
    Image.new("P", (28, 28), 7).save(tmp_path / "palette.png")
    paths = [tmp_path / "turned.jpg", tmp_path / "palette.png"]
    expected = processor.apply_chat_template(trl_record(*map(str, paths))["messages"], tokenize=True, return_dict=True)
    assert expected["image_grid_thw"].tolist() == [[1, 6, 4], [1, 2, 2]]  # the JPEG read upright: 96 x 64 pixels
    for given in (["turned.jpg", "palette.png"], [{"bytes": p.read_bytes(), "path": None} for p in paths],
                  [Image.open(p) for p in paths]):
        assert_is_reference(encode(processor, trl_record(*given), tmp_path), expected)


def test_only_assistant_turns_are_trained(processor, images):
    sample = encode(processor, trl_record(), images)
    mask = trained_mask(processor.tokenizer, sample.input_ids)  # the fine-tune's reference's own
    assert sum(mask) and sum(mask) < len(mask)
    assert sample.labels == [t if m else IGNORE_INDEX for t, m in zip(sample.input_ids, mask)]
    trained = processor.tokenizer.decode([t for t in sample.labels if t != IGNORE_INDEX])
    assert trained == "<|im_start|>assistant\nThe second.<|im_end|>\n<|im_start|>assistant\nThree to one.<|im_end|>\n"
    # the guard: a mask that also trains the image tokens (mm_token_type_ids 1) is not this one
    images_trained = [1 if m or kind else 0 for m, kind in zip(mask, sample.per_token["mm_token_type_ids"])]
    assert images_trained != mask
    assert sample.labels != [t if m else IGNORE_INDEX for t, m in zip(sample.input_ids, images_trained)]


def test_a_conversation_without_images_is_the_text_paths_sample(processor, images):
    record = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    sample = encode(processor, record, images)
    text = parse_line(processor.tokenizer, record)
    assert sample.input_ids == text.tokens
    assert [int(label != IGNORE_INDEX) for label in sample.labels] == text.loss_mask
    assert sample.pixel_values is None and sample.image_grid_thw is None


def test_truncation_never_cuts_an_image_and_drops_are_counted(processor, images):
    whole = encode(processor, trl_record(), images)
    last_image = max(i for i, t in enumerate(whole.input_ids) if t == processor.vision_end_token_id)
    stats = VLMStats()
    # a cut before the second image's <|vision_end|>: dropped, never half an image
    assert encode(processor, trl_record(), images, seq_len=last_image - 1, stats=stats) is None
    # a cut in the last reply: the images whole, the text after them cut
    cut = encode(processor, trl_record(), images, seq_len=len(whole.input_ids) - 4, stats=stats)
    assert cut.input_ids == whole.input_ids[: len(whole.input_ids) - 3] and cut.labels == whole.labels[: len(cut.input_ids)]
    assert torch.equal(cut.pixel_values, whole.pixel_values) and torch.equal(cut.image_grid_thw, whole.image_grid_thw)
    assert len(cut.per_token["mm_token_type_ids"]) == len(cut.input_ids)
    # a cut right before the first reply (seq_len + 1 tokens kept) leaves nothing to train on
    first_reply = next(i for i, label in enumerate(whole.labels) if label != IGNORE_INDEX)
    assert encode(processor, trl_record(), images, seq_len=first_reply - 1, stats=stats) is None
    assert encode(processor, {"messages": trl_record()["messages"][:1]}, images, stats=stats) is None
    assert (stats.samples, stats.truncated, stats.dropped_image_truncated, stats.dropped_targets_truncated,
            stats.dropped_no_targets) == (1, 2, 1, 1, 1)


def _with_first_image(source) -> dict:
    record = trl_record()
    record["messages"][0]["content"][0] = {"type": "image", "image": source}
    return record


def _sharegpt(content: str, images: list) -> dict:
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}], "images": images}


def _not_an_image(directory) -> dict:
    (directory / "pics/text.png").write_text("not an image")
    return _with_first_image("pics/text.png")


def _truncated_png(directory) -> bytes:
    data = (directory / "pics/wide.png").read_bytes()
    return data[: len(data) // 2]


BAD = {
    "missing image": (lambda d: _with_first_image("pics/gone.png"), ["image pics/gone.png does not exist",
                                                                     "relative to the data file's directory"]),
    "unreadable image": (_not_an_image, ["image pics/text.png cannot be read", "replace it with a readable image file"]),
    "truncated image bytes": (lambda d: _with_first_image({"bytes": _truncated_png(d), "path": "wide.png"}),
                              ["image wide.png cannot be read"]),
    "URL": (lambda d: _with_first_image("https://example.com/cat.png"),
            ["image https://example.com/cat.png is a URL", "download it and give its path"]),
    "more placeholders than images": (lambda d: _sharegpt("<image><image>Same?", ["pics/small.png"]),
                                      ["2 <image> placeholders", "for 1 images", "write one <image> where each image goes"]),
    "fewer placeholders than images": (lambda d: _sharegpt("Same?", ["pics/small.png", "pics/wide.png"]),
                                       ["0 <image> placeholders", "for 2 images"]),
    "neither bytes nor a path": (lambda d: _with_first_image({"bytes": None, "path": None}),
                                 ["an image is a dict with neither bytes nor a path"]),
    "a video": (lambda d: trl_record() | {"videos": ["clip.mp4"]}, ["`videos` column holds videos"]),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_is_one_line_naming_the_line_and_the_fix(processor, images, case):
    make, expected = BAD[case]
    with pytest.raises(DataError) as raised:
        encode(processor, make(images), images)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"{images}/data.jsonl:3: "), message
    for part in expected:
        assert part in message, message


def test_a_text_models_tokenizer_is_not_a_vision_processor(tmp_path):
    from toolkit.tinymodels import build_tokenizer

    build_tokenizer(text=True).save_pretrained(str(tmp_path))
    with pytest.raises(DataError, match="is not a vision-language processor"):
        load_processor(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())  # a real tokenizer was there to load
