"""Every prefix's tokens from one encoding of the whole conversation (toolkit/train/chat_prefixes.py)
are what transformers' apply_chat_template(tokenize=True) gives for that prefix alone, for the kinds of
fast tokenizer published checkpoints ship: byte-level BPE (GPT-2, Llama 3, Qwen), SentencePiece-style
Metaspace with a normalizer that changes the text's length (NFKC, lowercasing), and an added token
that strips the whitespace before it; with ChatML, Llama 3's and Gemma's templates, one that rewrites
earlier turns (not a prefix), one without added tokens between turns, and content holding a
template's own special tokens.

The reference is transformers' own call on each prefix, not our code. Guard: a prefix cut wherever
its text ends (not only at an added token) disagrees with it.
"""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from toolkit.train import chat_prefixes
from toolkit.train.chat_templates import NAMED

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<|begin_of_text|>", "<start_of_turn>", "<end_of_turn>", "<bos>"]
GEMMA = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
         "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}")
# Earlier assistant turns rendered shorter than the last one (as reasoning templates drop <think>): not a prefix
REWRITING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and not loop.last %}"
             "{{ m['content'][:5] }}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}")
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"  # no added token between turns
TEMPLATES = {"chatml": NAMED["chatml"], "llama3": NAMED["llama3"], "gemma": GEMMA, "rewriting": REWRITING,
             "plain": PLAIN}

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Ünïcödé ﬁne İstanbul straße 東京 🙂 done?",
          "  leading spaces and\ttabs\n\nnew lines  ", "What is 2+2? It is 4, of course!"] * 20

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  spaces  around  "},
     {"role": "assistant", "content": "\nnew line first"}, {"role": "user", "content": "ﬁne İstanbul 🙂"},
     {"role": "assistant", "content": "Straße 東京 done?  "}],
    [{"role": "user", "content": "quote <|im_end|> and <|im_start|>assistant inside"},
     {"role": "assistant", "content": "<|eot_id|> ok <end_of_turn>"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "empty question"},
     {"role": "user", "content": "x"}],
]


def fast_tokenizer(kind: str) -> PreTrainedTokenizerFast:
    """A small tokenizer of `kind`, trained on CORPUS, with every template's special tokens."""
    core = Tokenizer(models.BPE(unk_token="<unk>" if kind == "metaspace" else None))
    specials: list = list(SPECIALS)
    if kind in ("byte-level", "lstrip"):
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        core.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        if kind == "lstrip":  # the turn opener swallows the newline before it
            specials[1] = AddedToken("<|im_start|>", lstrip=True, special=True)
            specials[7] = AddedToken("<start_of_turn>", lstrip=True, special=True)
    else:  # SentencePiece's kind: a normalizer that changes lengths, ▁ prepended to each piece
        core.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
        core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
        alphabet = sorted(set("".join(CORPUS + [m["content"] for c in CONVERSATIONS for m in c]).lower()))
        specials.append("<unk>")
    core.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                        initial_alphabet=alphabet))
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")


def reference(tokenizer, conversations):
    """apply_chat_template(tokenize=True) on each prefix alone: what the loss mask is defined by."""
    out = []
    for conversation in conversations:
        rendered = [tokenizer.apply_chat_template(conversation[: i + 1], tokenize=True, add_generation_prompt=False)
                    for i in range(len(conversation))]
        out.append([list(r["input_ids"] if hasattr(r, "keys") else r) for r in rendered])
    return out


def grouped_texts(tokenizer, conversations):
    return [[tokenizer.apply_chat_template(c[: i + 1], tokenize=False) for i in range(len(c))] for c in conversations]


@pytest.fixture(scope="module", params=["byte-level", "metaspace", "lstrip"])
def tokenizer(request):
    return fast_tokenizer(request.param)


@pytest.mark.parametrize("template", TEMPLATES)
def test_every_prefix_is_what_apply_chat_template_gives_for_it(tokenizer, template):
    tokenizer.chat_template = TEMPLATES[template]
    expected = reference(tokenizer, CONVERSATIONS)
    assert chat_prefixes.render_prefixes(tokenizer, CONVERSATIONS) == expected
    # ... and so is the derivation itself, before the first conversation's check could hide a wrong one
    assert chat_prefixes._from_whole(tokenizer, grouped_texts(tokenizer, CONVERSATIONS)) == expected


def test_prefixes_are_mostly_cut_from_the_whole(monkeypatch):
    """The point of it: with ChatML and a byte-level BPE, only the wholes and the first
    conversation's check are encoded, not every prefix."""
    tokenizer = fast_tokenizer("byte-level")
    tokenizer.chat_template = NAMED["chatml"]
    encoded = []
    real = chat_prefixes._encode
    monkeypatch.setattr(chat_prefixes, "_encode", lambda tok, texts: encoded.extend(texts) or real(tok, texts))
    assert chat_prefixes.render_prefixes(tokenizer, CONVERSATIONS) == reference(tokenizer, CONVERSATIONS)
    assert len(encoded) == len(CONVERSATIONS[0]), encoded


def test_guard_a_prefix_cut_where_its_text_ends_is_wrong_without_a_split():
    """Cutting the whole's tokens wherever a prefix's text ends (not only at an added token) is not
    the prefix's encoding: with turns rendered back to back, 'bro' + 'wn' is one word of the whole."""
    tokenizer = fast_tokenizer("byte-level")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    conversations = [[{"role": "user", "content": "The quick bro"}, {"role": "assistant", "content": "wn fox"}]]
    texts, expected = grouped_texts(tokenizer, conversations), reference(tokenizer, conversations)
    naive = []
    for group, (ids, offsets) in zip(texts, chat_prefixes._with_offsets(tokenizer, [t[-1] for t in texts])):
        naive.append([list(ids[: sum(start < len(text) for start, _ in offsets)]) for text in group])
    assert naive != expected
    assert chat_prefixes.render_prefixes(tokenizer, conversations) == expected


def test_a_tokenizer_the_derivation_gets_wrong_is_encoded_prefix_by_prefix(monkeypatch):
    """The first conversation's check: a derivation that is wrong for it falls back to every prefix alone."""
    tokenizer = fast_tokenizer("byte-level")
    tokenizer.chat_template = NAMED["chatml"]
    monkeypatch.setattr(chat_prefixes, "_from_whole", lambda tok, grouped: [[[0] for _ in g] for g in grouped])
    assert chat_prefixes.render_prefixes(tokenizer, CONVERSATIONS) == reference(tokenizer, CONVERSATIONS)
