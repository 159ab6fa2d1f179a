"""What a prepared data set depends on, and the directory name that says it.

A prepared source (toolkit.train.prepared_store) holds the tokenized samples of one data set as one
set of read options makes them. Everything that can change a token or a mask is in its key: the
records' content (toolkit.train.data_sources.content_fingerprint), the tokenizer as loaded (its
saved files, chat template included), the read options (seq_len + 1, overlong, truncation,
malformed, columns), the split, the method (sft samples or dpo pairs), and the versions of the code
that tokenizes (this toolkit, transformers, tokenizers) and of the cache's layout. A change to any
of them is another directory, never a stale cache.

What only arranges samples is not in the key, so that changing it reuses the tokens: data.pack and
data.shuffle (rows and order are built on the index at every start), data.weights and seed (a
mixture is picked from each source's cache), data.max_unk_share and global_batch (checked against
the stored counts at every start).
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import asdict
from pathlib import Path

from toolkit.checksum import Hasher, file_digest

# The layout of a prepared directory (toolkit.train.prepared_store); a change makes new keys.
FORMAT = 1
KEY_CHARS = 24  # of the key's hex digest in the directory name (96 bits)


def tokenizer_fingerprint(tokenizer) -> str:
    """The BLAKE3 of the tokenizer's files as `save_pretrained` writes them: its vocabulary, merges,
    normalisation, special tokens, chat template and BOS/EOS settings, whatever they were loaded from."""
    hasher = Hasher()
    with tempfile.TemporaryDirectory(prefix="toolkit-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        for file in sorted(Path(tmp).rglob("*")):
            if file.is_file():
                hasher.update(f"{file.relative_to(tmp).as_posix()}\0{file_digest(file)}\0".encode())
    return hasher.hexdigest()


def key_fields(source, content: str, tokenizer_digest: str, opts, method: str) -> dict:
    """Every input of a prepared source, as `toolkit data inspect` shows them."""
    import tokenizers
    import transformers

    from toolkit import __version__

    return {"format": FORMAT, "source": source.name, "split": source.split, "content": content,
            "tokenizer": tokenizer_digest, "method": method, "options": asdict(opts),
            "versions": {"toolkit": __version__, "transformers": transformers.__version__,
                         "tokenizers": tokenizers.__version__}}


def key_of(fields: dict) -> str:
    hasher = Hasher()
    hasher.update(json.dumps(fields, sort_keys=True).encode())
    return hasher.hexdigest().split(":", 1)[1]


def directory_name(fields: dict) -> str:
    """`<data set's name>-<method>-<key>`: readable in a listing, unique by its key."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(fields["source"]).name or fields["source"])[:40]
    return f"{stem}-{fields['method']}-{key_of(fields)[:KEY_CHARS]}"
