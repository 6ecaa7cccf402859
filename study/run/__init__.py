"""What a run is, where it lives and what it logs: the run config (config.py), the run directory (rundir.py), the
metric vocabulary (metrics.py), whether it fits a machine's memory (plan.py, the planner's arithmetic)."""
