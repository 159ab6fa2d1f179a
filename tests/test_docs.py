"""The documentation: the site builds without a warning, the recipe-key reference is the config
classes' own, and the README stays a short user guide whose set-up commands, links and model
table match the repository."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.convert.wrapper import WRAPPERS
from toolkit.families import FAMILIES, REFUSED
from toolkit.train import config_reference
from toolkit.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_recipe_key_reference_matches_the_config_classes():
    committed = config_reference.REFERENCE.read_text() if config_reference.REFERENCE.is_file() else ""
    assert committed == config_reference.render(), (
        f"{config_reference.REFERENCE.relative_to(ROOT)} is out of date with toolkit/train/config.py: "
        f"regenerate it with `{config_reference.REGENERATE}` and commit the result")


def _leaf_keys(obj, prefix=""):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaf_keys(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_recipe_key_reference_lists_every_key_the_loader_accepts():
    """Walked from a config instance, independently of the renderer's walk over the classes."""
    rows = {m.group(1) for m in re.finditer(r"^\| `([a-z0-9_.]+)` \|", config_reference.render(), re.M)}
    assert rows == set(_leaf_keys(TrainConfig()))


def test_docs_site_builds_strict(tmp_path):
    """`mkdocs build --strict`: a broken link or anchor, or a page missing from the nav, fails.
    (Not --quiet: it silences the warnings before strict mode counts them, and the build passes.)"""
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                             "--site-dir", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "reference" / "recipe_keys" / "index.html").is_file()


def test_readme_is_a_short_user_guide_with_the_ci_command():
    text = README.read_text()
    assert len(text.splitlines()) < 250
    assert "```bash\nbash .ci/run\n```" in text, "the README's test command must be what CI runs: .ci/run"
    assert "```bash\npython3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/toolkit quickstart\n```" in text


def test_readme_links_point_at_files_that_exist():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    relative = [link for link in links if "://" not in link]
    assert relative and not [link for link in relative if not (ROOT / link).exists()]


@pytest.mark.parametrize("page", [README, ROOT / "docs" / "guide" / "models.md"], ids=["README", "models-page"])
def test_model_tables_name_every_family_and_refused_type(page):
    """The README's short table and the supported-models page's full one (what each maps and refuses)."""
    text = page.read_text()
    section = text.split("## Supported models", 1)[1].split("\n## ", 1)[0] if page == README else text
    table = section.split("|---", 1)[1]  # the rows, below the header
    # a row's first cell names one model_type or several (`a`, `b`)
    first_cells = {t for cell in re.findall(r"^\| (`[^|]+`) \|", table, re.M) for t in re.findall(r"`([a-z0-9_]+)`", cell)}
    assert first_cells == {t for f in FAMILIES for t in f.model_types} | {w.model_type for w in WRAPPERS}
    for model_type in REFUSED:
        assert f"`{model_type}`" in table
