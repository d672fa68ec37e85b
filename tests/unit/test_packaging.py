"""A non-editable install ships every module of the source tree.

The package list in pyproject.toml is explicit (stages/, sched/, memory/, kernels/, configs/ install
inside the ``mmpipe`` namespace), so a new subpackage left off it works from a checkout's editable
install and is missing from a wheel: ``mmpipe.runtime`` once was, and every stage import failed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

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
