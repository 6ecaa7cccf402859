"""The JSON Schema of a sweep file, built from RunConfig's fields and the registries, so a new algorithm, task or
preset is valid in every sweep without edits here.

A sweep file:

    name: default              # the study's name: results/<name>/
    preset: default            # optional: start every run from study.run.config.PRESET_RUNS[preset]
    base: {steps: 40, ...}     # RunConfig fields shared by every run
    per_algorithm:             # optional: RunConfig fields of one algorithm's runs (after base, before axes)
      gspo: {hparams: {eps_low: 3.0e-3, eps_high: 5.0e-3}}
    axes:                      # RunConfig field -> list of values (algorithm also takes `all`)
      algorithm: all
      seed: [0, 1, 2]
      model: [default, {preset: default, num_experts: 32, moe_top_k: 8}]   # shapes: a preset, or one with overrides
      model.num_experts: [8, 32]   # a dotted axis: one key of a mapping field (model, hparams, task_knobs)
    mode: grid                 # grid: the cross product of the axes; zip: the i-th value of every axis together
    exclude:                   # optional, grid only: leave out the combinations matching an entry (axis -> value
      - {algorithm: [grpo_rr], model: [default]}   # or list of values; a combination matches when every key does)
    tuned: results/tune/tune/best.yaml   # optional: tuned lr/hparams per algorithm (python -m sweeps.tune writes it)
    tune: {trials: 4, ...}     # optional: makes this a tuning sweep (sweeps/tune.py documents the section)
    comparisons:               # optional: the confirmatory comparisons, declared before the runs (COMPARISON_FIELDS)
      - {name: replay_gain, role: primary, claim: C3, arms: {axis: algorithm, treatment: grpo_rr, control: grpo}, ...}

A run's `model` is a preset name or a mapping {preset: NAME, FIELD: VALUE, ...} of a preset and overrides of its
shape (study.core.model_config.SHAPE_FIELDS); a mapping without `preset` (and a dotted `model.FIELD` axis) changes
fields of the shape so far (study.run.config.merge_field). A dotted axis applies after the whole-field axes.

Errors name the field (as a dotted path: `axes.algorithm[2]`) and the valid values, before any job starts.
Cross-field rules (minibatches divides the batch, ...) are RunConfig.validate's, run on every expanded run.
The tuned file (what `tuned:` names) has its own schema, `tuned_file_schema()`.
"""

from __future__ import annotations

import math
import re
import typing
from typing import Any

import jsonschema

from algorithms import catalog
from study.core.model_config import FLOAT_FIELDS, PRESETS, SHAPE_FIELDS
from study.core.precision import PRECISIONS
from study.data import tasks
from study.run.config import ENGINES, OLD_LOGP_SOURCES, PRESET_RUNS, REPLACED_FIELDS, RunConfig

MODES = ("grid", "zip")
TOP_LEVEL = (
    "name",
    "preset",
    "base",
    "per_algorithm",
    "axes",
    "mode",
    "exclude",
    "description",
    "tuned",
    "tune",
    "max_runs",
    "comparisons",
)
OBJECTIVES = tuple(f"eval_{split}" for split in tasks.EVAL_SPLITS)  # held-out eval columns of metrics.parquet
PRUNERS = ("median", "percentile", "threshold", "none")
SAMPLERS = ("tpe", "random")
TUNABLE_FIELDS = ("lr", "weight_decay", "grad_clip")  # RunConfig fields a tuning sweep may search (plus hparams)
TUNED_FORMAT = 1


class SweepError(ValueError):
    """A sweep file that does not validate; the message names the file, the field and the valid values."""


MAPPING_FIELDS = tuple(
    name for name, hint in typing.get_type_hints(RunConfig).items() if (typing.get_origin(hint) or hint) is dict
)
"""RunConfig fields holding a mapping of named keys (hparams, task_knobs): an axis may vary one, `hparams.eps_low`."""
_MODEL_MAPPING = "a local HF checkpoint directory (a path with '/'), or a mapping {preset: NAME, FIELD: VALUE, ...}"


