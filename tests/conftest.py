"""Shared fixtures: tiny random-weight pipelines saved with ``save_pretrained`` (nothing downloaded)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

# The kernel tests run Triton's interpreter on CPU tensors on every machine: `import mmpipe` turns it
# on only where there is no GPU, and on a GPU machine those tests would otherwise refuse their CPU
# tensors. Set before the first `import triton`; an explicit TRITON_INTERPRET (gpu_checks.sh: 0) wins.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Kernel outputs start NaN-filled in every test, compiled ones too (off in users' runs, where the
# fill would cost a full write of each output): an element a kernel fails to write fails the test.
os.environ.setdefault("MMPIPE_KERNEL_POISON", "1")
# `pytest -n N` (pytest-xdist, the README's test command): the N workers share the machine's cores, so
# each one's torch, and every process a test starts (OMP_NUM_THREADS), takes its share of them; N
# workers with all cores each would oversubscribe the machine and spin in OpenMP barriers.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import pytest

from mmpipe.config import ModelConfig
from mmpipe.data import caption_vocabulary
from mmpipe.models.wan import save_tiny_wan_pipeline

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # this worker's share of the cores (see above)
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _process_state() -> dict[str, object]:
    """What one test must leave as it found it: tests pass alone, in any order, shuffled."""
    import torch

    return {
        "torch threads": torch.get_num_threads(),
        # pytest's own variable, and what Inductor's compiled code keeps there for itself
        "environment": {
            k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST" and not k.startswith("_TORCHINDUCTOR")
        },
        "default dtype": torch.get_default_dtype(),
        "grad mode": torch.is_grad_enabled(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
    }


def _restore(state: dict[str, object]) -> None:
    import torch

    torch.set_num_threads(state["torch threads"])  # type: ignore[arg-type]
    current = os.environ.get("PYTEST_CURRENT_TEST")
    os.environ.clear()
    os.environ.update(state["environment"])  # type: ignore[arg-type]
    if current is not None:
        os.environ["PYTEST_CURRENT_TEST"] = current
    torch.set_default_dtype(state["default dtype"])  # type: ignore[arg-type]
    torch.set_grad_enabled(state["grad mode"])  # type: ignore[arg-type]
    torch.use_deterministic_algorithms(state["deterministic algorithms"])  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _process_state_is_restored() -> Iterator[None]:
    """Fail a test that changes process-wide state (threads, environment, torch
    modes) without restoring it, and restore it so that the next test starts clean."""
    before = _process_state()
    yield
    after = _process_state()
    if after != before:
        _restore(before)
        changed = {k: _changed(before[k], after[k]) for k in before if before[k] != after[k]}
        pytest.fail(f"the test left process-wide state changed: {changed}")


def _changed(old: object, new: object) -> object:
    if isinstance(old, dict) and isinstance(new, dict):
        return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}
    return (old, new)


@pytest.fixture(scope="session")
def tiny_wan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny WanPipeline directory (UMT5 text encoder) in the standard diffusers layout."""
    path = tmp_path_factory.mktemp("tiny_wan")
    texts = [*caption_vocabulary(), "blurry static"]
    return save_tiny_wan_pipeline(ModelConfig(), texts, path, seed=0)
