"""The offline install (docs/install.md): a wheelhouse made by slurm/make_wheelhouse.py, installed
with `pip install --no-index` into an environment that already has torch, leaves that torch alone.

The target here is a fresh virtual environment that sees this environment's packages (torch,
megatron-core, DeepSpeed...) as a site would provide them, through a folder of links to them that
leaves out this project itself; the wheelhouse then holds only the project's wheel, and nothing can
come from an index. What a real site lacks (DeepSpeed's pure-Python wheel, megatron-core, wandb,
pydantic) is fetched by the same script on a machine with internet: docs/install.md gives the
command and the size measured for the GPU image.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "slurm"))
from make_wheelhouse import make_wheelhouse, read_site  # noqa: E402

OURS = ("megatron_ds_toolkit", "__editable__", "_megatron_ds_toolkit")


def site_without_us(tmp: Path) -> Path:
    """Links to everything installed here except this project (and .pth files, which a plain path
    entry does not run anyway)."""
    here = Path(sysconfig.get_paths()["purelib"])
    linked = tmp / "site"
    linked.mkdir()
    for entry in here.iterdir():
        if not entry.name.startswith(OURS) and entry.suffix != ".pth":
            (linked / entry.name).symlink_to(entry)
    return linked


def test_wheelhouse_installs_with_no_index_and_leaves_the_sites_torch(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the worktree must not shadow the install
    site = site_without_us(tmp_path)
    freeze = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True, check=True, env=env)
    (tmp_path / "site.txt").write_text(freeze.stdout)
    wheels = make_wheelhouse(tmp_path / "wheelhouse", read_site(tmp_path / "site.txt"),
                             f"{sys.version_info.major}.{sys.version_info.minor}", [])
    assert [w.name.split("-")[0] for w in wheels] == ["megatron_ds_toolkit"], wheels

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "site.pth").write_text(f"{site}\n")
    before = sorted(p.name for p in site.iterdir())

    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
                              "--find-links", str(tmp_path / "wheelhouse"), "megatron-ds-toolkit"],
                             capture_output=True, text=True, env=env)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]

    probe = ("import json, os, torch, toolkit.cli; "
             "print(json.dumps([torch.__version__, os.path.realpath(torch.__file__), toolkit.cli.__file__]))")
    seen = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert seen.returncode == 0, seen.stderr[-3000:]
    version, torch_file, cli_file = json.loads(seen.stdout)
    assert (version, torch_file) == (torch.__version__, os.path.realpath(torch.__file__)), "the site's torch must stay"
    assert cli_file.startswith(purelib), f"the CLI must come from the installed wheel, not {cli_file}"
    assert sorted(p.name for p in site.iterdir()) == before, "nothing in the site may change"
    help_text = subprocess.run([venv / "bin" / "toolkit", "--help"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert help_text.returncode == 0 and "quickstart" in help_text.stdout, help_text.stderr[-2000:]


def test_the_gpu_images_packages_and_cis_pins_fall_in_the_declared_ranges():
    """pip keeps a site's torch only if it satisfies our range: the GPU image's versions
    (slurm/gpu-image-site.txt) and CI's locks (constraints.txt and each lane's in .ci/) must all fall in pyproject's ranges."""
    import tomllib

    from packaging.requirements import Requirement

    declared = {Requirement(r).name: Requirement(r).specifier
                for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    image = read_site(REPO / "slurm" / "gpu-image-site.txt")
    for name in ("torch", "transformers", "accelerate", "safetensors"):
        assert declared[name].contains(image[name]), f"the GPU image's {name} {image[name]} is outside {declared[name]}"
    for lock in ("constraints.txt", ".ci/oldest.txt", ".ci/container.txt"):  # .ci/run's lanes
        ci = read_site(REPO / lock)
        outside = {n: (ci[n], str(s)) for n, s in declared.items() if n in ci and not s.contains(ci[n], prereleases=True)}
        assert not outside, (lock, outside)
