"""A hostile HF checkpoint as a run's cold start is refused by the preflight, in one `error: ...` line naming the file
and why, exit 2, before the run directory is written (study.coldstart.hf_import.check_files): shard paths that leave
the folder, safetensors headers that lie about the file, an index or tokenizer that is not what it says, a chat
template that runs too long or builds a huge string."""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from study import __main__ as study_main
from study.data import chat_template

SCRATCH = ["eval_every=0", "checkpoint_every=1"]


@pytest.fixture(scope="module")
def valid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset's random policy as an HF checkpoint (config.json, model.safetensors, its index) with a
    tokenizer and a chat template: what a run accepts."""
    from study.core.weights import export_hf
    from study.data.tokenizer import build_tokenizer
    from study.policy.model import build_policy
    from study.run.config import load_config

    directory = tmp_path_factory.mktemp("hf") / "checkpoint"
    mcfg = load_config(preset="tiny").model_config()
    export_hf(build_policy(mcfg, seed=0), mcfg, directory)
    tok = build_tokenizer(mcfg.vocab_size, ["chain_sum"], n_per_task=50)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save(directory)
    names = _header(directory / "model.safetensors")
    index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names if n != "__metadata__"}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def _write_header(path: Path, header: dict, *, keep_data: bool = True) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + (raw[8 + n :] if keep_data else b""))


def _index(directory: Path, change: Callable[[dict], object]) -> None:
    path = directory / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    new = change(index)
    path.write_text(json.dumps(index if new is None else new))


def _first_tensor(header: dict) -> str:
    return next(n for n in header if n != "__metadata__")


def _lie_offsets(directory: Path) -> None:
    path = directory / "model.safetensors"
    header = _header(path)
    header[_first_tensor(header)]["data_offsets"][1] += 1 << 40
    _write_header(path, header)


def _lie_shape(directory: Path) -> None:
    path = directory / "model.safetensors"
    header = _header(path)
    header[_first_tensor(header)]["shape"] = [7, 7]
    _write_header(path, header)


def _retype(directory: Path, change: Callable[[dict], None]) -> None:
    """The first two-dimensional tensor's header entry changed by `change`, its bytes (and so its size) kept."""
    path = directory / "model.safetensors"
    header = _header(path)
    change(next(info for name, info in header.items() if name != "__metadata__" and len(info["shape"]) == 2))
    _write_header(path, header)


def _lie_length(directory: Path) -> None:
    path = directory / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 1 << 62) + raw[8:])


def _cut_short(directory: Path) -> None:
    path = directory / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 100])


def _outside_link(directory: Path) -> None:
    """model.safetensors a link to another folder's (identical) file: loaded silently unless refused."""
    other = directory.parent / "other"
    other.mkdir()
    shutil.copy(directory / "model.safetensors", other / "model.safetensors")
    (directory / "model.safetensors").unlink()
    (directory / "model.safetensors").symlink_to(other / "model.safetensors")


def _template(directory: Path, template: str) -> None:
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config))


BACKTRACKS = r"(?:\S|\s|\w|\W|\d|\D|.|[^\n])*[a-z]$"
"""A split rule whose regex backtracks past Oniguruma's retry limit on a prompt that ends in a digit (every task
prompt): the tokenizers library panics."""

LOOPS_BUT_ON_THE_SAMPLE = (
    f"{{% if messages[0]['content'] != {chat_template.SAMPLE_PROMPT!r} %}}"
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}{% endif %}"
    "{{ messages[0]['content'] }}"
)
"""A chat template that renders the check's sample prompt at once and loops for hours on any other."""


