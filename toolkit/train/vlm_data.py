"""Multimodal conversations -> what a vision-language model trains on, as transformers' processor makes it.

The recipe reads these for a vision-language checkpoint (toolkit.train.image_rows; a text checkpoint's
data path, toolkit.train.data, refuses records with images). A record is a conversation with images in either form TRL and LLaMA-Factory read:

  {"messages": [{"role": "user", "content": [{"type": "image", "image": "cat.png"}, {"type": "text", "text": "..."}]}, ...]}
  {"messages": [{"role": "user", "content": "<image>What is it?"}, ...], "images": ["cat.png"]}

Image parts without a source (`{"type": "image"}`, as TRL's datasets write them) take the `images`
column's images in order, as `<image>` placeholders do. An image is a path relative to the data
file's directory, `{"bytes": ...}` or `{"path": ...}` as datasets' Image feature stores it in
Parquet and Arrow, or an image `datasets` decoded; a URL is refused, since nothing is fetched.
Each is made what transformers' load_image makes of a path (EXIF orientation applied, RGB), so an
image reads the same whichever way it is stored.

The model's own processor (AutoProcessor) renders the conversation with its chat template,
expands each image's placeholder to the image's tokens and makes the pixel values, so the ids and
the image-token counts are transformers' own. The loss mask is the text path's
(chat_templates.locate_turns, data.sample_of_turns): each prefix of the conversation rendered by
the processor, the tokens each assistant turn adds trained. Each prefix is processed with its
images, so a conversation of n turns has its images processed up to n times (twice for the common
image-question-reply record). Truncation keeps the first seq_len + 1 tokens (the text path's default
data.truncation=right); data.truncation=left and data.overlong=drop are not read here.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path

import torch

from toolkit.train.chat_templates import ChatTemplateError, locate_turns
from toolkit.train.data import sample_of_turns
from toolkit.train.data_sources import DataError

IMAGE_PLACEHOLDER = "<image>"  # LLaMA-Factory's default placeholder in string contents (its mm_plugin's image_token)
IMAGE_COLUMNS = ("images", "image")  # a list of images, or one image (TRL's datasets use both)
URL_PREFIXES = ("http://", "https://")
IGNORE_INDEX = -100  # a label not trained: torch's cross_entropy ignore_index, which transformers' models pass
# The processor attributes naming the tokens of an image (Qwen2/2.5/3-VL: <|image_pad|> between <|vision_start|> and
# <|vision_end|>); a truncation that cuts any of them drops the sample
IMAGE_TOKEN_ATTRIBUTES = ("image_token_id", "vision_start_token_id", "vision_end_token_id")
PROCESSOR_TEXT_KEYS = ("input_ids", "attention_mask")  # the processor's outputs that are not the model's extra inputs


@dataclass
class VLMSample:
    input_ids: list[int]
    labels: list[int]  # input_ids where trained, else IGNORE_INDEX; not shifted (transformers' models shift)
    pixel_values: torch.Tensor | None  # the processor's: (patches, patch values) for Qwen-VL; None without images
    image_grid_thw: torch.Tensor | None  # (images, 3): each image's patch grid (frames, height, width)
    per_token: dict[str, list[int]] = field(default_factory=dict)  # the processor's other per-token outputs, cut
    # with input_ids (Qwen3-VL's mm_token_type_ids, which its M-RoPE positions need)


@dataclass
class VLMStats:
    """Samples encoded and why any was dropped, for the caller to report."""

    samples: int = 0
    truncated: int = 0  # longer than seq_len + 1 tokens, the text after the last image cut
    dropped_image_truncated: int = 0  # truncation would cut an image's tokens: never half an image
    dropped_targets_truncated: int = 0  # truncation cut every token the sample trains on
    dropped_no_targets: int = 0  # nothing to train on even uncut (e.g. no assistant turn)


def load_processor(model_dir: str | Path):
    """AutoProcessor.from_pretrained(model_dir), refused in one line when it cannot be loaded or has no image processor."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(str(model_dir))
    except Exception as e:  # ImportError (no torchvision for Qwen-VL's video processor), OSError, ValueError
        fix = ": install torchvision (pip install -e '.[vlm]')" if "torchvision" in str(e).lower() else ""
        raise DataError(f"{model_dir}: the model's processor cannot be loaded ({_first_line(e)}){fix}") from None
    if getattr(processor, "image_processor", None) is None or not getattr(processor, "chat_template", None):
        raise DataError(f"{model_dir}: {type(processor).__name__} is not a vision-language processor with a chat template "
                        "(no image processor, or no chat_template): give the checkpoint the model was published with")
    return processor


