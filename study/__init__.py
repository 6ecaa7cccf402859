"""The harness's engine room: an RL run of one algorithm on a Megatron-core MoE policy with an inference engine.

Rooms (each subpackage's `__init__` says its job; tests/test_imports.py keeps the walls):
    run/        what a run is, where it lives and what it logs (config, run directory, metric vocabulary)
    data/       text in, rewards out, no models (tasks, user data, tokenizer)
    policy/     the training engine: Megatron-core MoE policy, fast layers, optimiser, routing record/replay, shims
    rollout/    the rollout engines behind one interface (hf, vllm)
    coldstart/  a run's first weights (SFT cold start, its store and lock, a local HF checkpoint)
    kernels/    optional C kernels over plain tensors (an accelerator the science never depends on)
    core/       shared libraries, importing no other room: model_config.py (the policy's shape, presets, dtypes),
                precision.py (precision as a study axis), weights.py (the weight mapping where policy and rollout meet),
                hugepages.py (the entry points' malloc tunables)
Files are read and written through the run-files contract, the `runfiles` package beside study/ (the bounded reader of
YAML and JSON, the atomic write, the run directory's file names), which sweeps/ and analysis/ import too.
    tools/      one-shot tools, `python -m study.tools.NAME`: plan, gpu_check, export, parity, budgets
The RL loop at the top, importing any room: rl.py (the loop, read top to bottom: setup, then the step) and what it
is made of: parts.py (the run's parts, built once; the trainer's forwards of a batch's rows), batch.py (the step's
samples as teacher-forcing tensors), record.py (the metric rows and their files), checkpoint.py (write, read,
restore), lifecycle.py (preflight, the run directory's lock and manifest, every exit recorded, resume).
Entry points at the top: launch.py (in-process, local or SLURM through submitit), __main__.py (the CLI).
"""