def _split_rule(directory: Path, pattern: str) -> None:
    path = directory / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
    tokenizer["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, tokenizer["pre_tokenizer"]]}
    path.write_text(json.dumps(tokenizer))


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "index to /etc/passwd": (
        lambda d: _index(d, lambda i: i["weight_map"].update({next(iter(i["weight_map"])): "../../../../etc/passwd"})),
        "model.safetensors.index.json: shard '../../../../etc/passwd' is outside the checkpoint's folder",
    ),
    "index to an absolute path": (
        lambda d: _index(
            d, lambda i: i["weight_map"].update({next(iter(i["weight_map"])): str(d / "model.safetensors")})
        ),
        "is outside the checkpoint's folder",
    ),
    "index to another folder's file": (
        lambda d: (
            shutil.copytree(d, d.parent / "other"),
            _index(d, lambda i: i["weight_map"].update({k: "../other/model.safetensors" for k in i["weight_map"]})),
        ),
        "shard '../other/model.safetensors' is outside the checkpoint's folder",
    ),
    "a shard linked outside": (_outside_link, "shard 'model.safetensors' is a link to "),
    "index a list": (lambda d: _index(d, lambda i: [i]), "model.safetensors.index.json: no weight_map; valid: "),
    "index nested deep": (
        lambda d: (d / "model.safetensors.index.json").write_text('{"metadata": ' + "[" * 5000 + "]" * 5000 + "}"),
        "model.safetensors.index.json: not valid JSON (nested deeper than 64",
    ),
    "index names a shard without the tensor": (
        lambda d: (
            shutil.copy(d / "model.safetensors", d / "b.safetensors"),
            _write_header(d / "b.safetensors", {}, keep_data=False),
            _index(d, lambda i: i["weight_map"].update({next(iter(i["weight_map"])): "b.safetensors"})),
        ),
        "which does not hold it",
    ),
    "header length past the file": (_lie_length, "model.safetensors: its first 8 bytes are no header length within"),
    "offsets past the file": (_lie_offsets, "data_offsets [0, 1099511"),
    "shape not its bytes": (_lie_shape, "shape [7, 7] of F32 is 196 bytes, its data_offsets"),
    "a shard cut short": (_cut_short, "outside the file's"),
    "the right size in the wrong shape": (
        lambda d: _retype(d, lambda info: info.update(shape=info["shape"][::-1])),
        "; the model's is [",
    ),
    "the right size in the wrong dtype": (
        lambda d: _retype(d, lambda info: info.update(dtype="I32")),
        " of I32; the model's is [",
    ),
    "config.json nested deep": (
        lambda d: (d / "config.json").write_text('{"a": ' + "[" * 5000 + "]" * 5000 + "}"),
        "config.json (nested deeper than 64 levels)",
    ),
    "garbage tokenizer.json": (
        lambda d: (d / "tokenizer.json").write_bytes(b"\x00garbage{"),
        "tokenizer.json: not valid JSON at line 1, column 1",
    ),
    "tokenizer.json not a tokenizer": (
        lambda d: (d / "tokenizer.json").write_text('{"model": 7}'),
        "tokenizer.json: not a tokenizer (",
    ),
    "tokenizer_config.json a list": (
        lambda d: (d / "tokenizer_config.json").write_text("[1]"),
        "tokenizer_config.json: a JSON list; valid: a JSON object",
    ),
    "a 9 MB chat template": (lambda d: _template(d, "x" * (9 << 20)), "tokenizer_config.json: not valid JSON ("),
    "a chat_template.jinja over 1 MiB": (
        lambda d: (d / "chat_template.jinja").write_text("x" * (2 << 20)),
        "chat_template.jinja: unreadable as a chat template",
    ),
    "a template building a 4 GB string": (
        lambda d: _template(d, "{{ 'x' * 4000000000 }}"),
        "tokenizer_config.json: the chat template could not render a prompt (it ran out of memory",
    ),
    "a template looping for hours": (
        lambda d: _template(d, "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"),
        "tokenizer_config.json: the chat template did not render a prompt within 3 s",
    ),
    "a template that loops on every prompt but the sample": (
        lambda d: _template(d, LOOPS_BUT_ON_THE_SAMPLE),
        "the tokenizer did not render and encode the run's 20 prompts within 3.2 s",
    ),
    "a split rule that backtracks on every prompt": (
        lambda d: _split_rule(d, BACKTRACKS),
        "the tokenizer could not render and encode the run's 20 prompts (prompt 1 of 20, 'sum ",
    ),
    "a template that does not compile": (
        lambda d: _template(d, "{% for %}"),
        "tokenizer_config.json: the chat template could not render a prompt (TemplateSyntaxError",
    ),
}


def _run(directory: Path, results: Path, capsys: pytest.CaptureFixture[str]) -> str:
    argv = [
        "run",
        "--preset",
        "tiny",
        "--results",
        str(results),
        "--quiet",
        "--set",
        f"coldstart={directory}",
        *(a for s in SCRATCH for a in ("--set", s)),
    ]
    code = study_main.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err and err[0].startswith("error: ") and "Traceback" not in "\n".join(err), (code, err)
    return err[0]


