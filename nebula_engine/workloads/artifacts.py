"""Splitting prompt text at embedded artifacts (code files, quoted ideas/comments/reports).

ChatDev phase prompts paste artifacts produced earlier (``main.py`` + a fenced block, ``Comments on
Codes: "..."``) into new templates; the artifact is the reusable part, the template text around it is
not. ``split_artifacts`` returns the text in order as (is_artifact, text) pieces.
"""

from __future__ import annotations

import re

# an optional file-name line (phase prompts open the quoted code list right before it), then a fenced block
CODE_BLOCK = re.compile(r'(?:(?:^|(?<=^"))[\w./-]+\.\w+[ \t]*\n)?^```[^\n]*\n.*?^```[ \t]*$',
                        re.MULTILINE | re.DOTALL)
# `Label: "..."` with the quote closing at the end of a line; the label stays in the template
QUOTED_FIELD = re.compile(r'^[A-Z][A-Za-z ]{1,40}:\s*"(.+?)"\.?[ \t]*$', re.MULTILINE | re.DOTALL)
MIN_ARTIFACT_CHARS = 64  # shorter quotes (modality, language, empty ideas) are template-like


def split_artifacts(text: str) -> list[tuple[bool, str]]:
    pieces: list[tuple[bool, str]] = []
    for is_code, chunk in _split(text, CODE_BLOCK, group=0):
        if is_code:
            pieces.append((True, chunk))
        else:
            pieces.extend(_split(chunk, QUOTED_FIELD, group=1))
    return [(is_artifact, piece) for is_artifact, piece in pieces if piece.strip()]


def _split(text: str, pattern: re.Pattern, group: int) -> list[tuple[bool, str]]:
    pieces, cursor = [], 0
    for match in pattern.finditer(text):
        start, end = match.span(group)
        if end - start < MIN_ARTIFACT_CHARS:
            continue
        pieces += [(False, text[cursor:start]), (True, text[start:end])]
        cursor = end
    pieces.append((False, text[cursor:]))
    return pieces