def _enums() -> dict[str, list[str]]:
    return {
        "algorithm": list(catalog.names()),
        "task": list(tasks.TASKS),
        "rollout_engine": list(ENGINES),
        "train_precision": list(PRECISIONS),
        "rollout_precision": [*PRECISIONS, "same"],
        "old_logp_source": list(OLD_LOGP_SOURCES),
    }


def shape_field_schema(name: str) -> dict[str, Any]:
    """The JSON Schema of one model shape field's value (ranges across fields are study.core.model_config's)."""
    if name in FLOAT_FIELDS:  # YAML 1.1 reads 1e-6 as a string; model_spec coerces it
        return {"type": ["number", "string"]}
    return {"type": "integer", "minimum": 1}


def model_schema() -> dict[str, Any]:
    """The JSON Schema of a run's `model`: a preset name, or a mapping of a preset and shape overrides."""
    shape = {"preset": {"enum": list(PRESETS)}, **{name: shape_field_schema(name) for name in SHAPE_FIELDS}}
    return {
        "if": {"type": "string"},
        "then": {"anyOf": [{"enum": list(PRESETS)}, {"pattern": "/"}]},  # a preset, or a checkpoint directory
        "else": {"type": "object", "properties": shape, "additionalProperties": False},
    }


def field_schema(name: str) -> dict[str, Any]:
    """The JSON Schema of one RunConfig field's value."""
    if name == "model":
        return model_schema()
    enums = _enums()
    if name in enums:
        return {"enum": enums[name]}
    hint = typing.get_type_hints(RunConfig)[name]
    origin = typing.get_origin(hint) or hint
    if origin is dict:
        return {"type": "object"}
    if origin is list:  # e.g. coldstart_band: [low, high]; RunConfig checks the values
        return {"type": "array"}
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
    for name in SHAPE_FIELDS:  # dotted axes: one field of the model's shape
        axes[f"model.{name}"] = {"type": "array", "items": shape_field_schema(name), "minItems": 1}
    dotted = {rf"^({'|'.join(MAPPING_FIELDS)})\.[A-Za-z_][A-Za-z0-9_]*$": {"type": "array", "minItems": 1}}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "sweep",
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "pattern": NAME_PATTERN, "not": {"enum": list(RESERVED_NAMES)}},
            "description": {"type": "string"},
            "preset": {"enum": list(PRESET_RUNS)},
            "base": base,
            "per_algorithm": {
                "type": "object",
                "propertyNames": {"enum": list(catalog.names())},
                "additionalProperties": base,
            },
            "axes": {"type": "object", "properties": axes, "patternProperties": dotted, "additionalProperties": False},
            "mode": {"enum": list(MODES)},
            "exclude": {
                "type": "array",
                "items": {
                    "type": "object",
                    "minProperties": 1,
                    "additionalProperties": {"type": "array", "minItems": 1},
                },
            },
            "tuned": {"type": "string", "pattern": r"\.ya?ml$"},
            "max_runs": {"type": "integer", "minimum": 1},
            "tune": tune_schema(),
            "comparisons": comparisons_schema(),
            "vars": {
                "type": "object",
                "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                "additionalProperties": {"type": "string"},
            },
        },
        "additionalProperties": False,
    }


_NUMBER = {"type": ["number", "string"]}  # YAML 1.1 reads 1e-4 as a string; sweeps/tune.py coerces and checks it

