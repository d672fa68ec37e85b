"""Triton kernels behind ``torch.library`` custom ops, each with a PyTorch reference. Installed as ``mmpipe.kernels``."""
