"""Chat templates: `data.chat_template=FILE|NAME` sets or overrides the tokenizer's, and a template
is checked on a probe conversation before any data is read, so that one whose assistant turns
cannot be told apart for the loss mask is one line naming why.

The loss mask is found by rendering a conversation turn by turn (toolkit.train.data): the tokens
each assistant turn adds are the trained ones. That needs a template that renders a conversation's
prefix as a prefix of the whole, and that renders each assistant turn's content in that turn.
"""

from __future__ import annotations

from pathlib import Path

from toolkit.errors import ToolkitError


class ChatTemplateError(ToolkitError):
    """A chat template is missing, unreadable, or its assistant turns cannot be located."""


# Templates by name, for tokenizers that ship none. ChatML as Qwen2 and many fine-tunes write it
# (without their default system prompt).
NAMED = {
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
        " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
}

PROBE = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
         {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]


def template_text(given: str) -> str:
    """The Jinja text of `data.chat_template`: a file's contents, or a template of NAMED."""
    path = Path(given)
    if path.is_file():
        try:
            return path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"data.chat_template={given}: cannot be read as UTF-8 text ({e})") from None
    if given in NAMED:
        return NAMED[given]
    raise ChatTemplateError(f"data.chat_template={given}: neither a file nor a known name ({', '.join(NAMED)})")


def apply(tokenizer, given: str | None) -> None:
    """Set the tokenizer's template from `data.chat_template` (None: keep the tokenizer's own)."""
    if given is not None:
        tokenizer.chat_template = template_text(given)


def require(tokenizer) -> None:
    """`messages` data needs a template: refused here, before any rank starts working."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("the data has `messages` but the tokenizer has no chat template: set "
                                f"data.chat_template=FILE (a Jinja template) or one of {', '.join(NAMED)}")


def render(tokenizer, messages: list[dict]) -> list[int]:
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    except Exception as e:  # jinja2's TemplateError, or a template's own raise_exception
        raise ChatTemplateError(f"the chat template fails to render: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def _squeezed(text: str) -> str:
    return "".join(text.split())


def _decode(tokenizer, ids: list[int]) -> str:
    """tokenizer.decode(ids) up to whitespace, which _squeezed drops: a fast tokenizer's own decode,
    without transformers' per-call conversions (its clean-up of spaces before punctuation is all it adds)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    return backend.decode(ids, skip_special_tokens=False) if backend is not None else tokenizer.decode(ids)


def _renders_content(tokenizer, content: str, added: list[int]) -> bool:
    """Whether the turn's tokens hold the message's content, as it is or as the tokenizer reads it
    (unknown characters and all); the content is encoded only when it is not there as it is, since
    encoding every assistant message again was a third of the time preparing chat data took."""
    if not added:
        return False
    turn = _squeezed(_decode(tokenizer, added))
    if _squeezed(content) in turn:
        return True
    read = tokenizer.decode(tokenizer(content, add_special_tokens=False)["input_ids"])
    return _squeezed(read) in turn


def locate_turns(tokenizer, messages: list[dict], prefixes: list[list[int]] | None = None) -> list[tuple[list[int], bool]]:
    """Each turn's tokens and whether it is an assistant turn; ChatTemplateError naming why the
    turns cannot be told apart. `prefixes`: chat_prefixes.render_prefixes' result for these messages."""
    tokens: list[int] = []
    turns = []
    for i, message in enumerate(messages):
        rendered = prefixes[i] if prefixes is not None else render(tokenizer, messages[: i + 1])
        if rendered[: len(tokens)] != tokens:
            raise ChatTemplateError(
                f"the chat template renders turn {i + 1} by changing what the earlier turns rendered (not a prefix), "
                "so the assistant tokens cannot be located for the loss mask; use a template that renders each turn "
                "on its own (e.g. data.chat_template=chatml)")
        added = rendered[len(tokens):]
        assistant = message.get("role") == "assistant"
        if assistant and not _renders_content(tokenizer, str(message.get("content", "")), added):
            raise ChatTemplateError(
                f"the chat template does not render assistant turn {i + 1}'s content in that turn (it adds "
                f"{len(added)} tokens), so its tokens cannot be located for the loss mask; use a template "
                "that renders every assistant message (e.g. data.chat_template=chatml)")
        tokens += added
        turns.append((added, assistant))
    return turns


def check(tokenizer) -> None:
    """The template renders a probe conversation with locatable assistant turns."""
    require(tokenizer)
    locate_turns(tokenizer, PROBE)
