"""GRPO + token-level TIS: the registered example of a mismatch correction composed with a loss.

Differences from grpo:
1. each token's term is multiplied by min(rho_t, 2), rho_t = pi_train_old / pi_rollout (algorithms.corrections),
   which corrects for sampling from the inference engine rather than from the training engine's pi_old.
"""

from algorithms.corrections import with_tis
from algorithms.grpo import grpo_loss
from algorithms.registry import register

register("grpo_tis", label="GRPO + TIS", color="#777777")(with_tis(grpo_loss))
