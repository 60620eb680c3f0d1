"""No development history in the project's text: code, docs and tests speak to users about what is true now.

Every tracked text file (``git ls-files``; binaries, the bundled trace data under ``nebula_engine/data/`` and this
file are skipped) is searched for the marks a development log leaves: numbered stops ("stop 37", "stops 30-32",
"at stop"), issue numbers ("issue #12", "(#13)"), and notes of a working session ("this session", "session
note"). Ordinary words pass: stop strings, stop tokens, non-stop, a task id such as ``r#0/lead``, an upstream
bug named by its URL.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIPPED_DIRS = ("nebula_engine/data/",)  # bundled trace data: text that is not ours
THIS_FILE = "tests/test_no_history.py"

# what "stop" names in a log of development and never in this engine's vocabulary, where a stop is a string, a
# token id, a sequence or a reason
_STOP_NOUNS = r"(?:strings?|tokens?|ids?|sequences?|words?|reasons?|criteria|conditions?|signals?|events?|flags?)"
HISTORY = {
    "a numbered development stop": re.compile(r"\bstops?[ \t]+\d+", re.IGNORECASE),
    "a development stop": re.compile(
        rf"\b(?:at|this|that|previous|earlier|later|last)[ \t]+stop\b(?![ \t-]+{_STOP_NOUNS}\b)(?!-)",
        re.IGNORECASE),
    "an issue number": re.compile(r"\b(?:issues?|PR|pull request)[ \t]*\(?#\d+", re.IGNORECASE),
    "an issue reference": re.compile(r"(?<![\w&/#'\"])#\d+\b(?![\w-])"),
    "a working session": re.compile(r"\b(?:this|that|last|previous|earlier)[ \t]+session\b(?![ \t-]*(?:id|key|cookie|"
                                    r"object|token)s?\b)|\bsession[ \t]+notes?\b", re.IGNORECASE),
}


def history_mentions(text: str) -> list[tuple[int, str, str]]:
    """(line number, what it is, the matched words) for each mark of development history in ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        spans: list[tuple[int, int]] = []
        for what, pattern in HISTORY.items():
            for match in pattern.finditer(line):
                if not any(start <= match.start() and match.end() <= end for start, end in spans):  # "issue #12" once
                    spans.append(match.span())
                    found.append((number, what, match.group(0)))
    return found


def tracked_text_files() -> list[Path]:
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    paths = []
    for name in listing.decode().split("\0"):
        if not name or name == THIS_FILE or name.startswith(SKIPPED_DIRS):
            continue
        path = ROOT / name
        if path.is_file() and not path.is_symlink():  # a file moved in the working tree is listed until committed
            paths.append(path)
    return paths


def read_text(path: Path) -> str | None:
    """The file's text; None for a binary (a NUL byte, or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def in_git_checkout() -> bool:
    if shutil.which("git") is None:
        return False
    probe = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=ROOT, capture_output=True, text=True)
    return probe.returncode == 0 and probe.stdout.strip() == "true"


@pytest.mark.skipif(not in_git_checkout(), reason="needs a git checkout to list the tracked files")
def test_no_development_history_in_tracked_text_files():
    mentions = []
    for path in tracked_text_files():
        text = read_text(path)
        for number, what, words in history_mentions(text or ""):
            mentions.append(f"{path.relative_to(ROOT)}:{number}: {what} ({words!r})")
    assert not mentions, ("development history in tracked files; say what is true now instead:\n"
                          + "\n".join(mentions))


@pytest.mark.parametrize("text", [
    "At stop 37 the planner changed.", "stops 30–32 took 7 minutes", "measured at stop 28", "on stop 22's code",
    "As at stop, the lead waits.", "this stop changed the sampler", "the previous stop's runs", "STOP 4 was slower",
    "issue #12 asks for it", "the issue (#13) bar", "before #11's bounds", "README #13", "see PR #7",
    "this session's machine", "the machine was slower this session", "a session note", "Session notes:",
])
def test_history_is_found(text):
    assert history_mentions(text), text


@pytest.mark.parametrize("text", [
    "stop strings end the output", "a stop token id", "the stop_token_ids field", "non-stop streaming",
    "stop: at most 4 strings", "`stop` holds at most 4 strings", "at stop tokens the sequence ends",
    'task_id="r#0/lead"', "https://github.com/psf/requests/issues/3829", "color='#333'", "C# 12", "&#39;",
    "the HTTP session is closed", "this session id", "#include <torch/extension.h>", "# 1. heading", "stop-and-go",
    "stop(); start()", "the last stop string", "at stop-sequence boundaries",
])
def test_ordinary_words_pass(text):
    assert not history_mentions(text), history_mentions(text)
