"""GRPO + Rollout Routing Replay, "R3" (Ma et al. 2025, arXiv 2510.11370).

Differences from grpo_rr:
1. routing "rollout_replay": the experts replayed are those the *inference engine* chose during rollout, in the
   pi_old recompute as well as in every update forward pass, so training and inference route identically.
"""

from algorithms.grpo import grpo_loss
from algorithms.registry import register

register("grpo_r3", label="GRPO + R3", color="#882255", routing="rollout_replay")(grpo_loss)
