"""A sweep file -> the validated RunConfigs of its study, keyed by run id.

`python -m sweeps.expand SWEEP.yaml` lists the run ids; `--write-config RUN_ID --out FILE` writes one resolved
config (what the Snakemake `resolve` rule calls). Identical runs (in one study or across studies) share a run id,
the content hash of the resolved config, so they are listed and run once.

An axis may vary the model's shape, as whole shapes (`model: [default, {preset: default, num_experts: 32}]`) or one
field at a time (`model.num_experts: [8, 32]`, a dotted axis, applied after the whole-field axes); each distinct shape
has its own run ids and its own cold start, so a sweep crosses MoE granularity with algorithms.

A sweep with `tuned: FILE` (a tuned file, written by `python -m sweeps.tune`) runs every algorithm with its tuned
values: each run's config is the preset, then `base`, then the run's algorithm's `per_algorithm` fields (a sweep's own
per-algorithm settings, e.g. a clip range), then the tuned RunConfig fields and hyper-parameters of the run's
algorithm, then the axis values. The file must exist and hold every algorithm the sweep runs, before any job starts.

A sweep's `vars:` names site values with their defaults (`vars: {checkpoint: checkpoints/Qwen3-30B-A3B-Base}`); a
string `{checkpoint}` anywhere in `base` or `axes` is replaced by the value, which the command line overrides
(`--var checkpoint=/data/Qwen3-30B-A3B-Base`; Snakemake: `--config checkpoint=...`). A value given for a name the
sweep does not declare is ignored, so one Snakemake config serves every sweep; a `{name}` the sweep does not declare
is an error.

A grid sweep's `exclude:` lists partial combinations to leave out: each entry maps axes to lists of their values, and
a run is left out when its value on every axis of some entry is among that entry's values (`exclude: [{algorithm:
[grpo_rr, gspo_rr], model: [dense]}]` drops the replay runs of the dense shape only). An entry naming an axis the
sweep does not have, or a value the axis does not list, is an error.

A sweep expands to at most MAX_RUNS runs (counted before any is built); a larger one is refused naming its size,
unless the sweep says `max_runs: N` (or `--max-runs N`). An axis lists each value once.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from algorithms import catalog
from runfiles.bounded import read_yaml
from study.run import rundir
from study.run.config import PRESET_RUNS, RunConfig, merge_field
from sweeps.schema import SweepError, check_comparison_runs, validate_sweep, validate_tuned_file

MAX_RUNS = 10_000
"""Most runs a sweep may expand to unless it raises the cap (`max_runs:` or --max-runs)."""


@dataclass(frozen=True)
class Sweep:
    name: str
    base: dict[str, Any]
    axes: dict[str, list[Any]]
    mode: str = "grid"
    preset: str | None = None
    source: str = "sweep"
    tuned: str | None = None
    """Path of the tuned file (the sweep's `tuned:`), or None."""
    tuned_values: dict[str, dict[str, Any]] | None = None
    """algorithm -> {"config": {field: value}, "hparams": {...}} from the tuned file."""
    tune: dict[str, Any] | None = None
    """The `tune:` section of a tuning sweep (sweeps/tune.py), or None."""
    per_algorithm: dict[str, dict[str, Any]] | None = None
    """algorithm -> RunConfig fields of that algorithm's runs (the sweep's `per_algorithm:`), or None."""
    max_runs: int = MAX_RUNS
    """The cap on the sweep's size (its `max_runs:`, else MAX_RUNS)."""
    exclude: tuple[dict[str, list[Any]], ...] = ()
    """Partial combinations left out of a grid (the sweep's `exclude:`): axis -> the values that match."""

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "sweep") -> Sweep:
        validate_sweep(data, where=where)
        axes = dict(data.get("axes") or {})
        if axes.get("algorithm") == "all":
            axes["algorithm"] = list(catalog.names())
        mode = data.get("mode", "grid")
        if mode == "zip" and len({len(v) for v in axes.values()}) > 1:
            lengths = ", ".join(f"{k}: {len(v)}" for k, v in axes.items())
            raise SweepError(f"{where}: mode = 'zip' needs axes of equal length; got {lengths}")
        for name, values in axes.items():
            seen: set[str] = set()
            for value in values:
                key = _canonical(value)
                if key in seen:
                    raise SweepError(f"{where}: axes.{name} lists {_short(value)} twice; valid: each value once")
                seen.add(key)
        max_runs = data.get("max_runs", MAX_RUNS)
        exclude = tuple(data.get("exclude") or ())
        if exclude and mode != "grid":
            raise SweepError(f"{where}: exclude applies to mode = 'grid'; valid: drop exclude, or mode: grid")
        for i, entry in enumerate(exclude):
            for name, values in entry.items():
                if name not in axes:
                    raise SweepError(f"{where}: exclude[{i}].{name} is not an axis; valid: {', '.join(axes)}")
                listed = {_canonical(v) for v in axes[name]}
                for value in values:
                    if _canonical(value) not in listed:
                        raise SweepError(
                            f"{where}: exclude[{i}].{name} = {_short(value)} is not a value of "
                            f"axes.{name}; valid: {', '.join(_short(v) for v in axes[name])}"
                        )
        tuned = data.get("tuned")
        tuned_values = load_tuned(tuned, where=f"{where}: tuned") if tuned else None
        sweep = cls(
            data["name"],
            dict(data.get("base") or {}),
            axes,
            mode,
            data.get("preset"),
            where,
            tuned,
            tuned_values,
            data.get("tune"),
            data.get("per_algorithm"),
            max_runs,
            exclude,
        )
        sweep.check_size()
        if data.get("comparisons"):  # every declaration readable from the runs the sweep makes, before any runs
            check_comparison_runs(data, [sweep.run_data(c) for c in sweep.combinations()], where)
        return sweep

    def size(self) -> int:
        """Runs the axes make (before identical ones collapse), counted without building them (`exclude` is
        counted by enumerating the grid only when it is within 100x the cap)."""
        lengths = [len(v) for v in self.axes.values()]
        if not lengths:
            return 1
        if self.mode != "grid":
            return lengths[0]
        full = math.prod(lengths)
        if not self.exclude or full > 100 * self.max_runs:
            return full
        return len(self.combinations())

    def check_size(self, max_runs: int | None = None) -> None:
        """SweepError naming the size and the override when the sweep makes more than `max_runs` (default: its
        own cap) runs."""
        cap = self.max_runs if max_runs is None else max_runs
        size = self.size()
        if size > cap:
            shape = " x ".join(f"{len(v)} {k}" for k, v in self.axes.items())
            raise SweepError(
                f"{self.source}: the sweep makes {size} runs ({shape}), more than max_runs = {cap}; "
                "valid: fewer axis values, or raise the cap with `max_runs: N` in the sweep "
                "(or --max-runs N) if you mean it"
            )

    def combinations(self) -> list[dict[str, Any]]:
        """The axis values of every run, in file order (grid: last axis fastest)."""
        names = list(self.axes)
        if not names:
            return [{}]
        rows = itertools.product(*self.axes.values()) if self.mode == "grid" else zip(*self.axes.values(), strict=True)
        combos = [dict(zip(names, row, strict=True)) for row in rows]
        return [c for c in combos if not any(_matches(c, entry) for entry in self.exclude)]

    def run_data(self, combo: dict[str, Any]) -> dict[str, Any]:
        """Preset, then base, then the run's algorithm's `per_algorithm` fields, then its tuned values, then the axis
        values, whole fields before dotted ones (`model.num_experts`, `hparams.eps_low`). Each layer sets a field by
        study.run.config.merge_field: mappings such as hparams merge key by key; a model name or a mapping with
        `preset` replaces the shape, a mapping without `preset` changes fields of it."""
        data: dict[str, Any] = dict(PRESET_RUNS[self.preset]) if self.preset else {}
        layers = [self.base, combo]
        algorithm = combo.get("algorithm", self.base.get("algorithm", RunConfig.algorithm))
        if self.per_algorithm and algorithm in self.per_algorithm:
            layers.insert(1, dict(self.per_algorithm[algorithm]))
        if self.tuned_values is not None:
            if algorithm not in self.tuned_values:
                raise SweepError(
                    f"{self.source}: tuned = {self.tuned!r} has no tuned values for algorithm {algorithm!r} (tuned: "
                    f"{', '.join(self.tuned_values)}); valid: tune it too (add it to the tuning sweep's "
                    "axes.algorithm), or drop it from this sweep: a comparison of tuned and untuned algorithms is "
                    "not fair"
                )
            entry = self.tuned_values[algorithm]
            layers.insert(len(layers) - 1, {**entry["config"], "hparams": dict(entry["hparams"])})
        for layer in layers:
            for key, value in sorted(layer.items(), key=lambda item: "." in item[0]):  # stable: file order kept
                if "." in key:
                    key, sub = key.split(".", 1)
                    value = {sub: value}
                data[key] = merge_field(key, data.get(key), value)
        return data

    def expand(self) -> dict[str, RunConfig]:
        """run id -> validated RunConfig; duplicates (same resolved config) collapse to one entry."""
        runs: dict[str, RunConfig] = {}
        for combo in self.combinations():
            where = f"{self.source}: run {combo}" if combo else self.source
            try:
                cfg = RunConfig.from_dict(self.run_data(combo), where=where)
            except ValueError as err:
                raise SweepError(f"{where}: {err}" if not str(err).startswith(where) else str(err)) from err
            runs.setdefault(cfg.run_id, cfg)
        return runs


