"""Shared libraries every room uses, importing no subpackage of study/: the policy's shape and presets
(model_config), precision as a study axis (precision), the weight mapping where policy and rollout meet (weights), the
one bounded reader of YAML and JSON (bounded), the atomic file write (files), the entry points' re-execution
with malloc's huge-page tunables (hugepages)."""