CLAIMS = ("C1", "C2", "C3", "C4", "C5", "C6")
"""The paper's claims (docs/references.md) a comparison may confirm."""
WINDOWS = ("final_eval", "gain", "last_10pct_compute")
"""What a comparison reads of each run's metric: its last evaluation; its last evaluation minus its step-0 one (the
held-out gain); its mean over the last 10% of compute (analysis.stats.curves.compute_window)."""
PAIRINGS = ("seed", "none")
"""seed: the arms of one seed share prompts, cold start and evaluation sampling, compared within it; none: Welch."""
ALTERNATIVES = ("two-sided", "greater", "less")
"""The direction a comparison tests, treatment minus control."""
TESTS = ("difference", "minimum_effect", "exclude", "equivalence")
"""What a comparison tests about D = treatment - control (analysis.claims.declared reads each): difference, D = 0
rejected (`threshold`: the gap it is sized for, its sign the declared direction); minimum_effect, D beyond
`threshold` shown (at least the declared size); exclude, D as far as `threshold` excluded; equivalence, |D| <
`threshold` shown (TOST, for claims of no effect)."""
ONE_SIDED = ("minimum_effect", "exclude")
"""Tests of a declared size in one direction: `alternative` greater (threshold > 0) or less (threshold < 0)."""
ROLES = ("primary", "secondary")
"""A sweep declares at most one primary comparison: the one its size and power are for."""
COMPARISON_FIELDS = {
    "name": "the comparison's id",
    "role": "primary (at most one per sweep) or secondary",
    "claim": "the paper's claim it confirms (C1..C6)",
    "arms": "{axis, treatment, control}: two values of one axis of the sweep",
    "metric": "a metrics.parquet column (study.run.metrics.STEP_METRICS), e.g. test_in_dist",
    "window": "final_eval, gain or last_10pct_compute",
    "stratum": "{axis: value} of the other swept axes the comparison is read in ({} = the only one)",
    "test": "what it tests (TESTS): difference, minimum_effect, exclude or equivalence",
    "threshold": "treatment - control in the metric's unit: the gap a difference test is sized for; the declared size "
    "of minimum_effect and exclude; the margin of equivalence (> 0)",
    "alternative": "the declared direction: two-sided (default; difference and equivalence), greater (threshold > 0) "
    "or less (threshold < 0)",
    "assumed_gap": "the true treatment - control the sizing assumes (required for minimum_effect, beyond the "
    "threshold; default: the threshold for difference, 0 for exclude and equivalence)",
    "alpha": "the test's level (default 0.05)",
    "seeds": "the seeds (units of replication) each arm runs",
    "power": "the power at `threshold` it was sized for",
    "assumed_sd": "the SD of the paired differences (or of a seed's value, unpaired) the sizing assumed",
    "pairing": "seed or none",
}
"""Every field of a declared comparison, with what it states."""


def comparisons_schema() -> dict[str, Any]:
    """The JSON Schema of a sweep's `comparisons:` block (cross-field rules: `check_comparisons`)."""
    prob = {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}
    entry = {
        "type": "object",
        "required": [
            "name",
            "claim",
            "arms",
            "metric",
            "window",
            "test",
            "threshold",
            "seeds",
            "power",
            "assumed_sd",
            "pairing",
        ],
        "properties": {
            "name": {"type": "string", "pattern": NAME_PATTERN},
            "role": {"enum": list(ROLES)},
            "claim": {"enum": list(CLAIMS)},
            "arms": {
                "type": "object",
                "required": ["axis", "treatment", "control"],
                "properties": {"axis": {"type": "string"}, "treatment": {}, "control": {}},
                "additionalProperties": False,
            },
            "metric": {"type": "string"},
            "window": {"enum": list(WINDOWS)},
            "stratum": {"type": "object"},
            "test": {"enum": list(TESTS)},
            "threshold": {"type": "number", "not": {"const": 0}},
            "assumed_gap": {"type": "number"},
            "alternative": {"enum": list(ALTERNATIVES)},
            "alpha": prob,
            "seeds": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 2, "uniqueItems": True},
            "power": prob,
            "assumed_sd": {"type": "number", "exclusiveMinimum": 0},
            "pairing": {"enum": list(PAIRINGS)},
        },
        "additionalProperties": False,
    }
    return {"type": "array", "items": entry, "minItems": 1}


