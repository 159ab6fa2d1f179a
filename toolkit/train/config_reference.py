"""The recipe-key reference, docs/reference/recipe_keys.md, generated from the config dataclasses
(toolkit/train/config.py): every key a recipe YAML or a `key.sub=value` override can set, with its
type, default and the comment written beside its field. The dataclasses stay the one place a key is
described; a test regenerates the page and fails when the committed file differs.

    python -m toolkit.train.config_reference            # rewrite docs/reference/recipe_keys.md
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Annotated, Literal

from toolkit.bounds import Bound
from toolkit.train.config import TrainConfig

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "recipe_keys.md"
REGENERATE = "python -m toolkit.train.config_reference"

INTRO = f"""\
# Recipe keys

<!-- Generated from toolkit/train/config.py by `{REGENERATE}`; do not edit by hand. -->

Every key of a fine-tuning recipe, as `recipes/finetune.py` reads it: from the recipe YAML
(`--config FILE`), then from `key.sub=value` overrides on the command line (`optim.lr=1e-4
parallel.tp=2`). An unknown key is refused, and each value is checked against its type, its
choices and its range as it is read; `null` (or `none` on the command line) means "not set".
Rules that span several keys (ZeRO stage with pipeline parallelism, LoRA with sequence
parallelism, ...) are checked next, and the layout once the world size is known; each refusal is
one line naming the key. The resolved config is written to `RUN_DIR/resolved_config.json`.
"""


def field_comments(cls: type) -> dict[str, str]:
    """The comment of each field of the dataclass `cls`: the comment lines right above the field
    and the comment at the end of its line, joined."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    trailing: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and lines[token.start[0] - 1].strip() != token.string.strip():
            trailing[token.start[0]] = token.string.lstrip("#").strip()
    comments = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, lines[line - 1].strip().lstrip("#").strip())
            line -= 1
        after = [trailing[n] for n in range(node.lineno, node.end_lineno + 1) if n in trailing]
        comments[node.target.id] = " ".join(above + after)
    return comments


def describe_type(hint) -> str:
    """A field's type in words, as a recipe writer needs it."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        bounds = [b.describe() for b in args[1:] if isinstance(b, Bound)]
        return " and ".join(bounds) or describe_type(args[0])
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin is typing.Union or origin is types.UnionType:
        kinds = [describe_type(a) for a in args if a is not type(None)]
        return " or ".join(kinds) + (" or `null`" if type(None) in args else "")
    if origin is tuple:
        kinds = {describe_type(a) for a in args}
        item = kinds.pop() if len(kinds) == 1 else ", ".join(describe_type(a) for a in args)
        return f"a list of {len(args)}, each {item}" if len(set(args)) == 1 else f"a list: [{item}]"
    if origin in (list, dict):
        return f"a {'list' if origin is list else 'mapping'} of " + " to ".join(describe_type(a) for a in args)
    named = {bool: "`true` or `false`", int: "an integer", float: "a number", str: "text"}
    return named.get(hint, str(hint).replace("typing.", ""))


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell (no column break, no emphasis, no HTML)."""
    return text.replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;")


def _rows(cls: type, prefix: str) -> list[str]:
    hints = typing.get_type_hints(cls, include_extras=True)
    comments = field_comments(cls)
    rows = ["| key | accepts | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        default = _default(f)
        if dataclasses.is_dataclass(default):
            continue
        value = json.dumps(list(default) if isinstance(default, tuple) else default)
        rows.append(f"| `{prefix}{f.name}` | {_cell(describe_type(hints[f.name]))} | `{value}` | "
                    f"{_cell(comments.get(f.name, ''))} |")
    return rows


def _sections(cls: type) -> list[tuple[str, type, str]]:
    """The dataclass-valued fields of `cls`: (key, class, the comment beside the field)."""
    comments = field_comments(cls)
    return [(f.name, type(_default(f)), comments.get(f.name, "")) for f in dataclasses.fields(cls)
            if dataclasses.is_dataclass(_default(f))]


def render(root: type = TrainConfig) -> str:
    """The whole reference page for the config class `root`."""
    out = [INTRO, "## Top-level keys", "", *_rows(root, ""), ""]
    for name, cls, comment in _sections(root):
        out += [f"## `{name}`", ""]
        about = " ".join(filter(None, [inspect.cleandoc(cls.__doc__ or "") if _own_doc(cls) else "", comment]))
        if about:
            out += [textwrap.fill(about, 100), ""]
        out += [*_rows(cls, f"{name}."), ""]
    return "\n".join(out)


def _own_doc(cls: type) -> bool:
    """False for the signature docstring dataclasses() writes when a class has none."""
    return bool(cls.__doc__) and not cls.__doc__.startswith(f"{cls.__name__}(")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--output", type=Path, default=REFERENCE, help=f"default {REFERENCE}")
    args = parser.parse_args(argv)
    from toolkit.atomic import write_file

    write_file(args.output, render())
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
