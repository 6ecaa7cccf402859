"""GSPO + Routing Replay: the GSPO half of the paper's 2x2 ablation (does GSPO need Routing Replay? Claim C4).

Differences from gspo:
1. routing "replay", as in grpo_rr. The loss is gspo's, unchanged.
"""

from algorithms.gspo import gspo_loss
from algorithms.registry import register

register("gspo_rr", label="GSPO + Routing Replay", color="#CC79A7", routing="replay")(gspo_loss)
