"""vLLM's ``truncate_prompt_tokens``: keep only a prompt's last k tokens.

Applied where prompts are tokenized (``LLM``, the HTTP API), before admission. A PIC segment cut by the truncation
is no longer the text whose KV the PIC store keys, so what is left of it becomes regular tokens.
"""

from __future__ import annotations

from typing import Union

from nebula_engine.pic.segments import SegmentKind, SegmentedPrompt, segment_token_lists

Prompt = Union[list[int], SegmentedPrompt]


def truncate_prompt(prompt: Prompt, keep: int | None, max_model_len: int) -> Prompt:
    """``prompt``'s last ``keep`` tokens (-1: ``max_model_len``; None: all of them)."""
    if keep is None:
        return prompt
    keep = max_model_len if keep == -1 else keep
    token_ids = prompt.token_ids if isinstance(prompt, SegmentedPrompt) else prompt
    if len(token_ids) <= keep:
        return prompt
    start = len(token_ids) - keep
    if not isinstance(prompt, SegmentedPrompt):
        return list(prompt[start:])
    pieces = []
    for segment in prompt.segments:
        if segment.end <= start:
            continue
        cut = segment.start < start
        kind = SegmentKind.REGULAR if cut else segment.kind
        pieces.append((kind, prompt.token_ids[max(segment.start, start):segment.end]))
    return segment_token_lists(pieces)
