"""The algorithm library: one file per variant, a strict registry.

    import algorithms
    alg = algorithms.get("gspo")
    loss, metrics = alg.loss(logp, old_logp, alg.advantages(rewards, group_size), mask)

Every module of this package that does not start with "_" and is not one of the library's own modules is imported
here, so a new variant is one new file that calls `register`: nothing else changes.
"""

import importlib
import pkgutil

from algorithms.common import LOSS_METRICS, group_centered_advantages, group_normalized_advantages
from algorithms.corrections import with_icepop, with_mis, with_tis
from algorithms.registry import (
    ROUTING_MODES,
    Algorithm,
    Range,
    UnknownAlgorithmError,
    get,
    names,
    register,
    replay_partner,
    routing_variants,
    unregister,
)

_LIBRARY = {"common", "corrections", "registry"}


def _discover() -> None:
    # Sorted, so that registration order (and with it legend colours) is the same on every machine.
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_") and info.name not in _LIBRARY:
            importlib.import_module(f"{__name__}.{info.name}")


_discover()

__all__ = [
    "LOSS_METRICS",
    "ROUTING_MODES",
    "Algorithm",
    "Range",
    "UnknownAlgorithmError",
    "get",
    "group_centered_advantages",
    "group_normalized_advantages",
    "names",
    "register",
    "replay_partner",
    "routing_variants",
    "unregister",
    "with_icepop",
    "with_mis",
    "with_tis",
]
