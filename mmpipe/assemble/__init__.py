"""Config -> Graph -> Plan: the one place that assembles a run.

:mod:`~mmpipe.assemble.graphs` builds the training graph a config names, :mod:`~mmpipe.assemble.placement`
resolves its placement, sequence parallelism and memory policies into the training and validation
plans, and :mod:`~mmpipe.assemble.planning` runs the planner on it. Training workers,
``placement=auto``, ``mmpipe plan``, ``mmpipe serve`` and the report use it; none imports a driver.
"""
