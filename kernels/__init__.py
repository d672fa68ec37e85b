"""Triton kernels behind ``torch.library`` custom ops, each with a PyTorch reference. Installed as ``mmpipe.kernels``.

This folder sits at the repository root (``pyproject.toml`` maps it to ``mmpipe.kernels``), so with the
root on ``sys.path`` (``python -m pytest`` or ``python -m ...`` run there) ``import kernels`` finds it
ahead of Hugging Face's ``kernels`` package, which transformers >= 5.25 installs and diffusers then
imports (``from kernels import ...``). Imported under that top-level name, this module puts the real
package in its place where one is installed (``import`` returns what ``sys.modules`` holds once the
module has run); where none is, it stays what it was (transformers then finds no version and treats
the name as unavailable).
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None and _spec.loader is not None:
        _real = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _real
        _spec.loader.exec_module(_real)
