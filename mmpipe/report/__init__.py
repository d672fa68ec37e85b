"""Profiling reports: the self-contained HTML dashboard of ``mmpipe report``."""
