"""The JSON Schema of a sweep file, built from RunConfig's fields and the registries, so a new algorithm, task or
preset is valid in every sweep without edits here.

A sweep file:

    name: default              # the study's name: results/<name>/
    preset: default            # optional: start every run from study.runconfig.PRESET_RUNS[preset]
    base: {steps: 40, ...}     # RunConfig fields shared by every run
    axes:                      # RunConfig field -> list of values (algorithm also takes `all`)
      algorithm: all
      seed: [0, 1, 2]
    mode: grid                 # grid: the cross product of the axes; zip: the i-th value of every axis together

Errors name the field (as a dotted path: `axes.algorithm[2]`) and the valid values, before any job starts.
Cross-field rules (minibatches divides the batch, ...) are RunConfig.validate's, run on every expanded run.
"""

from __future__ import annotations

import typing
from typing import Any

import jsonschema

import algorithms
from study import tasks
from study.config import DTYPES, PRESETS
from study.runconfig import ENGINES, OLD_LOGP_SOURCES, PRESET_RUNS, RunConfig

MODES = ("grid", "zip")
TOP_LEVEL = ("name", "preset", "base", "axes", "mode", "description")


class SweepError(ValueError):
    """A sweep file that does not validate; the message names the file, the field and the valid values."""


def _enums() -> dict[str, list[str]]:
    return {
        "algorithm": list(algorithms.names()),
        "model": list(PRESETS),
        "task": list(tasks.TASKS),
        "rollout_engine": list(ENGINES),
        "train_dtype": list(DTYPES),
        "rollout_dtype": list(DTYPES),
        "old_logp_source": list(OLD_LOGP_SOURCES),
    }


def field_schema(name: str) -> dict[str, Any]:
    """The JSON Schema of one RunConfig field's value."""
    enums = _enums()
    if name in enums:
        return {"enum": enums[name]}
    hint = typing.get_type_hints(RunConfig)[name]
    origin = typing.get_origin(hint) or hint
    if origin is dict:
        return {"type": "object"}
    if hint is bool:
        return {"type": "boolean"}
    if hint is int:
        return {"type": "integer"}
    if hint is float:  # YAML 1.1 reads 1e-4 as a string; RunConfig coerces it
        return {"type": ["number", "string"]}
    return {"type": "string"}


def sweep_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of a sweep file."""
    fields = RunConfig.field_names()
    base = {
        "type": "object",
        "properties": {name: field_schema(name) for name in fields},
        "additionalProperties": False,
    }
    axes: dict[str, Any] = {}
    for name in fields:
        values = {"type": "array", "items": field_schema(name), "minItems": 1}
        axes[name] = {"oneOf": [{"const": "all"}, values]} if name == "algorithm" else values
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "sweep",
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]+$"},
            "description": {"type": "string"},
            "preset": {"enum": list(PRESET_RUNS)},
            "base": base,
            "axes": {"type": "object", "properties": axes, "additionalProperties": False},
            "mode": {"enum": list(MODES)},
        },
        "additionalProperties": False,
    }


def _path(parts: Any) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _message(error: jsonschema.ValidationError) -> str:
    where = _path(error.absolute_path)
    schema = error.schema if isinstance(error.schema, dict) else {}
    if error.validator == "additionalProperties":
        extra = sorted(set(error.instance) - set(schema.get("properties", {})))
        valid = ", ".join(schema.get("properties", {}))
        return f"{where}: unknown field(s) {extra}; valid: {valid}"
    if error.validator == "enum":
        return f"{where} = {error.instance!r}; valid: {', '.join(map(str, error.validator_value))}"
    if error.validator == "oneOf" and where.startswith("axes.algorithm"):
        return f"{where} = {error.instance!r}; valid: `all` or a list of {', '.join(algorithms.names())}"
    if error.validator == "type":
        return f"{where} = {error.instance!r}: must be {error.validator_value}"
    if error.validator == "minItems":
        return f"{where}: an axis needs at least one value"
    if error.validator == "required":
        return f"{where}: {error.message}"
    return f"{where}: {error.message}"


def _leaves(error: jsonschema.ValidationError) -> list[jsonschema.ValidationError]:
    """For `oneOf` on an axis list, report the offending list item, not the whole alternative."""
    if error.validator == "oneOf" and error.context:
        deepest = [e for e in error.context if e.absolute_path != error.absolute_path]
        if deepest:
            return [e for d in deepest for e in _leaves(d)]
    return [error]


def validate_sweep(data: Any, *, where: str = "sweep") -> None:
    """Raise SweepError listing every schema violation of `data` (a parsed sweep file)."""
    validator = jsonschema.Draft202012Validator(sweep_schema())
    errors = sorted(validator.iter_errors(data), key=lambda e: [str(p) for p in e.absolute_path])
    if errors:
        messages = list(dict.fromkeys(_message(leaf) for error in errors for leaf in _leaves(error)))
        raise SweepError(f"{where}: " + "\n  ".join(messages))
