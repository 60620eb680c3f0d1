from nebula_engine.workloads.request import SegmentKind
from nebula_engine.workloads.segments import (
    LoadOptions, SegmentFactory, estimate_num_tokens, synthetic_token_ids, text_content_id,
)


def test_text_content_id_is_stable_and_ignores_trailing_whitespace():
    assert text_content_id("def f():\n    pass\n") == text_content_id("\ndef f():   \n    pass")
    assert text_content_id("a b") != text_content_id("a  b")
    assert text_content_id("hello") == "text:" + "9555e8555c62dcfd"  # xxh3_64, pinned across releases


def test_estimate_is_ceil_of_chars_over_four():
    assert [estimate_num_tokens("x" * n) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]


def test_synthetic_token_ids_are_deterministic_per_id():
    first = synthetic_token_ids("passages_ids:7", 50)
    assert first == synthetic_token_ids("passages_ids:7", 50)
    assert first != synthetic_token_ids("passages_ids:8", 50)
    assert len(first) == 50 and all(100 <= t < 32_000 for t in first)


def test_factory_shares_one_segment_per_content_and_kind():
    factory = SegmentFactory(LoadOptions())
    a = factory.from_text(SegmentKind.PIC, "some tool output")
    assert factory.from_text(SegmentKind.PIC, "some tool output  ") is a
    assert a.num_tokens == 4 and a.token_ids is None
    assert factory.from_text(SegmentKind.REGULAR, "some tool output").kind is SegmentKind.REGULAR


def test_factory_uses_a_given_tokenizer_for_counts_and_ids():
    calls = []

    def tokenizer(text):
        calls.append(text)
        return [len(word) for word in text.split()]

    factory = SegmentFactory(LoadOptions(tokenizer=tokenizer, with_token_ids=True))
    segment = factory.from_text(SegmentKind.PIC, "one three fives")
    factory.from_text(SegmentKind.PIC, "one three fives")
    assert segment.num_tokens == 3 and segment.token_ids == (3, 5, 5)
    assert calls == ["one three fives"]  # tokenized once


def test_factory_synthesizes_ids_only_when_asked():
    without = SegmentFactory(LoadOptions()).from_trace(SegmentKind.PIC, "history:1", 12)
    with_ids = SegmentFactory(LoadOptions(with_token_ids=True)).from_trace(SegmentKind.PIC, "history:1", 12)
    assert without.token_ids is None
    assert with_ids.token_ids == synthetic_token_ids("history:1", 12)