def _canonical(value: Any) -> str:
    """An axis value as text that is equal exactly when the values are (mappings in key order): what the duplicate
    check and `exclude` compare."""
    return json.dumps(value, sort_keys=True, default=str)


def _matches(combo: dict[str, Any], entry: dict[str, list[Any]]) -> bool:
    """Whether the combination's value on every axis of the `exclude` entry is among the entry's values."""
    return all(_canonical(combo[name]) in {_canonical(v) for v in values} for name, values in entry.items())


def tune_command(path: str) -> str:
    """The command that writes the tuned file `path` (RESULTS/tune/<name>/best.yaml <- sweeps/<name>.yaml)."""
    match = re.search(r"(?:^|/)tune/([A-Za-z0-9_.-]+)/best\.ya?ml$", path)
    sweep = f"sweeps/{match.group(1)}.yaml" if match and Path("sweeps", f"{match.group(1)}.yaml").is_file() else None
    if sweep is None:
        return "`python -m sweeps.tune TUNING_SWEEP.yaml`, which writes RESULTS/tune/<name>/best.yaml (copy it here)"
    results = path[: match.start()] if match.start() else "."
    extra = f" --results {results}" if results not in (".", "results") else ""
    return f"`python -m sweeps.tune {sweep}{extra}` (or `snakemake tune --cores all --config sweep={sweep}`)"


