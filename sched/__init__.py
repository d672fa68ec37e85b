"""Cluster specs, cost model, placement planner, schedule generators, plan IR and simulator.

Installed as ``mmpipe.sched`` (never as top-level ``sched``, a standard-library module).
"""
