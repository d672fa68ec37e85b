"""Activation offload tiers, checkpoint policies and the memory estimator. Installed as ``mmpipe.memory``."""
