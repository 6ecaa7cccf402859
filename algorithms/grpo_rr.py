"""GRPO + Routing Replay (GSPO paper, section 5.3; "R2" in later work).

Differences from grpo:
1. routing "replay": every forward pass of pi_theta on rollout tokens is forced through the experts that the
   training engine's pi_old recompute activated (gate weights still from the current router logits).
The loss is grpo's, unchanged.
"""

from algorithms.grpo import grpo_loss
from algorithms.registry import register

register("grpo_rr", label="GRPO + Routing Replay", color="#0072B2", routing="replay")(grpo_loss)