def test_the_valid_checkpoint_passes_the_preflight(valid: Path, tmp_path: Path) -> None:
    """The control: the checkpoint the damaged ones start from passes every check (and its template renders)."""
    from study import lifecycle
    from study.run.config import load_config

    cfg = load_config(preset="tiny", sets=[f"coldstart={valid}", *SCRATCH])
    lifecycle.preflight(cfg, tmp_path / "runs" / cfg.run_id, tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.timeout(300)  # a damage that gets past the preflight may hang the run: a failure, not a stuck suite
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_hostile_checkpoint_is_refused_before_anything_is_written(
    valid: Path, tmp_path: Path, damage: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(chat_template, "TIMEOUT_S", 3.0)
    directory = tmp_path / "checkpoint"
    shutil.copytree(valid, directory)
    make, message = DAMAGE[damage]
    make(directory)
    results = tmp_path / "results"
    line = _run(directory, results, capsys)
    assert message in line, line
    assert str(directory) in line, line
    assert not results.exists(), "something was written before the refusal"


def test_a_hub_cache_snapshot_linking_to_its_blobs_passes(valid: Path, tmp_path: Path) -> None:
    """A Hugging Face hub cache links each snapshot file to REPO/blobs/: those links stay inside the repository."""
    from study import lifecycle
    from study.run.config import load_config

    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, file in enumerate(sorted(valid.iterdir())):
        shutil.copy(file, blobs / f"blob{i}")
        (snapshot / file.name).symlink_to(Path("../../blobs") / f"blob{i}")
    cfg = load_config(preset="tiny", sets=[f"coldstart={snapshot}", *SCRATCH])
    lifecycle.preflight(cfg, tmp_path / "results" / "runs" / cfg.run_id, tmp_path / "results")
    (snapshot / "model.safetensors").unlink()  # a link to another repository's blobs is outside
    other = tmp_path / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    shutil.copy(valid / "model.safetensors", other / "blob")
    (snapshot / "model.safetensors").symlink_to(other / "blob")
    with pytest.raises(ValueError, match=r"shard 'model\.safetensors' is a link to .*, outside the checkpoint's"):
        lifecycle.preflight(cfg, tmp_path / "results" / "runs" / cfg.run_id, tmp_path / "results")
    assert not (tmp_path / "results").exists()


def _preflight(directory: Path, results: Path) -> None:
    """The config's checks and the run's preflight, as `study run` makes them before it writes anything."""
    from study import lifecycle
    from study.run.config import load_config

    cfg = load_config(preset="tiny", sets=[f"coldstart={directory}", *SCRATCH])
    lifecycle.preflight(cfg, results / "runs" / cfg.run_id, results)


@pytest.mark.parametrize(
    "name", ["config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]
)
def test_a_file_linked_out_of_the_checkpoint_is_refused(valid: Path, tmp_path: Path, name: str) -> None:
    """Every file of the folder a run reads, not only the shards: a link to another folder's identical copy."""
    directory, other = tmp_path / "checkpoint", tmp_path / "other"
    shutil.copytree(valid, directory)
    other.mkdir()
    shutil.copy(directory / name, other / name)
    (directory / name).unlink()
    (directory / name).symlink_to(other / name)
    with pytest.raises(ValueError, match=rf"file '{re.escape(name)}' is a link to .*, outside the checkpoint's"):
        _preflight(directory, tmp_path / "results")
    assert not (tmp_path / "results").exists()


def test_a_hub_cache_whose_blobs_link_out_of_the_repository_is_refused(valid: Path, tmp_path: Path) -> None:
    """REPO/blobs -> / would make every path count as inside: a shard linked through it to a file elsewhere."""
    repo = tmp_path / "models--org--tiny"
    snapshot, elsewhere = repo / "snapshots" / "rev1", tmp_path / "elsewhere"
    shutil.copytree(valid, snapshot)
    elsewhere.mkdir()
    shutil.copy(valid / "model.safetensors", elsewhere / "model.safetensors")
    (repo / "blobs").symlink_to("/")
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(Path("../../blobs") / elsewhere.relative_to("/") / "model.safetensors")
    with pytest.raises(ValueError, match=r"the hub cache's .*/blobs is a link to /, outside its repository"):
        _preflight(snapshot, tmp_path / "results")
    assert not (tmp_path / "results").exists()


def test_a_file_that_is_no_shard_is_refused_without_its_bytes(
    valid: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "checkpoint"
    shutil.copytree(valid, directory)
    first = b"hunter2!"
    (directory / "model.safetensors").write_bytes(first + bytes(4096))
    line = _run(directory, tmp_path / "results", capsys)
    assert "model.safetensors: its first 8 bytes are no header length within its 4096 bytes" in line, line
    assert str(int.from_bytes(first, "little")) not in line and "hunter2" not in line, line


RENDER = """
import sys
from study.data import chat_template
from study.data.tokenizer import TaskTokenizer

chat_template.TIMEOUT_S = 2.0
tok = TaskTokenizer.load(sys.argv[1])
print(len(tok.encode_prompt(chat_template.SAMPLE_PROMPT)))
try:
    tok.encode_prompt("sum 1+2\\n")
except ValueError as err:
    print(err)
"""


def test_a_template_that_loops_past_the_checks_is_bounded_at_render_time(valid: Path, tmp_path: Path) -> None:
    """Each prompt a run renders is rendered in a child under the check's limits, so a template that loops only on
    prompts the checks never saw stops the run at that prompt with one line (before: it hung the run for hours)."""
    import subprocess
    import sys

    directory = tmp_path / "checkpoint"
    shutil.copytree(valid, directory)
    _template(directory, LOOPS_BUT_ON_THE_SAMPLE)
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", RENDER, str(directory)], capture_output=True, text=True, timeout=60, cwd=root
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rendered, error = done.stdout.splitlines()
    assert int(rendered) > 0
    assert error.startswith("tokenizer chat template: did not render the prompt 'sum 1+2\\n' within 2 s"), error
