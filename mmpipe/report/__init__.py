"""Profiling reports: the self-contained HTML dashboard of ``mmpipe report``, and what training records for it."""

from mmpipe.report.html import write_report

__all__ = ["write_report"]