NUMBERS = ("threshold", "alpha", "power", "assumed_sd", "assumed_gap")
"""The numbers of a declaration, each finite (YAML reads .nan and .inf as numbers)."""


def same_value(a: Any, b: Any) -> bool:
    """Whether two axis values are the same value: numbers equal as numbers (32 is 32.0, true is not 1), anything
    else equal exactly (never a substring: 'al' is not 'all')."""
    number = (int, float)
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, number) and isinstance(b, number):
        return float(a) == float(b)
    return type(a) is type(b) and a == b


def _check_numbers(c: dict[str, Any], at: str) -> None:
    """Finite numbers; the threshold's sign against the declared direction; the test's own rules."""
    for name in NUMBERS:
        if name in c and not math.isfinite(c[name]):
            raise SweepError(f"{at}.{name} = {c[name]!r}: not a finite number; valid: {COMPARISON_FIELDS[name]}")
    test, alt, thr = c["test"], c.get("alternative", "two-sided"), c["threshold"]
    if (alt == "greater" and thr < 0) or (alt == "less" and thr > 0):
        want = "> 0" if alt == "greater" else "< 0"
        raise SweepError(
            f"{at}.threshold = {thr!r} with alternative = {alt!r}: a {alt} gap is {want}; valid: threshold {want}, "
            f"or alternative {'less' if alt == 'greater' else 'greater'}"
        )
    if test in ONE_SIDED and alt == "two-sided":
        raise SweepError(
            f"{at}.alternative = 'two-sided' with test = {test!r}: a declared size has a direction; valid: greater "
            "(threshold > 0) or less (threshold < 0)"
        )
    if test == "equivalence" and (alt != "two-sided" or thr < 0):
        raise SweepError(
            f"{at}: test = 'equivalence' with alternative = {alt!r}, threshold = {thr!r}; valid: alternative "
            "two-sided and threshold > 0 (the margin)"
        )
    gap = c.get("assumed_gap")
    if test == "minimum_effect" and (gap is None or (gap - thr) * (1 if alt == "greater" else -1) <= 0):
        side = "above" if alt == "greater" else "below"
        raise SweepError(
            f"{at}.assumed_gap = {gap!r}: test = 'minimum_effect' is sized at a true gap {side} the threshold; "
            f"valid: a number {side} {thr!r}"
        )


