"""The task tokenizer: exact round trips, single-digit tokens, fixed special ids, vocabulary size, save/load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from study.core.model_config import preset
from study.data.tasks import EVAL_SPLITS, TASKS, eval_set, make_task
from study.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    MIN_VOCAB_SIZE,
    PAD_ID,
    TaskTokenizer,
    build_tokenizer,
    task_corpus,
    train_tokenizer,
)


@pytest.fixture(scope="module", params=["tiny", "default"])
def tok(request: pytest.FixtureRequest) -> TaskTokenizer:
    return build_tokenizer(preset(request.param).vocab_size, n_per_task=300)


def _task_texts() -> list[tuple[str, str]]:
    items = [i for t in TASKS for s in EVAL_SPLITS for i in eval_set(t, s, size=32)]
    items += [i for t in TASKS for i in make_task(t, seed=11).take(32)]
    return [(i.prompt, i.solution) for i in items]


def test_task_text_round_trips_exactly(tok: TaskTokenizer) -> None:
    for prompt, solution in _task_texts():
        for text in (prompt, solution, prompt + solution):
            assert tok.decode(tok.encode(text)) == text


def test_prompt_and_response_encode_separately_as_together(tok: TaskTokenizer) -> None:
    for prompt, solution in _task_texts():
        ids, n_prompt = tok.encode_example(prompt, solution)
        assert ids == [BOS_ID, *tok.encode(prompt + solution), EOS_ID]
        assert ids[:n_prompt] == tok.encode_prompt(prompt) and ids[n_prompt:] == tok.encode_response(solution)


@given(st.text(max_size=200))
def test_any_text_round_trips(text: str) -> None:  # byte level: user data never hits an unknown token
    tok = _small_tokenizer()
    assert tok.decode(tok.encode(text)) == text


_SMALL: list[TaskTokenizer] = []


def _small_tokenizer() -> TaskTokenizer:
    if not _SMALL:
        _SMALL.append(build_tokenizer(512, ["chain_sum"], n_per_task=200))
    return _SMALL[0]


def test_digits_are_single_tokens(tok: TaskTokenizer) -> None:
    vocab = tok.tokenizer.get_vocab()
    with_digits = sorted(t for t in vocab if any(c in "0123456789" for c in t))
    assert with_digits == list("0123456789")  # no merged token contains a digit
    assert len(tok.encode("1234567890")) == 10
    assert len(tok.encode("-4096")) == 5
    sol = make_task("chain_sum", terms=6, digits=3).take(1)[0].solution
    assert sum(c.isdigit() for c in sol) <= len(tok.encode(sol))


def test_vocab_size_and_special_ids(tok: TaskTokenizer) -> None:
    model_vocab = {512: "tiny", 1024: "default"}
    assert tok.vocab_size in model_vocab  # the task corpus is rich enough to fill the target exactly
    assert max(tok.tokenizer.get_vocab().values()) == tok.vocab_size - 1
    assert (tok.tokenizer.token_to_id("<pad>"), tok.tokenizer.token_to_id("<bos>")) == (PAD_ID, BOS_ID)
    assert tok.tokenizer.token_to_id("<eos>") == EOS_ID
    ids = tok.encode_prompt("sum 1+2\n")
    assert ids[0] == BOS_ID and BOS_ID not in ids[1:]
    assert tok.encode_response("1+2=3\n#### 3")[-1] == EOS_ID
    assert tok.encode_response("1+2", eos=False)[-1] != EOS_ID


def test_vocab_never_exceeds_the_target() -> None:
    small = train_tokenizer(task_corpus(["chain_sum"], n_per_task=50), vocab_size=4096)
    assert MIN_VOCAB_SIZE <= small.vocab_size < 4096  # a narrow corpus runs out of merges: fewer ids, never more
    for target in (MIN_VOCAB_SIZE, 300, 512):
        assert train_tokenizer(task_corpus(["gsm_symbolic"], n_per_task=100), vocab_size=target).vocab_size == target


@pytest.mark.parametrize("bad", [0, 258, 512.0, True, "512"])
def test_bad_vocab_size_raises(bad: object) -> None:
    with pytest.raises(ValueError, match=rf"vocab_size = {bad!r}; valid: an int >= 259"):
        train_tokenizer(["x"], vocab_size=bad)  # type: ignore[arg-type]


def test_empty_corpus_raises() -> None:
    with pytest.raises(ValueError, match="corpus is empty"):
        train_tokenizer([], vocab_size=512)


def test_decode_response_stops_at_eos_and_flags_truncation() -> None:
    tok = _small_tokenizer()
    body = tok.encode("3+4=7\n#### 7")
    assert tok.decode_response([*body, EOS_ID, *tok.encode("junk"), PAD_ID]) == ("3+4=7\n#### 7", True)
    assert tok.decode_response(body[:-1]) == ("3+4=7\n#### ", False)  # cut at the length limit, as it stands


def test_training_is_deterministic() -> None:
    corpus = task_corpus(["chain_sum", "countdown"], n_per_task=200)
    assert train_tokenizer(corpus, vocab_size=512).to_json() == train_tokenizer(corpus, vocab_size=512).to_json()
    assert task_corpus(["chain_sum", "countdown"], n_per_task=200) == corpus


def test_save_load_identical(tok: TaskTokenizer, tmp_path: Path) -> None:
    tok.save(tmp_path / "ckpt", model_max_length=256)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((tmp_path / "ckpt" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["model_max_length"] == 256
    loaded = TaskTokenizer.load(tmp_path / "ckpt")
    assert loaded.to_json() == tok.to_json()
    for prompt, solution in _task_texts()[:50]:
        assert loaded.encode_example(prompt, solution) == tok.encode_example(prompt, solution)
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        TaskTokenizer.load(tmp_path)


@pytest.mark.slow
def test_transformers_loads_the_saved_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = _small_tokenizer()
    tok.save(tmp_path, model_max_length=256)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert len(hf) == tok.vocab_size and hf.model_max_length == 256
    for prompt, solution in _task_texts()[:50]:
        ids = hf(prompt + solution)["input_ids"]
        assert ids == tok.encode_prompt(prompt + solution)  # text encoding adds <bos>, like encode_prompt
        assert hf.decode(ids, skip_special_tokens=True) == prompt + solution
