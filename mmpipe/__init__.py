"""mmpipe: train and serve long multimodal model pipelines as one DAG of model stages.

Public names are imported lazily (PEP 562), so ``mmpipe --help`` and config errors answer before
torch, diffusers and transformers are imported.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Without an NVIDIA GPU, mmpipe's Triton kernels (model.kernels.*=triton) run in Triton's CPU
# interpreter. The switch must precede the first `import triton` (diffusers imports it), so it is
# set here, before anything else is imported; an explicit TRITON_INTERPRET wins.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # xFormers (the optional CUDA attention backend; diffusers imports it where installed) warns on
    # every import that its CUDA extensions cannot load, which on a machine without a GPU says nothing
    logging.getLogger("xformers").setLevel(logging.ERROR)

_EXPORTS = {
    "Capabilities": "mmpipe.graph",
    "Edge": "mmpipe.graph",
    "Graph": "mmpipe.graph",
    "Stage": "mmpipe.graph",
    "TensorSpec": "mmpipe.graph",
    "PipelineGraph": "mmpipe.models.pipeline_graph",
    "T2VGraph": "mmpipe.models.wan",
    "from_diffusers": "mmpipe.models.loading",
    "plan": "mmpipe.assemble.planning",
    "train": "mmpipe.train",
}
__all__ = [
    "Capabilities",
    "Edge",
    "Graph",
    "PipelineGraph",
    "Stage",
    "T2VGraph",
    "TensorSpec",
    "from_diffusers",
    "plan",
    "train",
]

if TYPE_CHECKING:
    from mmpipe.assemble.planning import plan
    from mmpipe.graph import Capabilities, Edge, Graph, Stage, TensorSpec
    from mmpipe.models.loading import from_diffusers
    from mmpipe.models.pipeline_graph import PipelineGraph
    from mmpipe.models.wan import T2VGraph
    from mmpipe.train import train


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mmpipe' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
