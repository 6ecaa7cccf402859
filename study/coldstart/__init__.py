"""A run's first weights: the SFT cold start (sft.py), its store and lock (store.py), a local HF checkpoint
(hf_import.py)."""

from study.coldstart.sft import (
    PRESET_DEFAULTS,
    STATUSES,
    Check,
    ColdStartSettings,
    read_policy_file,
    resolve_settings,
    train_coldstart,
)
from study.coldstart.store import ColdStartError, coldstart_main, ensure_coldstart, is_complete, read_record

__all__ = [
    "PRESET_DEFAULTS",
    "STATUSES",
    "Check",
    "ColdStartError",
    "ColdStartSettings",
    "coldstart_main",
    "ensure_coldstart",
    "is_complete",
    "read_policy_file",
    "read_record",
    "resolve_settings",
    "train_coldstart",
]