def check_comparisons(data: dict[str, Any], where: str) -> None:
    """The cross-field rules of a sweep's declared comparisons: finite numbers and the threshold's sign against the
    declared direction (`_check_numbers`), arms and stratum name undotted axes of the sweep and values on them
    (`same_value`), the metric is a logged column, the seeds are the sweep's, at most one primary, names unique.
    What the sweep's runs must hold for each comparison is `check_comparison_runs`'s."""
    from study.run.metrics import STEP_METRICS

    axes = data.get("axes") or {}
    base = data.get("base") or {}
    primaries = [c.get("name") for c in data.get("comparisons") or () if c.get("role") == "primary"]
    if len(primaries) > 1:
        raise SweepError(
            f"{where}: comparisons: {len(primaries)} primary comparisons {primaries}; valid: one "
            "(role: secondary for the rest)"
        )
    plain = [a for a in axes if "." not in a]
    seen: set[str] = set()
    for i, c in enumerate(data.get("comparisons") or ()):
        at = f"{where}: comparisons[{i}]"
        if c["name"] in seen:
            raise SweepError(f"{at}.name = {c['name']!r}: declared twice; valid: a name per comparison")
        seen.add(c["name"])
        _check_numbers(c, at)
        arms = c["arms"]
        if arms["axis"] not in plain:
            why = "a dotted axis is no column of the runs' table" if "." in arms["axis"] else "not an axis of the sweep"
            raise SweepError(f"{at}.arms.axis = {arms['axis']!r}: {why}; valid: {', '.join(plain)}")
        values = _axis_values(axes, arms["axis"])
        for side in ("treatment", "control"):
            if not any(same_value(arms[side], v) for v in values):
                raise SweepError(
                    f"{at}.arms.{side} = {arms[side]!r}: not a value of axes.{arms['axis']}; valid: "
                    f"{', '.join(map(str, values))}"
                )
        if same_value(arms["treatment"], arms["control"]):
            raise SweepError(f"{at}.arms: treatment = control = {arms['control']!r}; valid: two different values")
        if c["metric"] not in STEP_METRICS:
            raise SweepError(
                f"{at}.metric = {c['metric']!r}: not a logged metric; valid: a column of "
                "study.run.metrics.STEP_METRICS (eval_in_dist, test_in_dist, reward_mean, ...)"
            )
        if c["metric"] == tasks.TEST_METRIC and not (base.get("eval_test_size") or axes.get("eval_test_size")):
            raise SweepError(
                f"{at}.metric = {tasks.TEST_METRIC!r}: the sweep scores no test split; valid: base.eval_test_size "
                ">= 1, or a validation metric"
            )
        for axis, value in (c.get("stratum") or {}).items():
            if axis in (arms["axis"], "seed") or axis not in plain:
                valid = ", ".join(a for a in plain if a not in (arms["axis"], "seed"))
                dotted = " (a dotted axis is no column of the runs' table)" if "." in axis else ""
                raise SweepError(
                    f"{at}.stratum.{axis}: not another axis of the sweep{dotted}; valid: {valid or 'none'}"
                )
            if not any(same_value(value, v) for v in _axis_values(axes, axis)):
                raise SweepError(
                    f"{at}.stratum.{axis} = {value!r}: not a value of axes.{axis}; valid: "
                    f"{', '.join(map(str, _axis_values(axes, axis)))}"
                )
        swept = axes.get("seed", [base.get("seed", 0)])
        if sorted(c["seeds"]) != sorted(swept):
            raise SweepError(f"{at}.seeds = {c['seeds']}: the sweep runs seeds {swept}; valid: the same seeds")


def _axis_values(axes: dict[str, Any], axis: str) -> list[Any]:
    values = axes[axis]
    return list(catalog.names()) if values == "all" else list(values)


def check_comparison_runs(data: dict[str, Any], runs: list[dict[str, Any]], where: str) -> None:
    """What the sweep's runs (`runs`: each run's resolved fields, after `exclude:`, zip or grid) must hold for each
    declared comparison to be read: in the declared stratum, each arm runs every declared seed once and no other
    seed, and scores the split its metric is on (a test_* metric: eval_test_size >= 1; any held-out metric:
    eval_every >= 1). Checked when the sweep file is read, before any run."""
    defaults = {name: getattr(RunConfig, name) for name in ("seed", "eval_test_size", "eval_every")}

    def get(run: dict[str, Any], name: str) -> Any:
        return run.get(name, defaults.get(name))

    for i, c in enumerate(data.get("comparisons") or ()):
        at = f"{where}: comparisons[{i}]"
        arms, stratum = c["arms"], c.get("stratum") or {}
        inside = [r for r in runs if all(same_value(get(r, a), v) for a, v in stratum.items())]
        for side in ("treatment", "control"):
            mine = [r for r in inside if same_value(get(r, arms["axis"]), arms[side])]
            seeds = sorted(int(get(r, "seed")) for r in mine)
            if sorted(c["seeds"]) != sorted(set(seeds)):
                raise SweepError(
                    f"{at}.arms.{side} = {arms[side]!r}: the sweep runs it with seeds {sorted(set(seeds))} in the "
                    f"stratum {stratum or '{}'} (after exclude, or paired so by mode: zip); valid: both arms run the "
                    f"declared seeds {sorted(c['seeds'])}"
                )
            if len(seeds) != len(set(seeds)):
                varied = sorted(a for a in (data.get("axes") or {}) if a not in (arms["axis"], "seed", *stratum))
                raise SweepError(
                    f"{at}.stratum = {stratum}: arm {arms[side]!r} runs a seed several times in it (axes "
                    f"{', '.join(varied)} vary); valid: a stratum naming one value of each"
                )
            if c["metric"].startswith("test_") and any(get(r, "eval_test_size") < 1 for r in mine):
                raise SweepError(
                    f"{at}.metric = {c['metric']!r}: arm {arms[side]!r} scores no test split (eval_test_size 0); "
                    "valid: eval_test_size >= 1 for every run of both arms, or a validation metric"
                )
            if c["metric"].startswith(("test_", "eval_")) and any(get(r, "eval_every") < 1 for r in mine):
                raise SweepError(
                    f"{at}.metric = {c['metric']!r}: arm {arms[side]!r} never evaluates (eval_every 0); valid: "
                    "eval_every >= 1, or a training metric"
                )


