"""Per-request sampling and stopping settings (vLLM's ``SamplingParams`` names and defaults).

Every field is checked against what the engine can hold, so a bad value is a ``ValueError`` when the request is
made, never a failure inside an engine step. The HTTP API checks the same bounds (and OpenAI's narrower
temperature range) before it builds one of these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

from nebula_engine.engine.structured_outputs import StructuredOutputsParams

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1  # torch.Generator seeds and torch.long tensors hold this range
INT32_MAX = 2 ** 31 - 1
MAX_TOP_K = INT32_MAX  # any top_k at or above the vocabulary size keeps every token
MAX_N = 128  # completions per request: OpenAI's API refuses n above 128
MAX_TOKEN_ID = INT32_MAX  # the real bound is the vocabulary, which admission checks (engine.admission.admit)
MAX_STOP_SEQUENCES = 4  # OpenAI's API reference: "Up to 4 sequences"; TGI's default --max-stop-sequences
# a stream holds back len(longest stop) - 1 characters and each new token's stop search looks that far back;
# stop markers in practice (role tags, newlines, code fences) are a few dozen characters at most
MAX_STOP_CHARS = 1024
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs; OpenAI's top_logprobs maximum (the server's default limit)
MAX_BAD_WORD_TOKENS = 64  # a bad word is matched against the output's last tokens on every step
MAX_PENALTY = 2.0  # presence / frequency penalties: OpenAI's and vLLM's range is [-2, 2]
SAMPLING_EPS = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS): 1/T would overflow fp32


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    n: int = 1  # independent completions of the prompt, each its own sequence (seed + index when seeded)
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence among the generated tokens
    repetition_penalty: float = 1.0  # HF / CTRL: divides positive (multiplies negative) logits of prompt + output tokens
    temperature: float = 1.0  # 0 => greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 => no top-k
    min_p: float = 0.0  # drop tokens below min_p * the most likely token's probability (after temperature)
    seed: int | None = None
    stop: Sequence[str] | str | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0  # EOS and stop_token_ids are masked, and no stop ends the output, before this many tokens
    logprobs: int | None = None  # None: none; k: each generated token's logprob and the top k
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob (after the first) and the top k
    logit_bias: Mapping[int, float] | None = None  # token id -> added to its logit before sampling
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output to a JSON schema, regex, ...
    include_stop_str_in_output: bool = False  # a stop string that ends the output stays in its text
    spaces_between_special_tokens: bool = True  # slow tokenizers only (fast ones, every packaged model's, ignore it)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: max_model_len); tokenizers
    # of prompts apply it (LLM.generate / chat, the HTTP API), admission does not
    bad_words: Sequence[str] | None = None  # words never generated: the last token of each is banned after the rest
    allowed_token_ids: Sequence[int] | None = None  # only these tokens may be sampled
    # bad_words as token ids, each with and without a leading space (vLLM's); set from the engine's tokenizer
    bad_words_token_ids: Sequence[Sequence[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        for name in ("bad_words", "allowed_token_ids"):
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
                    raise ValueError(f"{name} must be a list, got {type(value).__name__}")
                object.__setattr__(self, name, tuple(value))
        if self.bad_words_token_ids is not None:
            object.__setattr__(self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids))
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ValueError(f"logit_bias must map token ids to numbers, got {type(self.logit_bias).__name__}")
            object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        self._validate()

    def _validate(self) -> None:
        check_int("n", self.n, 1, MAX_N)
        check_int("max_tokens", self.max_tokens, 1, INT64_MAX)
        check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        check_float("temperature", self.temperature, 0.0, math.inf)
        check_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0:
            raise ValueError("top_p must be in (0, 1], got 0")
        check_int("top_k", self.top_k, -1, MAX_TOP_K)
        check_float("min_p", self.min_p, 0.0, 1.0)
        check_float("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        check_float("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        check_float("repetition_penalty", self.repetition_penalty, 0.0, math.inf)
        if self.repetition_penalty == 0:
            raise ValueError("repetition_penalty must be greater than 0, got 0")
        if self.seed is not None:
            check_int("seed", self.seed, INT64_MIN, INT64_MAX)
        for name in ("logprobs", "prompt_logprobs"):  # the HTTP API caps them at its --max-logprobs
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 0, MAX_TOKEN_ID)  # above the vocabulary: every token
        for token_id, bias in (self.logit_bias or {}).items():
            check_int("logit_bias token id", token_id, 0, MAX_TOKEN_ID)
            check_float("logit_bias value", bias, -math.inf, math.inf)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be StructuredOutputsParams, "
                             f"got {type(self.structured_outputs).__name__}")
        self._validate_stops()
        self._validate_token_filters()
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, INT64_MAX)

    def _validate_token_filters(self) -> None:
        for word in self.bad_words or ():
            if not isinstance(word, str) or not 0 < len(word) <= MAX_STOP_CHARS:
                raise ValueError(f"bad_words must hold non-empty strings of at most {MAX_STOP_CHARS} characters, "
                                 f"got {word!r:.80}")
            check_unicode("bad_words", word)
        for ids in self.bad_words_token_ids or ():
            if not 0 < len(ids) <= MAX_BAD_WORD_TOKENS:
                raise ValueError(f"bad_words: each word must be 1 to {MAX_BAD_WORD_TOKENS} tokens, got {len(ids)}")
            for token_id in ids:
                check_int("bad_words token id", token_id, 0, MAX_TOKEN_ID)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (no token could be sampled)")
            for token_id in self.allowed_token_ids:
                check_int("allowed_token_ids", token_id, 0, MAX_TOKEN_ID)

    def _validate_stops(self) -> None:
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise ValueError(f"stop holds {len(self.stop)} strings; at most {MAX_STOP_SEQUENCES} are allowed")
        for stop in self.stop:
            if not isinstance(stop, str) or not 0 < len(stop) <= MAX_STOP_CHARS:
                raise ValueError(f"stop must hold non-empty strings of at most {MAX_STOP_CHARS} characters, "
                                 f"got {stop!r:.80}")
            check_unicode("stop", stop)
        for token_id in self.stop_token_ids:
            check_int("stop_token_ids", token_id, 0, MAX_TOKEN_ID)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def for_completion(self, index: int) -> SamplingParams:
        """The params of completion ``index`` of an ``n > 1`` request: ``n=1`` and, when seeded, ``seed + index``
        (as vLLM's parallel sampling), wrapped into the int64 range."""
        seed = None if self.seed is None else (self.seed + index - INT64_MIN) % 2 ** 64 + INT64_MIN
        return replace(self, n=1, seed=seed)

    def with_bad_words_tokenized(self, encode: Callable[[str], list[int]]) -> SamplingParams:
        """These params with ``bad_words_token_ids`` made from ``bad_words`` by ``encode`` (no special tokens), as
        vLLM does: each word as written (leading spaces stripped) and with one leading space, when that is a
        different tokenization of the same length. Unchanged when there are no bad words or they are tokenized."""
        if not self.bad_words or self.bad_words_token_ids is not None:
            return self
        words: list[list[int]] = []
        for word in self.bad_words:
            plain = encode(word.lstrip())
            if plain:
                words.append(plain)
            spaced = encode(" " + word.lstrip())
            if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                words.append(spaced)
        return replace(self, bad_words_token_ids=tuple(tuple(w) for w in words))

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def check_int(name: str, value: object, low: int, high: int) -> None:
    """ValueError unless ``value`` is an int (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r:.40}")


def check_float(name: str, value: object, low: float, high: float) -> None:
    """ValueError unless ``value`` is a finite real number in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise ValueError(f"{name} must be a finite number in [{low}, {high}], got {value!r:.40}")


def check_unicode(name: str, text: str) -> None:
    """ValueError if ``text`` holds a lone surrogate (JSON can carry one; no tokenizer can encode it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name} is not valid Unicode: lone surrogate U+{ord(text[exc.start]):04X} "
                         f"at index {exc.start}") from None