def encode_vlm_conversation(processor, record, base_dir: str | Path, seq_len: int, where: str,
                            stats: VLMStats) -> VLMSample | None:
    """The sample of one record (`where`: its file:line), at most seq_len + 1 tokens as the text path's rows;
    None for a sample dropped and counted in `stats`; DataError for input that cannot train, naming the fix."""
    messages = _conversation(record, Path(base_dir), where)
    processed = [_process(processor, messages[: i + 1], where) for i in range(len(messages))]
    try:
        turns = locate_turns(processor.tokenizer, [_text_only(m) for m in messages],
                             [list(p["input_ids"][0]) for p in processed])
    except ChatTemplateError as e:
        raise DataError(f"{where}: {e}") from None
    sample, whole = sample_of_turns(turns), processed[-1]
    per_token = {k: list(v[0]) for k, v in whole.items() if k not in PROCESSOR_TEXT_KEYS and _per_token(v, sample.tokens)}
    kept = _fit(processor, sample.tokens, sample.loss_mask, per_token, seq_len + 1, stats)
    if kept is None:
        return None
    tokens, mask, per_token = kept
    stats.samples += 1
    return VLMSample(tokens, [t if m else IGNORE_INDEX for t, m in zip(tokens, mask)], whole.get("pixel_values"),
                     whole.get("image_grid_thw"), per_token)


def _fit(processor, tokens: list[int], mask: list[int], per_token: dict, max_tokens: int, stats: VLMStats):
    """(tokens, mask, per_token) cut to max_tokens at the end (the text path's default data.truncation=right), or None
    (counted) where the cut would fall in an image's tokens or leave nothing to train on."""
    cut = len(tokens) > max_tokens
    if cut:
        if _last_image_token(processor, tokens) >= max_tokens:
            stats.dropped_image_truncated += 1
            return None
        stats.truncated += 1
        tokens, mask = tokens[:max_tokens], mask[:max_tokens]
        per_token = {k: v[:max_tokens] for k, v in per_token.items()}
    if not sum(mask[1:]):  # the first token is never a target
        if cut:
            stats.dropped_targets_truncated += 1
        else:
            stats.dropped_no_targets += 1
        return None
    return tokens, mask, per_token


def _process(processor, messages: list[dict], where: str):
    """The processor's own rendering of `messages`: ids (a batch of one), pixel values, grids."""
    try:
        return processor.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=False)
    except Exception as e:  # jinja2's TemplateError, a template's raise_exception, the image processor's ValueError
        raise DataError(f"{where}: the model's processor cannot render this conversation ({_first_line(e)})") from None


def _per_token(value, tokens: list[int]) -> bool:
    """Whether a processor output is one value per token (a batch of one list as long as the ids)."""
    return isinstance(value, list) and len(value) == 1 and isinstance(value[0], list) and len(value[0]) == len(tokens)


def _last_image_token(processor, tokens: list[int]) -> int:
    ids = {getattr(processor, name, None) for name in IMAGE_TOKEN_ATTRIBUTES} - {None}
    return max((i for i, t in enumerate(tokens) if t in ids), default=-1)


def _text_only(message: dict) -> dict:
    """The message as locate_turns checks an assistant turn's content: its text parts."""
    content = message["content"]
    if isinstance(content, list):
        content = "".join(part["text"] for part in content if part["type"] == "text")
    return {"role": message["role"], "content": content}


