"""YAML and JSON nested past 64 levels, or a mapping with a key twice, at every entry that reads them (each through
runfiles.bounded): one `error: ...` line naming the file or option and why, a non-zero exit, no traceback, nothing
written."""

from __future__ import annotations

from pathlib import Path

import pytest

from study import __main__ as study_main
from study import launch
from study.run import rundir
from study.run.config import load_config

DEEP_YAML = "[" * 5000 + "]" * 5000
DEEP_MAPPING = "{a: " + DEEP_YAML + "}"
DEEP_JSON = '{"a": ' + "[" * 5000 + "]" * 5000 + "}"
NESTED = "nested deeper than 64 levels"


def error_line(capsys: pytest.CaptureFixture[str], argv: list[str], main=study_main.main) -> str:
    """Run a CLI in-process; exit 2 with one error line (argparse's usage line before it allowed), no traceback."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse refusing an option's value
        code = exit_.code
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith(("usage:", "  "))]
    assert code == 2 and err and "Traceback" not in "\n".join(err), (code, err)
    assert len(err) == 1 and len(err[0]) < 3000, err
    return err[0]


@pytest.fixture
def deep_run(tmp_path: Path) -> Path:
    """A run directory whose config.yaml is nested 5,000 levels deep."""
    run_dir = tmp_path / "results" / "runs" / "0123456789ab"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("lr: " + DEEP_YAML + "\n")
    return run_dir


def test_resume_and_export_of_a_deep_config_are_one_line(deep_run: Path, tmp_path: Path, capsys) -> None:
    line = error_line(capsys, ["resume", str(deep_run), "--quiet"])
    assert f"{deep_run / 'config.yaml'}: cannot be read as this run's config ({NESTED}" in line, line
    line = error_line(capsys, ["export", str(deep_run), "--hf", str(tmp_path / "hf")])
    assert f"{deep_run / 'config.yaml'}: not valid YAML ({NESTED}" in line, line
    assert not (tmp_path / "hf").exists()
    assert sorted(p.name for p in deep_run.iterdir()) == ["config.yaml"], "resume wrote into the run"


def test_plan_and_coldstart_model_mappings_are_bounded_and_strict(tmp_path: Path, capsys) -> None:
    plan = ["plan", "--gpus", "8", "--gpu-mem", "80", "--model"]
    assert NESTED in error_line(capsys, [*plan, DEEP_MAPPING])
    assert "duplicate key 'preset'" in error_line(capsys, [*plan, "{preset: tiny, num_experts: 8, preset: small}"])
    results = ["--results", str(tmp_path / "results"), "--quiet"]
    line = error_line(capsys, ["coldstart", "--model", DEEP_MAPPING, *results])
    assert "coldstart: error: argument --model: model = '{a: [[[" in line and NESTED in line, line
    line = error_line(capsys, ["coldstart", "--model", "{preset: tiny, preset: small}", *results])
    assert "not a YAML mapping (duplicate key 'preset'" in line, line
    line = error_line(capsys, ["coldstart", "--set", "num_experts=" + DEEP_YAML, *results])
    assert line.startswith("coldstart: --set 'num_experts=[[[") and NESTED in line, line
    assert not (tmp_path / "results").exists()


def test_the_launchers_json_options_are_bounded(tmp_path: Path, capsys) -> None:
    config = tmp_path / "run.yaml"
    rundir.write_yaml(config, load_config(preset="tiny", sets=["coldstart=scratch"]).to_dict())
    results = ["--results", str(tmp_path / "results")]
    line = error_line(capsys, [str(config), "--rollout-runtime", DEEP_JSON, *results], main=launch.main)
    assert line.startswith('error: --rollout-runtime = \'{"a": [[[') and NESTED in line, line
    line = error_line(capsys, [str(config), "--rollout-runtime", '{"tp": 2, "tp": 4}', *results], main=launch.main)
    assert "duplicate key 'tp'" in line, line
    coldstart = ["--coldstart", "tiny", "chain_sum", *results]
    line = error_line(capsys, [*coldstart, "--coldstart-settings", DEEP_JSON], main=launch.main)
    assert line.startswith("error: --coldstart-settings = ") and NESTED in line, line
    line = error_line(capsys, ["--coldstart", DEEP_MAPPING, "chain_sum", *results], main=launch.main)
    assert line.startswith("error: model = '{a: [[[") and NESTED in line, line
    assert not (tmp_path / "results").exists()


def test_an_hf_models_deep_config_json_is_one_line(tmp_path: Path, capsys) -> None:
    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text(DEEP_JSON)
    results = ["--results", str(tmp_path / "results"), "--quiet"]
    line = error_line(capsys, ["run", "--set", f"model={model}", *results])
    assert f"model = {str(model)!r}: cannot read config.json ({NESTED}" in line, line
    (model / "config.json").write_text('{"model_type": "qwen3_moe", "model_type": "llama"}')
    line = error_line(capsys, ["run", "--set", f"model={model}", *results])
    assert "cannot read config.json (duplicate key 'model_type')" in line, line
    assert not (tmp_path / "results").exists()


def test_status_and_analysis_list_a_deep_config_as_unreadable(deep_run: Path) -> None:
    """Readers that list runs report a hostile one and go on, never crash."""
    from analysis.runs import rundir as run_reader
    from study.run import status

    config, why = status._read_yaml(deep_run / "config.yaml")
    assert config == {} and NESTED in why, why
    data, reason = run_reader._read_config(deep_run)
    assert data == {} and NESTED in reason, reason


FIVE_THOUSAND_DIGITS = "1" * 5000
"""A seed longer than Python reads as a number (4,300 digits): float() read it as inf, int() raised unexplained."""


def test_a_5000_digit_seed_names_the_field_and_the_fix(tmp_path: Path, capsys) -> None:
    results = ["--results", str(tmp_path / "results"), "--quiet"]
    valid = "valid: a number of at most 4300 digits"
    line = error_line(capsys, ["run", "--preset", "tiny", "--set", f"seed={FIVE_THOUSAND_DIGITS}", *results])
    assert "seed = a 5000-digit number" in line and valid in line, line
    config = tmp_path / "run.yaml"
    config.write_text(f"seed: {FIVE_THOUSAND_DIGITS}\n")
    line = error_line(capsys, ["run", str(config), "--preset", "tiny", *results])
    assert f"{config}: seed = a 5000-digit number" in line and valid in line, line
    assert not (tmp_path / "results").exists()


def test_a_nan_interval_names_the_option_and_the_fix(tmp_path: Path, capsys) -> None:
    line = error_line(capsys, ["status", str(tmp_path), "--watch", "--interval", "nan"])
    assert line == "error: --interval = nan: valid: a finite number of seconds > 0", line


def test_a_results_path_under_a_file_names_it_before_anything_is_written(tmp_path: Path, capsys) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    results = afile / "results"
    line = error_line(capsys, ["run", "--preset", "tiny", "--set", "coldstart=scratch", "--results", str(results)])
    assert f"results = {str(results)!r}: {afile} is a file, not a directory" in line and "valid: --results" in line
    config = tmp_path / "run.yaml"
    rundir.write_yaml(config, load_config(preset="tiny", sets=["coldstart=scratch"]).to_dict())
    line = error_line(capsys, [str(config), "--results", str(results)], main=launch.main)
    assert f"{afile} is a file, not a directory" in line, line
    assert afile.read_text() == "x"


def test_a_fifo_config_or_cold_start_file_is_refused_not_waited_on(tmp_path: Path, capsys) -> None:
    import os

    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    results = ["--results", str(tmp_path / "results")]
    line = error_line(capsys, ["run", str(fifo), "--quiet", *results])
    assert line == f"error: {fifo}: not a regular file (a FIFO); give a YAML file of RunConfig fields", line
    line = error_line(capsys, [str(fifo), *results], main=launch.main)
    assert f"{fifo}: not a regular file (a FIFO)" in line, line
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    os.mkfifo(checkpoint / "config.json")
    (checkpoint / "model.safetensors").write_bytes(b"")
    line = error_line(capsys, ["run", "--preset", "tiny", "--set", f"coldstart={checkpoint}", "--quiet", *results])
    assert f"coldstart = {str(checkpoint)!r}: config.json is not a regular file (a FIFO" in line, line
    assert not (tmp_path / "results").exists()


def test_a_model_directory_without_a_regular_config_json_is_named(tmp_path: Path, capsys) -> None:
    import os

    model = tmp_path / "checkpoint"
    model.mkdir()
    results = ["--results", str(tmp_path / "results"), "--quiet"]
    line = error_line(capsys, ["run", "--preset", "tiny", "--set", f"model={model}", *results])
    assert f"model = {str(model)!r}: a directory without config.json; valid: tiny, " in line, line
    os.mkfifo(model / "config.json")  # opened for reading, it would wait for a writer for ever
    line = error_line(capsys, ["run", "--preset", "tiny", "--set", f"model={model}", *results])
    assert f"model = {str(model)!r}: cannot read config.json (not a regular file (a FIFO)); valid: " in line, line
    assert not (tmp_path / "results").exists()


def test_a_cold_start_results_path_under_a_file_names_it(tmp_path: Path, capsys) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    results = afile / "x"
    named = f"results = {str(results)!r}: {afile} is a file, not a directory"
    line = error_line(capsys, ["coldstart", "--results", str(results), "--quiet"])
    assert line.startswith(f"coldstart: {named}") and "valid: --results naming a directory" in line, line
    for launcher in ("in-process", "local"):
        argv = ["--coldstart", "tiny", "chain_sum", "--results", str(results), "--launcher", launcher]
        line = error_line(capsys, argv, main=launch.main)
        assert line.startswith(f"error: {named}"), line
    assert afile.read_text() == "x"


def test_a_5000_digit_cold_start_seed_names_the_field_and_its_range(tmp_path: Path, capsys) -> None:
    from study.coldstart.sft import MAX_SEED

    results = ["--results", str(tmp_path / "results")]
    valid = f"valid: an integer in 0..{MAX_SEED}"
    line = error_line(capsys, ["coldstart", "--seed", FIVE_THOUSAND_DIGITS, *results])
    assert line == f"python -m study coldstart: error: argument --seed: seed = a 5000-digit number; {valid}", line
    coldstart = ["--coldstart", "tiny", "chain_sum", *results, "--coldstart-settings"]
    line = error_line(capsys, [*coldstart, f'{{"seed": {FIVE_THOUSAND_DIGITS}}}'], main=launch.main)
    assert line == f"error: --coldstart-settings: seed = a 5000-digit number; {valid}", line
    line = error_line(capsys, [*coldstart, f'{{"seed": {MAX_SEED + 1}}}'], main=launch.main)
    assert line == f"error: coldstart.seed = {MAX_SEED + 1}: {valid}", line  # torch seeds its generators below 2**64
    assert not (tmp_path / "results").exists()


def test_a_run_its_preflight_refuses_leaves_the_results_untouched(tmp_path: Path, capsys) -> None:
    """The local launcher asks for no job (whose folder and logs go under the run directory) for a run its preflight
    refuses; in a run directory a workflow made for the run's log, the refusal is recorded as the job records it."""
    import os

    config = tmp_path / "run.yaml"
    cfg = load_config(preset="tiny", sets=[f"coldstart={tmp_path / 'no-such-coldstart'}"])
    rundir.write_yaml(config, cfg.to_dict())
    results = tmp_path / "results"
    (results / "runs").mkdir(parents=True)
    (results / "notes.txt").write_text("kept")

    def listing() -> list[str]:
        return sorted(str(p.relative_to(results)) for p in results.rglob("*"))

    before = listing()
    argv = [str(config), "--results", str(results), "--launcher", "local"]
    line = error_line(capsys, argv, main=launch.main)
    assert line.startswith(f"error: coldstart = {str(tmp_path / 'no-such-coldstart')!r}: no such directory"), line
    assert listing() == before, "a refused launch wrote under --results"
    made = results / "runs" / cfg.run_id  # as Snakemake makes it for run.log
    made.mkdir()
    assert error_line(capsys, argv, main=launch.main) == line
    assert sorted(p.name for p in made.iterdir()) == ["config.yaml", rundir.FAILURE_FILE], "no job folder"
    record = rundir.read_json(made / rundir.FAILURE_FILE)
    assert record["error"] == f"refused before it started: {line.removeprefix('error: ')}", record
    cpus = os.cpu_count() or 1  # a local job runs on this machine: its CPUs are checked before it is asked for
    rundir.write_yaml(config, load_config(preset="tiny", sets=["coldstart=scratch", f"threads={cpus + 1}"]).to_dict())
    before = listing()
    line = error_line(capsys, argv, main=launch.main)
    assert line == f"error: threads = {cpus + 1}: this machine has {cpus} CPUs; valid: 1..{cpus}", line
    assert listing() == before, "a refused launch wrote under --results"
