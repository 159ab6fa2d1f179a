"""Every prefix of a conversation rendered and tokenized, as the loss mask needs them
(chat_templates.locate_turns), with each conversation's text encoded once.

The mask is defined by rendering each prefix of a conversation with the chat template and encoding
it: the tokens an assistant turn adds are the trained ones. Encoding every prefix encodes a
conversation of n turns about n/2 times over, and that was most of the time preparing chat data
took. So each conversation is encoded once, whole, and a prefix's tokens are the whole's first k
tokens when that is exactly what encoding the prefix gives:

- the prefix's rendered text is a string prefix of the whole's (a template that rewrites earlier
  turns, as some do with reasoning, is not), and
- it ends where the whole's text is split before any encoding happens: at the whole's end, or
  where one of the tokenizer's added tokens (a template's `<|im_start|>`, `<start_of_turn>`, ...)
  begins. A fast tokenizer (`tokenizers`) splits its input at added tokens first and normalizes,
  pre-tokenizes and encodes each piece between them on its own, so the prefix's pieces are the
  whole's first pieces, encoded alike. (An added token that strips the whitespace before it,
  `lstrip`, begins in the offsets where that whitespace does, so a prefix ending in the whitespace
  does not end at it.)

Any other prefix is encoded by itself, as before. Each batch's first conversation is also encoded
prefix by prefix and compared: a tokenizer that does not split so (none known) gets every prefix
encoded by itself. tests/test_chat_prefixes.py compares this with apply_chat_template on each
prefix for byte-level BPE, SentencePiece-style (Metaspace) and normalizing tokenizers.
"""

from __future__ import annotations


def render_prefixes(tokenizer, conversations: list[list[dict]]) -> list[list[list[int]]] | None:
    """apply_chat_template(tokenize=True) of every prefix of every conversation, in batched calls;
    None when the template fails on any of them (each is then rendered alone, to say which)."""
    prefixes = [conversation[: i + 1] for conversation in conversations for i in range(len(conversation))]
    if not prefixes:
        return []
    try:
        texts = tokenizer.apply_chat_template(prefixes, tokenize=False, add_generation_prompt=False)
    except Exception:
        return None
    grouped, start = [], 0
    for conversation in conversations:
        grouped.append(texts[start: start + len(conversation)])
        start += len(conversation)
    if not getattr(tokenizer, "is_fast", False):
        return [[list(ids) for ids in _encode(tokenizer, group)] for group in grouped]
    rendered = _from_whole(tokenizer, grouped)
    if rendered[0] != _encode(tokenizer, grouped[0]):  # a tokenizer that does not split at added tokens
        return [[list(ids) for ids in _encode(tokenizer, group)] for group in grouped]
    return rendered


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """The texts encoded as apply_chat_template(tokenize=True) encodes its rendering."""
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def _with_offsets(tokenizer, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """(ids, character offsets) of each text, encoded as _encode encodes: the backend's encode_batch
    itself when transformers would call it so (no truncation or padding set, special tokens split
    as the tokenizer says), without converting every field of each encoding to Python."""
    backend = tokenizer.backend_tokenizer
    if backend.truncation is None and backend.padding is None and \
            backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False)):
        return [(e.ids, e.offsets) for e in backend.encode_batch(texts, add_special_tokens=False)]
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return list(zip(encoded["input_ids"], encoded["offset_mapping"]))


def _from_whole(tokenizer, grouped: list[list[str]]) -> list[list[list[int]]]:
    """Each conversation's prefixes (its rendered texts, the last the whole) from one encoding of the
    whole, where a prefix ends at a split (module docstring); the other prefixes encoded alone."""
    splitting = set(tokenizer.added_tokens_decoder)
    out, alone = [], []
    for c, (texts, (ids, offsets)) in enumerate(zip(grouped, _with_offsets(tokenizer, [texts[-1] for texts in grouped]))):
        starts = {offsets[j][0]: j for j in range(len(ids)) if ids[j] in splitting}
        starts[len(texts[-1])] = len(ids)
        prefixes = []
        for p, text in enumerate(texts):
            cut = starts.get(len(text)) if texts[-1].startswith(text) else None
            if cut is None:
                alone.append((c, p, text))
            prefixes.append(list(ids[:cut]) if cut is not None else None)
        out.append(prefixes)
    for (c, p, _), ids in zip(alone, _encode(tokenizer, [text for _, _, text in alone])):
        out[c][p] = list(ids)
    return out