def _conversation(record, base_dir: Path, where: str) -> list[dict]:
    """`messages` with every image a content part holding the loaded image, in the processor's form."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise DataError(f'{where}: expected "messages", a list of {{"role", "content"}} objects (map other names '
                        "with data.columns)")
    for column in ("videos", "video"):
        if record.get(column) not in (None, [], ""):
            raise DataError(f"{where}: its `{column}` column holds videos, which are not read: remove them")
    out = [{"role": m["role"], "content": _parts(m.get("content"), where, i)} for i, m in enumerate(messages)]
    _fill_from_column(out, _column_images(record), where)
    for message in out:
        for part in message["content"] if isinstance(message["content"], list) else []:
            if part["type"] == "image":
                part["image"] = _load_image(part["image"], base_dir, where)
    return out


def _parts(content, where: str, i: int):
    """A message's content: a string without placeholders as it is; else parts, `<image>` an image part without
    a source (None) that the `images` column fills."""
    if isinstance(content, str):
        if IMAGE_PLACEHOLDER not in content:
            return content
        parts = []
        for j, text in enumerate(content.split(IMAGE_PLACEHOLDER)):
            if j:
                parts.append({"type": "image", "image": None})
            if text:
                parts.append({"type": "text", "text": text})
        return parts
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise DataError(f"{where}: messages[{i}].content must be a string or a list of {{\"type\", ...}} parts")
    return [_part(part, where, i, j) for j, part in enumerate(content)]


def _part(part: dict, where: str, i: int, j: int) -> dict:
    kind = part.get("type")
    if kind == "text":
        return {"type": "text", "text": str(part.get("text") or "")}
    if kind == "image":
        source = next((part[k] for k in ("image", "path", "url") if part.get(k) is not None), None)
        return {"type": "image", "image": source}
    if kind in ("video", "video_url"):
        raise DataError(f"{where}: messages[{i}].content[{j}] is a video, and videos are not read: remove it")
    raise DataError(f'{where}: messages[{i}].content[{j}] is of type {kind!r}: write an image as {{"type": "image", '
                    '"image": PATH}, text as {"type": "text", "text": ...}')


def _column_images(record: dict) -> list:
    for column in IMAGE_COLUMNS:
        value = record.get(column)
        if value not in (None, [], ""):
            return list(value) if isinstance(value, (list, tuple)) else [value]
    return []


def _fill_from_column(messages: list[dict], images: list, where: str) -> None:
    """The image parts without a source (each `<image>`), given the column's images in order: as many as there are."""
    slots = [p for m in messages if isinstance(m["content"], list) for p in m["content"]
             if p["type"] == "image" and p["image"] is None]
    if len(slots) != len(images):
        raise DataError(f"{where}: {len(slots)} {IMAGE_PLACEHOLDER} placeholders (or image parts without a source) in "
                        f"`messages` for {len(images)} images in the `images` column: write one {IMAGE_PLACEHOLDER} "
                        "where each image goes, in the column's order")
    for slot, image in zip(slots, images):
        slot["image"] = image


def _load_image(source, base_dir: Path, where: str):
    """A PIL image, as transformers' load_image makes it of a path (EXIF orientation applied, RGB)."""
    from PIL import Image
    from transformers.image_utils import load_image

    if isinstance(source, dict) and source.get("bytes") is not None:  # datasets' Image feature, not decoded
        name, opened = source.get("path") or "given as bytes", lambda: Image.open(io.BytesIO(source["bytes"]))
    elif isinstance(source, Image.Image):  # decoded by datasets (Parquet and Arrow images read so), maybe lazily
        name, opened = getattr(source, "filename", "") or "decoded by datasets", lambda: source
    else:
        given = source.get("path") if isinstance(source, dict) else source
        if not isinstance(given, (str, Path)):
            what = "a dict with neither bytes nor a path" if isinstance(source, dict) else type(source).__name__
            raise DataError(f"{where}: an image is {what}: give a path, {{\"bytes\": ...}} or {{\"path\": ...}}")
        if str(given).startswith(URL_PREFIXES):
            raise DataError(f"{where}: image {given} is a URL, and images are not fetched (offline): download it and "
                            "give its path, relative to the data file's directory")
        path = base_dir / given
        if not path.is_file():
            raise DataError(f"{where}: image {given} does not exist (looked for {path}): give its path relative to "
                            f"the data file's directory, {base_dir}")
        name, opened = str(given), lambda: Image.open(path)
    try:
        image = opened()
        image.load()  # decode now: a truncated or corrupt file fails here, naming it
    except (OSError, ValueError, Image.DecompressionBombError) as e:  # UnidentifiedImageError is an OSError
        raise DataError(f"{where}: image {name} cannot be read ({_first_line(e)}): replace it with a readable "
                        "image file") from None
    return load_image(image)


def _first_line(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[0].strip() if lines else type(e).__name__
