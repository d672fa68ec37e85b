"""Stage adapters around unmodified diffusers / transformers modules (installed as ``mmpipe.stages``).

Each adapter declares its ports and capabilities and maps input ports to output ports; none copies
a model's source. Modules come from a local ``from_pretrained`` directory or an existing object.
"""

from mmpipe.stages.dit import (
    CogVideoXDiTStage,
    HunyuanVideoDiTFlowMatchingStage,
    LTXDiTFlowMatchingStage,
    WanDiTFlowMatchingStage,
    WanI2VDiTFlowMatchingStage,
    WanTI2VDiTFlowMatchingStage,
)
from mmpipe.stages.multimodal import CLIPImageEncoderStage
from mmpipe.stages.sampler import DenoiseStage
from mmpipe.stages.text import (
    CausalLMTextEncoderStage,
    CogVideoXT5TextEncoderStage,
    HunyuanTextEncoderStage,
    LTXT5TextEncoderStage,
    T5TextEncoderStage,
    TextEncoderStage,
)
from mmpipe.stages.vae import (
    CogVideoXVAEEncodeStage,
    HunyuanVAEEncodeStage,
    LTXVAEEncodeStage,
    WanI2VVAEEncodeStage,
    WanVAEDecodeStage,
    WanVAEEncodeStage,
)

__all__ = [
    "CLIPImageEncoderStage",
    "CausalLMTextEncoderStage",
    "CogVideoXDiTStage",
    "CogVideoXT5TextEncoderStage",
    "CogVideoXVAEEncodeStage",
    "DenoiseStage",
    "HunyuanVAEEncodeStage",
    "HunyuanTextEncoderStage",
    "HunyuanVideoDiTFlowMatchingStage",
    "LTXDiTFlowMatchingStage",
    "LTXT5TextEncoderStage",
    "LTXVAEEncodeStage",
    "T5TextEncoderStage",
    "TextEncoderStage",
    "WanDiTFlowMatchingStage",
    "WanI2VDiTFlowMatchingStage",
    "WanTI2VDiTFlowMatchingStage",
    "WanI2VVAEEncodeStage",
    "WanVAEDecodeStage",
    "WanVAEEncodeStage",
]
