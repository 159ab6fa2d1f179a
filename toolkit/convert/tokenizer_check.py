"""Conversion needs no tokenizer, but training loads one from OUT/hf/ (AutoTokenizer): say so at
conversion time rather than let every rank fail later with a transformers traceback."""

from __future__ import annotations

import sys
from pathlib import Path

from toolkit.convert.metadata import HF_DIR

# Any one of these lets AutoTokenizer load: a fast tokenizer, a sentencepiece model, or BPE files.
LOADABLE_TOKENIZERS = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))


def missing_tokenizer(hf_dir: Path, out_dir: Path) -> str | None:
    """The one-line warning for an HF directory with no loadable tokenizer, else None."""
    if any(all((hf_dir / name).is_file() for name in names) for names in LOADABLE_TOKENIZERS):
        return None
    wanted = ", ".join(" + ".join(names) for names in LOADABLE_TOKENIZERS)
    return (f"{hf_dir} has no tokenizer files (none of {wanted}): the checkpoint converts and verifies, but "
            f"training needs them; copy them (and tokenizer_config.json) into {out_dir / HF_DIR}/")


def warn_if_no_tokenizer(hf_dir: Path, out_dir: Path) -> None:
    message = missing_tokenizer(Path(hf_dir), Path(out_dir))
    if message:
        print(f"warning: {message}", file=sys.stderr)
