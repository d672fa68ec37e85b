"""Hydra config source shipped as package data (``mmpipe.configs``)."""
