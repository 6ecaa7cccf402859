"""Shared libraries every room uses, importing no subpackage of study/: the policy's shape and presets
(model_config), precision as a study axis (precision), the weight mapping where policy and rollout meet (weights), the
entry points' re-execution with malloc's huge-page tunables (hugepages). The readers and writers of files are the
run-files contract's (the `runfiles` package), shared with sweeps/ and analysis/."""
