"""``<pic>`` segmentation: tags, per-segment tokenization, chat templates, errors, PIC on/off ids."""

from __future__ import annotations

import pytest

from nebula_engine.pic.segments import (
    PICSyntaxError,
    PromptSegment,
    SegmentedPrompt,
    SegmentKind,
    parse_pic_tags,
    segment_chat,
    segment_prompt,
    segment_token_lists,
)
from tests.model_cases import CASES_BY_NAME, build_checkpoint

PIC, REG = SegmentKind.PIC, SegmentKind.REGULAR


def char_encode(text: str) -> list[int]:
    """One id per character: segment boundaries are visible exactly."""
    return [ord(c) for c in text]


def pair_encode(text: str) -> list[int]:
    """Merges adjacent characters into one id, like BPE: tokenizing pieces apart differs from the whole."""
    return [ord(text[i]) * 1000 + (ord(text[i + 1]) if i + 1 < len(text) else 0) for i in range(0, len(text), 2)]


def kinds_and_texts(prompt: SegmentedPrompt) -> list[tuple[SegmentKind, str]]:
    return [(s.kind, "".join(map(chr, prompt.segment_ids(s)))) for s in prompt.segments]


def test_tags_split_text_into_pic_and_regular_segments():
    prompt = segment_prompt("System: hi. <pic>doc A</pic> <pic>doc B</pic>Q?", char_encode)
    assert kinds_and_texts(prompt) == [(REG, "System: hi. "), (PIC, "doc A"), (REG, " "), (PIC, "doc B"),
                                       (REG, "Q?")]
    assert prompt.token_ids == tuple(map(ord, "System: hi. doc A doc BQ?"))
    assert prompt.segments[1] == PromptSegment(PIC, 12, 5)
    assert prompt.pic_segments == (prompt.segments[1], prompt.segments[3])


def test_adjacent_pic_segments_and_prompt_made_only_of_pic():
    prompt = segment_prompt("<pic>ab</pic><pic>cd</pic>", char_encode)
    assert kinds_and_texts(prompt) == [(PIC, "ab"), (PIC, "cd")]


def test_no_tags_is_one_regular_segment_equal_to_plain_encoding():
    text = "plain prompt, no markup"
    prompt = segment_prompt(text, pair_encode)
    assert prompt.token_ids == tuple(pair_encode(text))
    assert prompt.segments == (PromptSegment(REG, 0, len(pair_encode(text))),)


def test_each_segment_is_tokenized_alone():
    # pair_encode merges across boundaries only when given the whole text
    prompt = segment_prompt("abc<pic>def</pic>gh", pair_encode)
    assert prompt.token_ids == tuple(pair_encode("abc") + pair_encode("def") + pair_encode("gh"))
    assert prompt.token_ids != tuple(pair_encode("abcdefgh"))


def test_pic_off_keeps_token_ids():
    prompt = segment_prompt("abc<pic>def</pic>gh<pic>ijk</pic>", pair_encode)
    off = prompt.without_pic()
    assert off.token_ids == prompt.token_ids
    assert off.segments == (PromptSegment(REG, 0, len(prompt.token_ids)),)
    assert off.pic_segments == ()


def test_same_pic_text_gets_same_ids_under_different_prefixes():
    a = segment_prompt("short<pic>shared document</pic>", pair_encode)
    b = segment_prompt("a much longer prefix!<pic>shared document</pic>tail", pair_encode)
    assert a.segment_ids(a.pic_segments[0]) == b.segment_ids(b.pic_segments[0])


def test_bos_opens_first_regular_segment_once():
    prompt = segment_prompt("<pic>doc</pic>q<pic>x</pic>", char_encode, bos_token_id=1)
    assert prompt.token_ids == (1, *map(ord, "doc"), ord("q"), ord("x"))
    assert [(s.kind, s.start, s.length) for s in prompt.segments] == [
        (REG, 0, 1), (PIC, 1, 3), (REG, 4, 1), (PIC, 5, 1)]
    merged = segment_prompt("sys<pic>doc</pic>", char_encode, bos_token_id=1)
    assert merged.segments[0] == PromptSegment(REG, 0, 4)  # BOS joins the leading regular text


@pytest.mark.parametrize("text,reason,position", [
    ("a<pic>b<pic>c</pic></pic>", "nested <pic>", 7),
    ("ab<pic>never closed", "unclosed <pic>", 2),
    ("abc</pic>", "</pic> without <pic>", 3),
    ("<pic>x</pic></pic>", "</pic> without <pic>", 12),
    ("hello <pic></pic>", "empty <pic></pic>", 6),
])
def test_malformed_markup_names_the_position(text, reason, position):
    with pytest.raises(PICSyntaxError) as err:
        segment_prompt(text, char_encode)
    assert (err.value.reason, err.value.position, err.value.message_index) == (reason, position, None)
    assert isinstance(err.value, ValueError) and f"character {position}" in str(err.value)