def load_tuned(path: str | Path, *, where: str = "tuned") -> dict[str, dict[str, Any]]:
    """algorithm -> {"config": {...}, "hparams": {...}} of a tuned file, validated (schema and each algorithm's
    hyper-parameter ranges); a missing file names the field and the command that writes it."""
    path = Path(path)
    if not path.is_file():
        raise SweepError(f"{where} = {str(path)!r}: no such file; write it with {tune_command(str(path))}")
    data = _yaml_file(path, where=f"{where} = {str(path)!r}")
    validate_tuned_file(data, where=f"{where} = {str(path)!r}")
    out = {}
    for name, entry in data["algorithms"].items():
        try:
            catalog.spec(name).check_hparams(entry["hparams"])
        except ValueError as err:
            raise SweepError(f"{where} = {str(path)!r}: algorithms.{name}.hparams: {err}") from None
        out[name] = {"config": dict(entry["config"]), "hparams": dict(entry["hparams"])}
    return out


def load_sweep(path: str | Path, variables: dict[str, str] | None = None, *, max_runs: int | None = None) -> Sweep:
    """Parse and validate a sweep file (errors name the file, the field and the valid values); `variables` override
    its `vars:` (module docstring); `max_runs` overrides its size cap."""
    path = Path(path)
    if not path.is_file():
        raise SweepError(f"sweep file {path} not found")
    data = _yaml_file(path, where=str(path))
    data = substitute_vars(data, variables, where=str(path))
    if max_runs is not None and isinstance(data, dict):
        data = {**data, "max_runs": max_runs}
    return Sweep.from_dict(data, where=str(path))


