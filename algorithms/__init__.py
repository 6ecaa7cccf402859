"""The algorithm library: one file per variant, a strict registry.

    import algorithms
    alg = algorithms.get("gspo")
    loss, metrics = alg.loss(logp, old_logp, alg.advantages(rewards, group_size), mask)

Every module of this package that does not start with "_" and is not one of the library's own modules is a variant:
the first `get` or `names` imports them all, so a new variant is one new file that calls `register`: nothing else
changes. Importing the package imports no variant (and no torch); what planning reads of the variants without
importing them is `algorithms.catalog`.
"""

from algorithms.common import LOSS_METRICS, group_centered_advantages, group_normalized_advantages
from algorithms.corrections import with_icepop, with_mis, with_tis
from algorithms.registry import (
    RATIO_LEVELS,
    ROUTING_MODES,
    Algorithm,
    Range,
    Spec,
    UnknownAlgorithmError,
    get,
    names,
    ratio_level,
    register,
    replay_partner,
    routing_variants,
    unregister,
)

__all__ = [
    "LOSS_METRICS",
    "RATIO_LEVELS",
    "ROUTING_MODES",
    "Algorithm",
    "Range",
    "Spec",
    "UnknownAlgorithmError",
    "get",
    "group_centered_advantages",
    "group_normalized_advantages",
    "names",
    "ratio_level",
    "register",
    "replay_partner",
    "routing_variants",
    "unregister",
    "with_icepop",
    "with_mis",
    "with_tis",
]
