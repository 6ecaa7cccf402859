"""The training engine: the Megatron-core MoE policy (model.py), its fast layers (layers.py, experts.py), optimiser
(optim.py), routing record and replay (routing.py), and the CPU shims megatron-core needs (compat.py)."""