def test_tag_like_text_is_not_a_tag():
    spans = parse_pic_tags("<PIC>x</PIC> <pic >y")
    assert [(s.kind, s.text) for s in spans] == [(REG, "<PIC>x</PIC> <pic >y")]


def test_explicit_token_segments_merge_regular_neighbours():
    prompt = segment_token_lists([("regular", [1, 2]), ("regular", []), ("regular", [3]), ("pic", [7, 8]),
                                  (PIC, [9])], bos_token_id=0)
    assert prompt.token_ids == (0, 1, 2, 3, 7, 8, 9)
    assert prompt.segments == (PromptSegment(REG, 0, 4), PromptSegment(PIC, 4, 2), PromptSegment(PIC, 6, 1))
    with pytest.raises(ValueError):
        segment_token_lists([("pic", [])])


def test_a_workloads_prefix_kind_is_no_prompt_segment_kind():
    for segments in ([("prefix", [1, 2])], [(SegmentKind.PREFIX, [])]):
        with pytest.raises(ValueError, match="regular"):
            segment_token_lists(segments)
    with pytest.raises(ValueError, match="regular"):
        SegmentedPrompt((1, 2), (PromptSegment(SegmentKind.PREFIX, 0, 2),))


def test_segmented_prompt_rejects_gaps():
    with pytest.raises(ValueError):
        SegmentedPrompt((1, 2, 3), (PromptSegment(REG, 0, 1), PromptSegment(PIC, 2, 1)))


def toy_template(messages: list[dict]) -> str:
    return "".join(f"<{m['role']}>{m['content'] or ''}</{m['role']}>\n" for m in messages) + "<assistant>"


def test_chat_template_text_is_regular_and_pic_spans_stay_whole():
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "<pic>doc one</pic> and <pic>doc two</pic> Question?"},
                {"role": "tool", "content": "<pic>doc one</pic>"}]
    prompt = segment_chat(messages, toy_template, char_encode)
    assert kinds_and_texts(prompt) == [
        (REG, "<system>Be brief.</system>\n<user>"), (PIC, "doc one"), (REG, " and "), (PIC, "doc two"),
        (REG, " Question?</user>\n<tool>"), (PIC, "doc one"), (REG, "</tool>\n<assistant>")]


def test_chat_errors_name_the_message():
    messages = [{"role": "user", "content": "fine"}, {"role": "user", "content": "x<pic>open"}]
    with pytest.raises(PICSyntaxError) as err:
        segment_chat(messages, toy_template, char_encode)
    assert (err.value.message_index, err.value.position) == (1, 1)
    assert "message 1" in str(err.value)


def test_chat_template_that_mangles_placeholders_is_refused():
    mangled = lambda messages: toy_template(messages).replace("\ue001", "")  # noqa: E731
    with pytest.raises(ValueError, match="placeholder"):
        segment_chat([{"role": "user", "content": "<pic>doc</pic>"}], mangled, char_encode)


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory):
    from nebula_engine.engine.tokenizer import Tokenizer

    # same root as test_rope_shift: the checkpoint is written once per session
    return Tokenizer(build_checkpoint(CASES_BY_NAME["qwen3_gqa2_hd20"], tmp_path_factory.getbasetemp()))


def test_real_chat_template_and_tokenizer(qwen_tokenizer):
    encode = lambda text: qwen_tokenizer.hf.encode(text, add_special_tokens=False)  # noqa: E731
    render = lambda messages: qwen_tokenizer.apply_chat_template(messages)[0]  # noqa: E731
    doc = " Refunds use the original payment method."
    messages = [{"role": "system", "content": "You are a support assistant."},
                {"role": "user", "content": f"<pic>{doc}</pic>\nHow are refunds paid?"}]
    prompt = segment_chat(messages, render, encode)
    assert [s.kind for s in prompt.segments] == [REG, PIC, REG]
    assert prompt.segment_ids(prompt.pic_segments[0]) == tuple(encode(doc))
    # untagged, the regular text around the segment is exactly the rendered template around the document
    plain = [{**m, "content": m["content"].replace("<pic>", "").replace("</pic>", "")} for m in messages]
    full_text = render(plain)
    head, tail = full_text.split(doc)
    assert qwen_tokenizer.decode(list(prompt.token_ids), skip_special_tokens=False) == full_text
    assert prompt.token_ids == tuple(encode(head) + encode(doc) + encode(tail))
    assert prompt.without_pic().token_ids == prompt.token_ids
