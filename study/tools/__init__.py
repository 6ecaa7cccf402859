"""One-shot tools, each a `python -m study.tools.NAME` command: plan (the memory and layout planner's table; its
arithmetic is the library study/run/plan.py), gpu_check (the prepared GPU check), export (a run's policy as an HF
checkpoint), parity (cross-engine precision parity), budgets (the cold start's pass@1 per generation budget),
metric_docs (the docs' metric tables from the vocabulary's table)."""
