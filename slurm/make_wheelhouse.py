"""Build a wheelhouse for an offline node: what the project needs that the node's environment lacks.

    python slurm/make_wheelhouse.py OUT [--site FILE] [--python-version 3.12] [--platform TAG ...]

Run it where pip reaches a package index, with torch installed (DeepSpeed's build imports it).
OUT receives:
  * this project's wheel;
  * DeepSpeed built with DS_BUILD_OPS=0: a pure-Python wheel whose ops are JIT-built on first use
    where nvcc exists (DeepSpeed publishes only an sdist, which an offline node could not build);
  * every other requirement, transitively, for the target Python and platform, that the site
    (`--site`: a `pip freeze` of the target environment; default slurm/gpu-image-site.txt, the GPU
    image we test on) does not already have: megatron-core, wandb, pydantic, blake3 and their small
    dependencies, at the versions CI pins (constraints.txt). Nothing the site has is fetched, nor
    what only it requires: no torch, no CUDA libraries.
Then on the node (docs/install.md):
    pip install --no-index --find-links OUT --no-build-isolation -e .     # from a checkout, or
    pip install --no-index --find-links OUT megatron-ds-toolkit
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPU_IMAGE_SITE = Path(__file__).with_name("gpu-image-site.txt")
# Every manylinux tag a glibc 2.39 x86-64 node runs (the GPU image is Ubuntu 24.04): pip matches each exactly.
PLATFORMS = tuple(f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)) + ("manylinux2014_x86_64", "manylinux2010_x86_64",
                                                                           "manylinux1_x86_64")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_site(path: Path) -> dict[str, str | None]:
    """name -> version (None where the file names the package without a version: `name @ URL`, a
    package installed from a file or URL, is there too) from `pip freeze` lines; comments and
    editable lines are skipped."""
    site: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        if " @ " in line:
            site[canonical(line.split(" @ ", 1)[0].strip())] = None
            continue
        line = line.split("#")[0].strip()
        if not line or line.startswith("-"):
            continue
        name, _, version = line.partition("==")
        site[canonical(name)] = version.split("+")[0] or None
    return site


def pinned_version(name: str) -> str:
    """The exact version pyproject.toml pins `name` to."""
    text = (REPO / "pyproject.toml").read_text()
    found = re.search(rf'"{re.escape(name)}==([^"]+)"', text)
    if not found:
        raise SystemExit(f"make_wheelhouse: pyproject.toml pins no exact {name}; name the version to build")
    return found.group(1)


def pip(*args: str, env: dict | None = None) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, env={**os.environ, **(env or {})})


def build_local_wheels(out: Path, site: dict) -> Path:
    """This project's wheel, and DeepSpeed's pure-Python wheel unless the site has DeepSpeed."""
    with tempfile.TemporaryDirectory() as tmp:  # a copy: setuptools leaves build/ and egg-info where it builds
        source = Path(tmp) / "src"
        shutil.copytree(REPO / "toolkit", source / "toolkit", ignore=shutil.ignore_patterns("__pycache__"))
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(REPO / name, source / name)
        pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source))
    if "deepspeed" not in site and not list(out.glob("deepspeed-*.whl")):
        pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), f"deepspeed=={pinned_version('deepspeed')}",
            env={"DS_BUILD_OPS": "0"})
    return next(out.glob("megatron_ds_toolkit-*.whl"))


def target_environment(python_version: str) -> dict:
    """The marker environment of a CPython `python_version` on Linux x86-64."""
    return {"python_version": python_version, "python_full_version": f"{python_version}.0",
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix"}


def requirements(wheel: Path, extras: frozenset = frozenset(), environment: dict | None = None) -> list:
    """A wheel's requirements (its METADATA's Requires-Dist) that apply on the target with `extras`."""
    import zipfile

    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    applying = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is None or any(req.marker.evaluate({**(environment or {}), "extra": extra})
                                     for extra in (extras or {""})):
            applying.append(req)
    return applying


def wheel_named(out: Path, name: str) -> Path | None:
    from packaging.utils import parse_wheel_filename

    return next((w for w in out.glob("*.whl") if canonical(parse_wheel_filename(w.name)[0]) == name), None)


def download_closure(project_wheel: Path, out: Path, site: dict, pins: dict, python_version: str,
                     platforms: list[str]) -> None:
    """Every requirement, transitively, that the site lacks, one wheel each for the target Python and
    platform: the version CI is pinned to (constraints.txt) where it pins one, else the newest that
    matches. A package the site has is never fetched, nor are its own requirements (so neither torch
    nor its CUDA libraries are downloaded), which is why this walks the graph itself instead of
    asking pip to resolve the closure."""
    environment = target_environment(python_version)
    platform_args = [arg for p in platforms for arg in ("--platform", p)]
    level, seen = requirements(project_wheel, environment=environment), {"megatron-ds-toolkit"}
    while level:
        wanted = {}
        for req in level:
            name = canonical(req.name)
            if name in site:
                if site[name] and not req.specifier.contains(site[name], prereleases=True):
                    print(f"make_wheelhouse: the site's {name} {site[name]} does not satisfy {req}; pip will refuse it")
                continue
            if name not in seen:
                seen.add(name)
                wanted[name] = (req, f"{name}=={pins[name]}" if name in pins else f"{name}{req.specifier}")
        fetch = [spec for name, (_, spec) in wanted.items() if wheel_named(out, name) is None]
        if fetch:
            pip("download", "--no-deps", "--quiet", "--only-binary=:all:", "--python-version", python_version,
                "--implementation", "cp", *platform_args, "-d", str(out), *fetch)
        level = [sub for name, (req, _) in wanted.items()
                 for sub in requirements(wheel_named(out, name), frozenset(req.extras), environment)]


def read_pins(path: Path) -> dict[str, str]:
    return {n: v for n, v in read_site(path).items() if v} if path.is_file() else {}


def make_wheelhouse(out: Path, site: dict, python_version: str, platforms: list[str]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    project_wheel = build_local_wheels(out, site)
    download_closure(project_wheel, out, site, read_pins(REPO / "constraints.txt"), python_version, platforms)
    return sorted(out.glob("*.whl"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the wheelhouse folder (created; existing wheels are kept)")
    parser.add_argument("--site", type=Path, default=GPU_IMAGE_SITE,
                        help="`pip freeze` of the target environment (default: the GPU image's, slurm/gpu-image-site.txt)")
    parser.add_argument("--python-version", default="3.12", help="the target's Python, e.g. 3.12")
    parser.add_argument("--platform", action="append", help=f"wheel platform tags to accept (default: {' '.join(PLATFORMS)})")
    args = parser.parse_args()
    if not args.site.is_file():
        parser.error(f"--site {args.site}: no such file (run `python -m pip freeze > site.txt` on the target)")
    wheels = make_wheelhouse(args.out, read_site(args.site), args.python_version, args.platform or list(PLATFORMS))
    size = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB in {args.out}:")
    for wheel in wheels:
        print(f"  {wheel.stat().st_size / 2**20:6.2f} MiB  {wheel.name}")


if __name__ == "__main__":
    main()
