"""vLLM-shaped per-token logprobs (``{token_id: Logprob(logprob, rank, decoded_token)}`` per generated token) ->
OpenAI's two shapes: chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}`` and completions' parallel
lists (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``); prompt logprobs keep vLLM's shape.

An echoed prompt's tokens come first in completions' lists (``echo_logprobs``). ``-inf`` becomes -9999.0, as vLLM sends it (JSON has no infinity). The ``top_logprobs`` of a token are the
``top`` most likely entries, which may or may not include the sampled token.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

from nebula_engine.server.protocol import CompletionLogprobs, TokenLogprob, TopLogprob

TokenText = Callable[[int], str]  # a token id -> its text
PositionLogprobs = Mapping[int, Any]  # token id -> Logprob (.logprob, .rank, .decoded_token)
FLOOR = -9999.0


class TokenIdText:
    """vLLM's ``return_tokens_as_token_ids``: every token is named ``token_id:<id>``, whatever it decodes to (so a
    client can tell apart tokens whose text is not valid UTF-8 alone)."""

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}"


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[PositionLogprobs], top: int,
                  token_text: TokenText) -> list[TokenLogprob]:
    entries = []
    for token_id, position in zip(token_ids, logprobs):
        text = _text(token_id, position, token_text)
        entries.append(TokenLogprob(token=text, logprob=_value(position[token_id]), bytes=list(text.encode()),
                                    top_logprobs=[TopLogprob(token=t, logprob=v, bytes=list(t.encode()))
                                                  for t, v in _top(position, top, token_text)]))
    return entries


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[PositionLogprobs], top: int,
                        token_text: TokenText, text_offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for token_id, position in zip(token_ids, logprobs):
        text = _text(token_id, position, token_text)
        out.tokens.append(text)
        out.token_logprobs.append(_value(position[token_id]))
        out.top_logprobs.append(dict(_top(position, top, token_text)) if top else None)
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out


def echo_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs | None] | None, top: int,
                  token_text: TokenText) -> CompletionLogprobs:
    """Completions' logprobs of an echoed prompt: each prompt token (its text, offsets from 0), the first with a
    ``null`` logprob and top entry (nothing predicts it), as OpenAI's legacy API echoed them."""
    out = CompletionLogprobs()
    offset = 0
    for index, token_id in enumerate(token_ids):
        position = positions[index] if positions is not None and index < len(positions) else None
        text = _text(token_id, position or {}, token_text)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if position is None or token_id not in position:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_value(position[token_id]))
        out.top_logprobs.append(dict(_top(position, top, token_text)) if top else None)
    return out


def prompt_logprobs(positions: Sequence[PositionLogprobs | None] | None) -> list[dict[int, Any] | None] | None:
    """vLLM's own shape for prompt logprobs (one dict per prompt token, the first None), ``-inf`` floored."""
    if positions is None:
        return None
    return [None if position is None else
            {token_id: {"logprob": _value(p), "rank": p.rank, "decoded_token": p.decoded_token}
             for token_id, p in position.items()}
            for position in positions]


def _top(position: PositionLogprobs, top: int, token_text: TokenText) -> list[tuple[str, float]]:
    ranked = sorted(position.items(), key=lambda item: -item[1].logprob)[:top]
    return [(_text(token_id, position, token_text), _value(logprob)) for token_id, logprob in ranked]


def _text(token_id: int, position: PositionLogprobs, token_text: TokenText) -> str:
    if isinstance(token_text, TokenIdText):
        return token_text(token_id)
    decoded = getattr(position.get(token_id), "decoded_token", None)
    return decoded if decoded is not None else token_text(token_id)


def _value(logprob: Any) -> float:
    return FLOOR if math.isnan(logprob.logprob) else max(logprob.logprob, FLOOR)