def tune_schema() -> dict[str, Any]:
    """JSON Schema of a sweep's `tune:` section (the meaning of each key: sweeps/tune.py's docstring)."""
    bounds = {
        "type": "object",
        "properties": {"low": _NUMBER, "high": _NUMBER, "log": {"type": "boolean"}},
        "required": ["low", "high"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "required": ["trials"],
        "properties": {
            "trials": {"type": "integer", "minimum": 1},
            "objective": {"enum": list(OBJECTIVES)},
            "spread": _NUMBER,
            "space": {"type": "object", "additionalProperties": {"oneOf": [{"const": "fixed"}, bounds]}},
            "pruner": {
                "type": "object",
                "properties": {
                    "name": {"enum": list(PRUNERS)},
                    "startup_trials": {"type": "integer", "minimum": 0},
                    "warmup_steps": {"type": "integer", "minimum": 0},
                    "percentile": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 100},
                    "lower": {"type": "number"},
                },
                "additionalProperties": False,
            },
            "sampler": {
                "type": "object",
                "properties": {"name": {"enum": list(SAMPLERS)}, "seed": {"type": "integer", "minimum": 0}},
                "additionalProperties": False,
            },
            "storage": {"type": "string", "minLength": 1},
        },
        "additionalProperties": False,
    }


