"""A non-editable install ships every module of the source tree.

The package list in pyproject.toml is explicit (stages/, sched/, memory/, kernels/, configs/ install
inside the ``mmpipe`` namespace), so a new subpackage left off it works from a checkout's editable
install and is missing from a wheel: ``mmpipe.runtime`` once was, and every stage import failed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _source_modules() -> set[str]:
    """``mmpipe/.../x.py`` paths, as installed, of every module under the mapped source folders."""
    mapping = _setuptools()["package-dir"]
    out = set()
    for package, folder in mapping.items():
        base = ROOT / folder
        nested = [ROOT / f for p, f in mapping.items() if p != package and p.startswith(package + ".")]
        for path in base.rglob("*.py"):
            if "__pycache__" in path.parts or any(path.is_relative_to(n) for n in nested):
                continue
            out.add(str(Path(*package.split(".")) / path.relative_to(base)))
    return out


def test_every_source_folder_with_modules_is_a_listed_package() -> None:
    listed = set(_setuptools()["packages"])
    folders = {str(Path(m).parent).replace("/", ".") for m in _source_modules()}
    assert folders - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    for package in listed:  # a listed package without __init__.py would install as a namespace fragment
        assert any(m == str(Path(*package.split(".")) / "__init__.py") for m in _source_modules()), package


def test_a_real_install_holds_every_module(tmp_path: Path) -> None:
    # From a copy without build/: setuptools copies into build/lib and never empties it, so a checkout's
    # stale build/lib would supply a module the package list leaves out (as a fresh clone's would not).
    src = tmp_path / "src"
    skip = shutil.ignore_patterns(
        ".git", ".venv", "build", "runs", "__pycache__", "*.egg-info", ".*_cache", ".whl", "gpu-out"
    )
    shutil.copytree(ROOT, src, ignore=skip)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-compile"]
    done = subprocess.run([*cmd, "--target", str(tmp_path / "site"), str(src)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"pip install failed:\n{done.stderr[-3000:]}")
    site = tmp_path / "site"
    installed = {str(p.relative_to(site)) for p in (site / "mmpipe").rglob("*.py")}
    assert _source_modules() - installed == set()
    assert (site / "mmpipe" / "configs" / "train.yaml").is_file()
    # and every module imports from the install alone (-P, elsewhere: no checkout on sys.path)
    walk = (
        f"import importlib, pkgutil, mmpipe; assert mmpipe.__file__.startswith({str(site)!r}), mmpipe.__file__; "
        "[importlib.import_module(m.name) for m in pkgutil.walk_packages(mmpipe.__path__, 'mmpipe.')]"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-P", "-c", walk], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def _from_the_root(code: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -c code`` run in the repository root, which ``-c`` puts first on sys.path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)  # after the root, ahead of site-packages
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_root_kernels_folder_hands_over_to_an_installed_kernels_package(tmp_path: Path) -> None:
    """With the repository root on sys.path (``python -m pytest`` there), ``import kernels`` gives the
    installed package of that name (Hugging Face's, which transformers >= 5.25 requires and diffusers
    imports names from), not this repository's kernels/ folder."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("CUDAProperties = 'installed'\n")
    code = "import mmpipe.kernels.registry, kernels, mmpipe.kernels.attention; print(kernels.CUDAProperties)"
    res = _from_the_root(code, tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "installed"


def test_diffusers_and_transformers_import_from_the_root() -> None:
    """Whether or not Hugging Face's kernels package is installed here (a fresh install has it)."""
    res = _from_the_root("import transformers.modeling_utils\nfrom diffusers import AutoencoderKLWan, WanPipeline")
    assert res.returncode == 0, res.stderr


UNPINNED = {"torch", "triton", "xformers"}  # pinned by the Makefile, by torch's CUDA build, by the dev extra


def _pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"constraints.txt: {line!r} is not an exact pin"
        name = canonicalize_name(req.name)
        assert name not in pins, f"constraints.txt pins {name} twice"
        pins[name] = Version(specs[0].version)
    return pins


def test_constraints_pin_every_dependency_inside_its_range() -> None:
    """``make`` installs constraints.txt's versions: a pin outside pyproject.toml's range makes pip fail
    to resolve, and a dependency without one floats to whatever release is newest on the day CI runs."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins()
    assert UNPINNED & pins.keys() == set(), "constraints.txt must leave these to the Makefile and pyproject"
    for text in [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name in UNPINNED:
            continue
        assert name in pins, f"{name} has no pin in constraints.txt: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt: {name}=={pins[name]} not in {text!r}"
        )


def test_make_installs_under_the_constraints(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    dry = subprocess.run(
        ["make", "-n", "-B", f"VENV={venv}", "setup"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert dry.returncode == 0, dry.stderr
    installs = [line for line in dry.stdout.splitlines() if f"{venv}/bin/pip install" in line]
    assert len(installs) == 2 and all("-c constraints.txt" in line for line in installs), dry.stdout


def test_the_gpu_checks_carry_the_pinned_versions() -> None:
    """benchmarks/gpu_checks.sh's header lists the wheels to download for the device machine, which
    reaches no registry; after a `make lock` they must move with the pins."""
    script = (ROOT / "benchmarks" / "gpu_checks.sh").read_text()
    header = script[: script.index("\nset -")]  # the comment block before the script's first command
    named = {canonicalize_name(n): Version(v) for n, v in re.findall(r"([A-Za-z0-9_.-]+)==([0-9][^\s\\]*)", header)}
    pins = _pins()
    assert {"diffusers", "omegaconf", "antlr4-python3-runtime"} <= named.keys(), header
    for name, version in named.items():
        if name in pins:
            assert version == pins[name], (
                f"gpu_checks.sh downloads {name}=={version}, constraints.txt pins {pins[name]}"
            )