def _yaml_file(path: Path, *, where: str) -> Any:
    """The YAML document in `path` (its size checked before it is read); SweepError "`where`: not valid YAML" else."""
    try:
        return read_yaml(path)
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise SweepError(f"{where}: not valid YAML: {_one_line(err)}") from None


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:500]


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def substitute_vars(data: Any, variables: dict[str, str] | None, *, where: str = "sweep") -> Any:
    """`data` with every `{name}` of its `vars:` (the sweep's default, or `variables`' value) replaced in the
    strings of `base` and `axes`. A given value must be a non-empty string; a `{name}` left in them that `vars:` does
    not declare is a SweepError naming it."""
    if not isinstance(data, dict):
        return data
    if not isinstance(data.get("vars"), dict):
        _check_placeholders(data, {}, where)
        return data
    values = dict(data["vars"])
    for name, value in (variables or {}).items():
        if name in values:
            if not isinstance(value, str) or not value:
                raise SweepError(f"{where}: vars.{name} = {value!r}: must be a non-empty string")
            values[name] = value

    def sub(node: Any) -> Any:
        if isinstance(node, str):
            for name, value in values.items():
                node = node.replace("{" + name + "}", str(value))
            return node
        if isinstance(node, list):
            return [sub(v) for v in node]
        if isinstance(node, dict):
            return {k: sub(v) for k, v in node.items()}
        return node

    out = {**data, **{key: sub(data[key]) for key in ("base", "axes") if key in data}, "vars": values}
    _check_placeholders(out, values, where)
    return out


def _check_placeholders(data: dict[str, Any], values: dict[str, Any], where: str) -> None:
    def walk(node: Any, at: str) -> None:
        if isinstance(node, str):
            match = _PLACEHOLDER.search(node)
            if match:
                name, declared = match.group(1), ", ".join(values) or "none"
                raise SweepError(
                    f"{where}: {at} = {_short(node)}: placeholder {{{name}}} is not declared in vars:; "
                    f"valid: {declared} (declare it: vars: {{{name}: DEFAULT}})"
                )
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{at}[{i}]")
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{at}.{k}")

    for key in ("base", "axes"):
        if key in data:
            walk(data[key], key)


def expand(path: str | Path) -> dict[str, RunConfig]:
    """run id -> RunConfig for the sweep file at `path`."""
    return load_sweep(path).expand()


def write_config(cfg: RunConfig, out: str | Path) -> Path:
    """The resolved config as YAML (what `python -m study run` reads)."""
    out = Path(out)
    rundir.write_yaml(out, cfg.to_dict())
    return out


def write_run_ids(study: str, runs: dict[str, RunConfig], out: str | Path, *, source: str = "") -> Path:
    """The study's run ids, one a line (what `python -m analysis report --study` reads)."""
    out = Path(out)
    rundir.write_text(out, f"# study {study} from {source}\n" + "".join(f"{run_id}\n" for run_id in runs))
    print(f"{len(runs)} run id(s) of study {study} -> {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sweeps.expand", description=__doc__)
    parser.add_argument("sweep", nargs="+", help="sweep file(s) to validate and expand")
    parser.add_argument("--write-config", metavar="RUN_ID", help="write this run's resolved config to --out")
    parser.add_argument("--out", help="output YAML path for --write-config")
    parser.add_argument("--write-configs", metavar="DIR", help="write every run's resolved config to DIR/RUN_ID.yaml")
    parser.add_argument("--run-ids", metavar="FILE", help="write the study's run ids to FILE, one a line")
    parser.add_argument(
        "--max-runs",
        type=int,
        default=None,
        metavar="N",
        help=f"allow a sweep of up to N runs (default: its max_runs:, else {MAX_RUNS})",
    )
    parser.add_argument(
        "--var",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a value of the sweep's vars (--var checkpoint=/data/Qwen3-30B-A3B-Base)",
    )
    args = parser.parse_args(argv)
    try:
        variables = {}
        for item in args.var:
            name, sep, value = item.partition("=")
            if not sep or not name:
                raise SweepError(f"--var {item!r}: must be NAME=VALUE")
            variables[name] = value
        for path in args.sweep:
            sweep = load_sweep(path, variables, max_runs=args.max_runs)
            runs = sweep.expand()
            if args.write_config:
                if args.write_config not in runs:
                    raise SweepError(f"{path}: no run {args.write_config}; runs: {', '.join(runs)}")
                if not args.out:
                    parser.error("--write-config needs --out")
                print(write_config(runs[args.write_config], args.out))
                continue
            if args.write_configs or args.run_ids:
                for run_id, cfg in runs.items():
                    if args.write_configs:
                        print(write_config(cfg, Path(args.write_configs) / f"{run_id}.yaml"))
                if args.run_ids:
                    write_run_ids(sweep.name, runs, args.run_ids, source=path)
                continue
            print(f"{path}: study {sweep.name!r}, {len(runs)} run(s) ({sweep.mode})")
            for run_id in runs:
                print(f"  {run_id}")
    except SweepError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