def tuned_file_schema() -> dict[str, Any]:
    """JSON Schema of a tuned file (results/tune/<name>/best.yaml, written by sweeps/tune.py): per algorithm the
    RunConfig fields and hyper-parameters to run it with, plus the provenance of the tuning."""
    entry = {
        "type": "object",
        "required": ["config", "hparams"],
        "properties": {
            "config": {
                "type": "object",
                "properties": {name: {"type": "number"} for name in TUNABLE_FIELDS},
                "additionalProperties": False,
            },
            "hparams": {"type": "object"},
            "value": {"type": "number"},
            "trial": {"type": "integer", "minimum": 0},
            "run_id": {"type": "string"},
            "trials": {"type": "object"},
            "space": {"type": "object"},
        },
        "additionalProperties": False,
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "tuned hyper-parameters",
        "type": "object",
        "required": ["format", "algorithms"],
        "properties": {
            "format": {"const": TUNED_FORMAT},
            "study": {"type": "string"},
            "source": {"type": "string"},
            "objective": {"type": "object"},
            "budget": {"type": "object"},
            "storage": {"type": "string"},
            "provenance": {"type": "object"},
            "algorithms": {
                "type": "object",
                "minProperties": 1,
                "propertyNames": {"enum": list(catalog.names())},
                "additionalProperties": entry,
            },
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
        patterns = [re.compile(p) for p in schema.get("patternProperties", {})]
        known = set(schema.get("properties", {}))
        extra = sorted(k for k in error.instance if k not in known and not any(p.search(k) for p in patterns))
        valid = ", ".join(schema.get("properties", {}))
        if patterns:
            valid += "".join(f", {name}.NAME" for name in MAPPING_FIELDS)
        replaced = "".join(f"; {k} is replaced by {REPLACED_FIELDS[k]}" for k in extra if k in REPLACED_FIELDS)
        return f"{where}: unknown field(s) {extra}{replaced}; valid: {valid}"
    is_model = re.search(r"(^|\.)model(\[\d+\])?$", where) is not None
    if error.validator == "enum":
        valid = ", ".join(map(str, error.validator_value))
        return f"{where} = {error.instance!r}; valid: {valid}" + (f", {_MODEL_MAPPING}" if is_model else "")
    if error.validator == "type" and is_model:
        return f"{where} = {error.instance!r}: must be a preset name ({', '.join(PRESETS)}), {_MODEL_MAPPING}"
    if error.validator == "anyOf" and is_model:
        return f"{where} = {error.instance!r}; valid: {', '.join(PRESETS)}, {_MODEL_MAPPING}"
    if error.validator == "oneOf" and where.startswith("axes.algorithm"):
        return f"{where} = {error.instance!r}; valid: `all` or a list of {', '.join(catalog.names())}"
    if error.validator == "oneOf" and where.startswith("tune.space."):
        return f"{where} = {error.instance!r}; valid: `fixed`, or {{low: X, high: Y}} with optional log: true|false"
    if error.validator == "const":
        return f"{where} = {error.instance!r}; valid: {error.validator_value!r}"
    if error.validator == "pattern":
        return f"{where} = {error.instance!r}: must match {error.validator_value} (a YAML file)"
    if error.validator in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        return f"{where} = {error.instance!r}: {error.validator} is {error.validator_value}"
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


def _validate(schema: dict[str, Any], data: Any, where: str) -> None:
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(data), key=lambda e: [str(p) for p in e.absolute_path])
    if errors:
        messages = list(dict.fromkeys(_message(leaf) for error in errors for leaf in _leaves(error)))
        raise SweepError(f"{where}: " + "\n  ".join(messages))


NAME_PATTERN = "^[A-Za-z0-9_][A-Za-z0-9_.-]*$"
"""A study name: one folder name under the results root (no path, no leading dot: not `.` or `..`)."""
RESERVED_NAMES = ("runs", "coldstart", "all", "mlruns")
"""Folders of the results root that are not studies (runs/, coldstart/, MLflow's file store mlruns/) and the report's
name for every run (all/). `tune` (the tuning stores' folder, results/tune/<name>/) is reserved for tuning sweeps
(those with a `tune:` section): sweeps/tune.yaml's study is `tune`."""


def validate_sweep(data: Any, *, where: str = "sweep") -> None:
    """Raise SweepError listing every schema violation of `data` (a parsed sweep file)."""
    name = data.get("name") if isinstance(data, dict) else None
    if name == "tune" and isinstance(data, dict) and "tune" not in data:
        raise SweepError(
            f"{where}: name = 'tune': reserved for tuning sweeps (results/tune/ holds the tuning "
            "stores); valid: another name"
        )
    if isinstance(name, str) and (name in RESERVED_NAMES or not re.fullmatch(NAME_PATTERN, name)):
        raise SweepError(
            f"{where}: name = {name!r}: a study's folder under the results root; valid: letters, "
            f"digits, _ . - not starting with a dot, and not one of {', '.join(RESERVED_NAMES)} "
            "(reserved)"
        )
    _validate(sweep_schema(), data, where)
    if data.get("comparisons"):
        check_comparisons(data, where)


def validate_tuned_file(data: Any, *, where: str = "tuned file") -> None:
    """Raise SweepError listing every schema violation of `data` (a parsed tuned file)."""
    _validate(tuned_file_schema(), data, where)
