"""The fictional-fact RAG prompts of tools/pic_quality.py --prompts facts: answerable only from their documents."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from fictional_facts import QUESTIONS, FactPrompt  # noqa: E402


def test_each_prompt_asks_one_fact_stated_in_exactly_one_moved_document():
    for seed in range(50):
        prompt = FactPrompt.random(seed)
        assert 4 <= len(prompt.organisations) <= 6 and prompt.order != tuple(sorted(prompt.order))
        assert sorted(prompt.order) == list(range(len(prompt.organisations)))
        holders = [doc for doc in prompt.documents if prompt.answer in doc]
        assert prompt.documents[prompt.asked] in holders and prompt.fact in QUESTIONS
        user = prompt.messages()[1]["content"]
        assert user.count("<pic>") == len(prompt.organisations) and user.endswith(prompt.question)
        assert user.index(prompt.documents[prompt.order[0]]) < user.index(prompt.documents[prompt.order[1]])


def test_answers_are_checked_case_insensitively_in_the_reply():
    prompt = FactPrompt.random(3)
    assert prompt.is_correct(f"It is {prompt.answer.upper()}.") and not prompt.is_correct("I do not know.")


def test_prompts_are_reproducible_from_their_seed():
    assert FactPrompt.random(7) == FactPrompt.random(7) and FactPrompt.random(7) != FactPrompt.random(8)


def test_background_sentences_lengthen_documents_without_touching_the_facts():
    for seed in range(20):
        short, long = FactPrompt.random(seed), FactPrompt.random(seed, detail_sentences=12)
        assert [o.name for o in long.organisations] == [o.name for o in short.organisations]  # same facts drawn
        assert (long.order, long.asked, long.fact, long.answer) == (short.order, short.asked, short.fact, short.answer)
        for brief, full in zip(short.documents, long.documents):
            details = full[len(brief):]
            assert full.startswith(brief) and details.count(". ") >= 11
            assert not any(ch.isdigit() for ch in details)  # no second year or head count to confuse a question


def test_more_background_sentences_than_there_are_is_a_clear_error():
    with pytest.raises(ValueError, match="0 to 12, got 13"):
        FactPrompt.random(1, detail_sentences=13)
    with pytest.raises(ValueError, match="got -1"):
        FactPrompt.random(1, detail_sentences=-1)
