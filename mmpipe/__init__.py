"""mmpipe: train and serve long multimodal model pipelines as one DAG of model stages."""

from mmpipe.graph import Capabilities, Edge, Graph, Stage, TensorSpec
from mmpipe.pipelines import T2VGraph, from_diffusers

__all__ = ["Capabilities", "Edge", "Graph", "Stage", "T2VGraph", "TensorSpec", "from_diffusers"]
__version__ = "0.1.0"
