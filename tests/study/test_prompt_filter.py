"""prompt_filter = mastered: a prompt whose whole group got the full reward leaves the training stream, the stream
skips it from then on, and the set survives a checkpoint; with the filter off the stream is untouched."""

from pathlib import Path

import pytest
import torch

import algorithms
from study import batch, checkpoint, rl
from study.data import tasks
from study.parts import setup
from study.run.config import load_config

SETS = ["coldstart=scratch", "eval_every=0", "checkpoint_every=0", "prompt_filter=mastered"]


def test_the_stream_skips_mastered_prompts_in_order() -> None:
    stream = tasks.make_task("chain_sum", terms=2, digits=1, seed=3)
    mastered = {stream[1].prompt, stream[2].prompt, stream[5].prompt}
    items, pos, skipped = batch.take_unmastered(stream, 4, 0, mastered)
    kept = [i for i in range(7) if stream[i].prompt not in mastered][:4]
    assert [it.prompt for it in items] == [stream[i].prompt for i in kept]
    assert pos == kept[-1] + 1 and skipped == pos - 4


def test_a_stream_of_mastered_prompts_still_yields() -> None:
    """When every prompt is mastered the stream takes one after MAX_SKIPS_PER_PROMPT skips instead of looping."""
    stream = tasks.make_task("chain_sum", terms=2, digits=1, seed=3)
    everything = {stream[i].prompt for i in range(2 * batch.MAX_SKIPS_PER_PROMPT + 2)}
    items, pos, skipped = batch.take_unmastered(stream, 2, 0, everything)
    assert len(items) == 2 and skipped == 2 * batch.MAX_SKIPS_PER_PROMPT and pos == skipped + 2


def test_prompt_filter_is_validated() -> None:
    with pytest.raises(ValueError, match=r"prompt_filter = 'solved'; valid: none, mastered"):
        load_config(preset="tiny", sets=["prompt_filter=solved"])


def test_prompt_filter_enters_the_run_id_only_when_set() -> None:
    off = load_config(preset="tiny", sets=["prompt_filter=none"])
    assert off.run_id == load_config(preset="tiny").run_id  # runs made before the field keep their ids
    assert load_config(preset="tiny", sets=["prompt_filter=mastered"]).run_id != off.run_id


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    cfg = load_config(preset="tiny", sets=SETS)
    return cfg, setup(cfg, tmp_path_factory.mktemp("filter"))


def test_collect_skips_mastered_prompts_with_the_real_engine(parts: tuple) -> None:
    cfg, p = parts
    alg = algorithms.get(cfg.algorithm)
    mastered = {p.stream[0].prompt, p.stream[2].prompt}
    got = rl._collect(cfg, alg, p.engine, p.stream, p.tok, 0, 1, mastered)
    assert got.metrics["prompts_skipped_mastered"] == 2.0
    assert got.data_pos == cfg.prompts_per_step + 2
    assert got.batch is not None
    for i in range(cfg.prompts_per_step + 2):  # the batch's rows begin with the prompts taken, never a skipped one
        ids = torch.tensor(p.tok.encode_prompt(p.stream[i].prompt))
        begins = (got.batch.input_ids[:, : len(ids)] == ids).all(1).any()
        assert bool(begins) == (i not in (0, 2)), i


def test_solved_groups_are_returned_as_mastered(parts: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scorer is made to reward every response to the stream's second prompt: only that prompt is returned."""
    cfg, p = parts
    target = p.stream[1]
    monkeypatch.setattr(rl.tasks, "score", lambda item, text: 1.0 if item.prompt == target.prompt else 0.0)
    got = rl._collect(cfg, algorithms.get(cfg.algorithm), p.engine, p.stream, p.tok, 0, 1, set())
    assert got.mastered == [target.prompt]
    assert got.metrics["zero_var_solved_frac"] == 1 / cfg.prompts_per_step


def test_the_mastered_set_is_checkpointed_and_restored(tmp_path: Path) -> None:
    cfg = load_config(preset="tiny", sets=[*SETS, "steps=2", "checkpoint_every=1"])
    run_dir = rl.run(cfg, tmp_path, progress=False)
    path = run_dir / "checkpoint" / "state.pt"
    state = checkpoint.load(path)
    assert state["mastered"] == []  # a random-weight policy solves no group
    state["mastered"] = ["2 + 3 =", "9 - 4 ="]
    torch.save(state, path)
    _, progress = checkpoint.read(run_dir, cfg.checkpoint_every)
    assert progress.mastered == {"2 + 3 =", "9 - 4 ="} and progress.data_pos == state["data_pos"]
