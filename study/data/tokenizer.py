"""The policy's tokenizer: byte-level BPE trained offline with `tokenizers` on the task corpus.

- Byte level: the 256 byte tokens are always in the vocabulary, so any text (user data included) round-trips exactly.
- Every digit is its own token (digits are split off before BPE and never merged), so a tiny model can learn
  arithmetic digit by digit.
- Special tokens with fixed ids: <pad> = 0, <bos> = 1, <eos> = 2. A prompt is <bos> + text; a response is text +
  <eos>. A tokenizer loaded from another checkpoint's files (an HF model's tokenizer.json with tokenizer_config.json
  / special_tokens_map.json) takes its special tokens and ids from those files instead: `pad_id`, `bos_id` (None:
  prompts get no prefix) and `eos_id` are per instance; the module constants are the study's own ids.
  A checkpoint whose tokenizer_config.json (or chat_template.jinja) has a chat template formats each prompt with it
  (one user message, the generation prompt appended, as transformers' apply_chat_template does), so an instruct
  model sees prompts the way it was trained to.
  Prompts end with a newline and responses start with a non-space character, so the two encode separately
  exactly as they encode together (the newline is a pre-token boundary).
- Vocabulary: at most the model's `ModelConfig.vocab_size` (fewer when the corpus runs out of pairs to merge; the
  model's extra embedding rows are padding).
- Deterministic: the same corpus and vocabulary size give the same tokenizer.json, byte for byte.

`save(directory)` writes tokenizer.json, tokenizer_config.json and special_tokens_map.json, which
transformers' `AutoTokenizer.from_pretrained(directory)` (and so vLLM) loads as a PreTrainedTokenizerFast; its
text encoding adds <bos> like `encode_prompt`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from runfiles.atomic import atomic_write
from runfiles.bounded import json_file_problem, load_json, read_json, read_text
from study.data import chat_template

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS)
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
"""Bytes plus special tokens: the smallest vocabulary that can encode every text."""
MAX_TOKENIZER_BYTES = 256 << 20
"""Largest tokenizer.json read (a large model's is tens of MB)."""
PROMPT_S = 0.01
"""Seconds `prompt_lengths` allows each prompt's render and encoding, beyond chat_template.TIMEOUT_S for the child's
start and the tokenizer's load (a real tokenizer takes well under a millisecond)."""

_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class TaskTokenizer:
    """A trained `tokenizers.Tokenizer` with the study's special tokens and encode/decode helpers."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        specials: Mapping[str, str | None] | None = None,
        chat_template: str | None = None,
    ) -> None:
        """`specials` None: the study's <pad>/<bos>/<eos> at their fixed ids 0/1/2 (checked). Otherwise the
        `pad_token` / `bos_token` / `eos_token` names of a checkpoint's tokenizer files: eos is required, a missing
        bos means prompts get no prefix, a missing pad pads with eos. `chat_template`: a checkpoint's Jinja chat
        template; prompts are then formatted with it (`format_prompt`)."""
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        if specials is None:
            for token, expected in zip(SPECIAL_TOKENS, (PAD_ID, BOS_ID, EOS_ID), strict=True):
                got = tokenizer.token_to_id(token)
                if got != expected:
                    raise ValueError(f"tokenizer: special token {token} has id {got}; expected {expected}")
            self.specials: dict[str, str | None] = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
            self.pad_id, self.bos_id, self.eos_id = PAD_ID, BOS_ID, EOS_ID
            return
        ids: dict[str, int | None] = {}
        for key in ("pad_token", "bos_token", "eos_token"):
            token = specials.get(key)
            ids[key] = None if token is None else tokenizer.token_to_id(token)
            if token is not None and ids[key] is None:
                raise ValueError(f"tokenizer: {key} {token!r} is not in the vocabulary")
        if ids["eos_token"] is None:
            raise ValueError("tokenizer: no eos_token in the tokenizer files; a response needs an end marker")
        self.specials = {k: specials.get(k) for k in ("bos_token", "eos_token", "pad_token")}
        self.eos_id: int = ids["eos_token"]
        self.bos_id: int | None = ids["bos_token"]
        self.pad_id: int = ids["pad_token"] if ids["pad_token"] is not None else self.eos_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids in use (special tokens included); ids are 0 .. vocab_size-1."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens; ValueError in one line where the tokenizers library panics (a
        split rule whose regex backtracks past its retry limit)."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        except BaseException as err:  # pyo3's PanicException derives from BaseException
            if type(err).__name__ != "PanicException":
                raise
            raise ValueError(f"tokenizer: cannot encode a text ({' '.join(str(err).split())[:300]})") from None

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens dropped."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def format_prompt(self, prompt: str) -> str:
        """The prompt as the model reads it: with a chat template, one user message and the generation prompt
        (the template adds its own special tokens), rendered in a child process under a time and memory limit
        (study.data.chat_template.bounded_render); else the prompt itself."""
        if self.chat_template is None:
            return prompt
        return chat_template.bounded_render(self.chat_template, prompt, self.specials)

    def encode_prompt(self, prompt: str) -> list[int]:
        """<bos> + prompt (just the prompt for a tokenizer without bos); with a chat template, the formatted prompt
        (`format_prompt`), its special tokens written by the template."""
        if self.chat_template is not None:
            return self.encode(self.format_prompt(prompt))
        return [*([self.bos_id] if self.bos_id is not None else []), *self.encode(prompt)]

    def encode_response(self, response: str, *, eos: bool = True) -> list[int]:
        """response (+ <eos>)."""
        return [*self.encode(response), *([self.eos_id] if eos else [])]

    def encode_example(self, prompt: str, response: str) -> tuple[list[int], int]:
        """A supervised example: (<bos> prompt response <eos>, number of prompt tokens incl. <bos>)."""
        p = self.encode_prompt(prompt)
        return [*p, *self.encode_response(response)], len(p)

    def decode_response(self, ids: Sequence[int]) -> tuple[str, bool]:
        """(text up to the first <eos>, whether an <eos> ended it). A response without <eos> ran into the length
        limit and is returned, and scored, as it stands."""
        ids = list(ids)
        ended = self.eos_id in ids
        if ended:
            ids = ids[: ids.index(self.eos_id)]
        return self.decode(ids), ended

    def save(self, directory: str | Path, *, model_max_length: int | None = None) -> None:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `directory` (created if
        needed), each atomically. `model_max_length` (the model's max_seq_len) goes into the transformers config."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        specials = {k: v for k, v in self.specials.items() if v is not None}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **specials,
            "clean_up_tokenization_spaces": False,
            "model_input_names": ["input_ids", "attention_mask"],
            "padding_side": "left",
        }
        if model_max_length is not None:
            config["model_max_length"] = model_max_length
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        contents = (self.tokenizer.to_str(pretty=True), json.dumps(config, indent=2), json.dumps(specials, indent=2))
        for name, text in zip(_FILES, contents, strict=True):
            _write_atomic(directory / name, text + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> TaskTokenizer:
        """The tokenizer saved in `directory`; special tokens from its special_tokens_map.json or
        tokenizer_config.json when present (the study's own files name <pad>/<bos>/<eos>, so ids stay 0/1/2)."""
        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer: no {path.name} in {directory}")
        try:
            text = read_text(path, max_bytes=MAX_TOKENIZER_BYTES)
            load_json(text, max_bytes=MAX_TOKENIZER_BYTES)  # the bounds (depth, duplicate keys), before the parser
            tokenizer = Tokenizer.from_str(text)
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: {json_file_problem(err)}") from None
        except Exception as err:  # the tokenizers library's own error: valid JSON that is not a tokenizer
            raise ValueError(f"{path}: not a tokenizer ({' '.join(str(err).split())[:300]})") from None
        return cls(tokenizer, specials=_special_tokens(Path(directory)), chat_template=_chat_template(Path(directory)))

    def to_json(self) -> str:
        """The tokenizer.json text (what `save` writes, less the trailing newline)."""
        return self.tokenizer.to_str(pretty=True)


def prompt_lengths(directory: str | Path, prompts: Sequence[str], *, where: str) -> list[int]:
    """The token count of each of `prompts` as the tokenizer saved in `directory` encodes it
    (`TaskTokenizer.encode_prompt`, its chat template applied), computed in a child process under the chat template's
    limits (study.data.chat_template: MEMORY_BYTES, TIMEOUT_S plus PROMPT_S a prompt), so a template that loops or a
    split rule that backtracks (or panics) on one of them is a ValueError naming `where` and the prompt, before a run
    writes anything."""
    prompts = list(prompts)
    reply = chat_template.run_child(
        "study.data.tokenizer:_lengths_child",
        {
            "directory": str(directory),
            "prompts": prompts,
            "timeout_s": chat_template.TIMEOUT_S + PROMPT_S * len(prompts),
        },
        where=where,
        subject="the tokenizer",
        task=f"render and encode the run's {len(prompts)} prompts",
        valid="a tokenizer whose split rules and chat template take well under a millisecond a prompt",
    )
    return [int(n) for n in reply["lengths"]]


def _lengths_child() -> None:
    """`prompt_lengths`' child: loads the tokenizer, encodes each prompt (the template rendered here, under the
    limits already)."""

    def lengths(request: dict[str, Any]) -> dict[str, Any]:
        tok = TaskTokenizer.load(request["directory"])
        prompts = request["prompts"]
        out = []
        for i, prompt in enumerate(prompts):
            try:
                out.append(len(tok.encode_prompt(prompt)))
            except Exception as err:  # encode's ValueError says why in one line; anything else says its type
                shown = prompt if len(prompt) <= 80 else f"{prompt[:80]}..."
                why = " ".join(str(err).split())[:300] if type(err) is ValueError else chat_template.one_line(err)
                return {"error": f"prompt {i + 1} of {len(prompts)}, {shown!r}: {why}"}
        return {"lengths": out}

    chat_template.child_main(lengths)


def _special_tokens(directory: Path) -> dict[str, str | None] | None:
    """{pad,bos,eos}_token names from special_tokens_map.json, else tokenizer_config.json (a value may be a string
    or transformers' {"content": ...} object); None when neither file exists (the study's fixed ids apply)."""
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = directory / name
        if path.is_file():
            data = _json_object(path)
            out: dict[str, str | None] = {}
            for key in ("pad_token", "bos_token", "eos_token"):
                value = data.get(key)
                out[key] = value.get("content") if isinstance(value, dict) else value
                if out[key] is not None and not isinstance(out[key], str):
                    raise ValueError(f"{path}: {key} = {str(value)[:100]}; valid: a token (a string)")
            if out["eos_token"] is not None:
                return out
    return None


def _chat_template(directory: Path) -> str | None:
    """The checkpoint's chat template: chat_template.jinja, else tokenizer_config.json's `chat_template` (a string,
    or a list of {name, template} of which the one named "default"); None when it has none."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        try:
            return read_text(jinja, max_bytes=chat_template.MAX_TEMPLATE_CHARS)
        except (OSError, ValueError) as err:  # unreadable, larger than the bound, not UTF-8
            raise ValueError(f"{jinja}: unreadable as a chat template ({err})") from None
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return None
    template = _json_object(path).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path` (runfiles.bounded's bounds); ValueError naming the file otherwise."""
    try:
        data = read_json(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: {json_file_problem(err)}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a JSON {type(data).__name__}; valid: a JSON object")
    return data


def _write_atomic(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def train_tokenizer(texts: Iterable[str], *, vocab_size: int) -> TaskTokenizer:
    """Byte-level BPE with single-digit tokens trained on `texts`, at most `vocab_size` ids."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"tokenizer vocab_size = {vocab_size!r}; valid: an int >= {MIN_VOCAB_SIZE} (256 bytes + special tokens)"
        )
    texts = list(texts)
    if not texts:
        raise ValueError("tokenizer: the training corpus is empty")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Text encoding in transformers/vLLM prepends <bos>, as encode_prompt does.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B:1", special_tokens=[(BOS, BOS_ID)]
    )
    return TaskTokenizer(tok)


def task_corpus(tasks: Sequence[str] | None = None, *, n_per_task: int = 2000, seed: int = 0) -> list[str]:
    """Tokenizer training text: prompt + solution of training items of each task (None: every generated task,
    study.data.tasks.TASKS), half at its default knobs and half at its hard knobs (so longer problems are covered
    too). Held-out evaluation prompts are not included."""
    from study.data.tasks import DEFAULT_KNOBS, HARD_KNOBS, TASKS, make_task

    if not isinstance(n_per_task, int) or n_per_task < 2:
        raise ValueError(f"tokenizer corpus n_per_task = {n_per_task!r}; valid: an int >= 2")
    texts = []
    for name in TASKS if tasks is None else tasks:
        half = n_per_task // 2
        for knobs, n in ((DEFAULT_KNOBS[name], n_per_task - half), (HARD_KNOBS[name], half)):
            texts.extend(item.prompt + item.solution for item in make_task(name, seed=seed, **knobs).take(n))
    return texts


def build_tokenizer(
    vocab_size: int, tasks: Sequence[str] | None = None, *, n_per_task: int = 2000, seed: int = 0
) -> TaskTokenizer:
    """The tokenizer for a model with `vocab_size` embedding rows, trained on `task_corpus(tasks, ...)` (None: every
    generated task)."""
    return train_tokenizer(task_corpus(tasks, n_per_task=n_per_task, seed=seed), vocab_size=vocab_size)
