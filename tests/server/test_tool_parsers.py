"""Tool-call parsers on each family's format (scripted model outputs), their streaming form, and the choice of
parser from a chat template."""

from __future__ import annotations

import json

import pytest

from nebula_engine.server.tool_parsers import (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                                               NamedToolOutput, ParsedCall, RequiredToolsOutput,
                                               parser_for_template, tool_parser)
from nebula_engine.server.tool_streaming import CallDelta, ToolCallDeltas
from tests.server.tool_template import QWEN_TOOL_TEMPLATE

WEATHER = ParsedCall("get_weather", json.dumps({"city": "Paris", "unit": "celsius"}))
TIME = ParsedCall("get_time", json.dumps({"zone": "Europe/Paris"}))

# (parser, scripted output, content before the calls, calls)
CASES = [
    (HermesToolParser(), 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                         '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
                         '{"zone": "Europe/Paris"}}\n</tool_call>', "Let me check.\n", [WEATHER, TIME]),
    (HermesToolParser(), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
     None, [WEATHER]),  # EOS before the closing tag
    (MistralToolParser(), '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                          '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}]', None, [WEATHER, TIME]),
    (MistralToolParser(), '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
                          '[TOOL_CALLS]get_time[ARGS]{"zone": "Europe/Paris"}', None, [WEATHER, TIME]),
    (Llama3JsonToolParser(), '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     None, [WEATHER]),
    (Llama3JsonToolParser(), '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
                             '"celsius"}}; {"name": "get_time", "parameters": {"zone": "Europe/Paris"}}',
     None, [WEATHER, TIME]),
    (RequiredToolsOutput(), '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]',
     None, [WEATHER]),
    (NamedToolOutput("get_weather"), '{"city": "Paris", "unit": "celsius"}', None, [WEATHER]),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_each_family_format_parses_into_calls(parser, text, content, calls):
    parsed = parser.parse(text)
    assert parsed.content == content and list(parsed.calls) == calls
    assert all(json.loads(call.arguments) for call in parsed.calls)


def accumulated(deltas: list[CallDelta]) -> list[ParsedCall]:
    """The calls a client rebuilds from the deltas: the name from each call's first, the arguments concatenated."""
    names, arguments = {}, {}
    for delta in deltas:
        if delta.name is not None:
            assert delta.number not in names, "a call's name comes once, on its first delta"
            names[delta.number] = delta.name
        assert delta.number in names, "a call's first delta names it"
        arguments[delta.number] = arguments.get(delta.number, "") + delta.arguments
    return [ParsedCall(names[n], arguments[n]) for n in sorted(names)]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_streaming_one_character_at_a_time_gives_the_same_calls_and_content(parser, text, content, calls):
    deltas = ToolCallDeltas(parser)
    streamed_content, streamed, completed_at = "", [], []
    for end in range(1, len(text) + 1):
        piece, new = deltas.next(text[:end], finished=end == len(text))
        streamed_content += piece
        streamed += new
        completed_at += [end for delta in new if delta.complete]
    assert streamed_content == (content or "") and accumulated(streamed) == calls
    assert len(completed_at) == len(calls)
    # the arguments go out as they are written, in many pieces, and a call closes before the output ends
    assert sum(1 for d in streamed if d.arguments) > 2 * len(calls)
    if len(calls) > 1:
        assert completed_at[0] < len(text)


@pytest.mark.parametrize("written", [
    '{"city": "Paris", "days": [1, 2.5, -3e2], "ok": true, "note": null, "nested": {"a": "x\\"\\u00e9\\ud83d\\ude00"}}',
    '{\n  "city":"Paris" ,\n  "list" : [ ] , "empty": {}\n}', "{}"])
def test_argument_pieces_add_up_to_the_arguments_of_the_whole_call(written):
    text = '<tool_call>\n{"name": "f", "arguments": ' + written + '}\n</tool_call>'
    whole = HermesToolParser().parse(text).calls
    deltas = ToolCallDeltas(HermesToolParser())
    streamed = [d for end in range(1, len(text) + 1) for d in deltas.next(text[:end], end == len(text))[1]]
    assert accumulated(streamed) == list(whole) and whole[0].arguments == json.dumps(json.loads(written),
                                                                                     ensure_ascii=False)


def test_a_call_cut_by_max_tokens_stays_as_far_as_it_was_streamed():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    deltas = ToolCallDeltas(HermesToolParser())
    streamed = [d for end in range(1, len(text) + 1)
                for d in deltas.next(text[:end], end == len(text), truncated=end == len(text))[1]]
    assert accumulated(streamed) == [ParsedCall("get_weather", '{"city": "Par')]
    assert not any(d.complete for d in streamed)


@pytest.mark.parametrize("parser", [HermesToolParser(), MistralToolParser(), Llama3JsonToolParser()])
def test_plain_answers_and_broken_calls_are_content(parser):
    for text in ("The weather in Paris is mild.", "<tool_call>\n{not json}\n</tool_call>",
                 "[TOOL_CALLS][{oops", '{"no_name": 1}'):
        parsed = parser.parse(text)
        assert parsed.calls == () and parsed.content == text
        deltas = ToolCallDeltas(parser)
        streamed = "".join(deltas.next(text[:end], end == len(text))[0] for end in range(1, len(text) + 1))
        assert streamed == text


def test_marker_prefixes_are_held_back_until_decided():
    deltas = ToolCallDeltas(HermesToolParser())
    assert deltas.next("Sure <tool_", False) == ("Sure ", [])  # might become <tool_call>
    assert deltas.next("Sure <tool_x", False) == ("<tool_x", [])  # it did not


def test_llama3_only_reads_outputs_that_are_calls():
    assert Llama3JsonToolParser().parse('I think {"name": "f", "parameters": {}}').calls == ()


def test_the_parser_follows_the_chat_template():
    assert isinstance(parser_for_template(QWEN_TOOL_TEMPLATE), HermesToolParser)
    assert isinstance(parser_for_template("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}"), MistralToolParser)
    assert isinstance(parser_for_template('{{- \'{"name": "\' + tool_call.name + \'", "parameters": \' }}'),
                      Llama3JsonToolParser)
    assert parser_for_template("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert parser_for_template(None) is None
    assert isinstance(tool_parser("qwen3"), HermesToolParser)
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'"):
        tool_parser("nope")


def test_call_ids_fit_each_familys_template():
    assert HermesToolParser.new_call_id().startswith("chatcmpl-tool-")
    mistral_id = MistralToolParser.new_call_id()  # Mistral's template raises on any other id
    assert len(mistral_id) == 9 and mistral_id.isalnum()


def test_hermes_reads_the_bare_calls_small_qwen_coder_models_write():
    """Qwen2.5-Coder-0.5B-Instruct answers its own tool template with the call's JSON and no <tool_call> tags."""
    from nebula_engine.server.tool_parsers import HermesToolParser
    from nebula_engine.server.tool_streaming import ToolCallDeltas

    parser = HermesToolParser()
    bare = '{"name": "get_order", "arguments": {"order_id": "W1000"}}\n{"name": "f", "arguments": {}}'
    parsed = parser.parse(bare)
    assert parsed.content is None
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_order", '{"order_id": "W1000"}'), ("f", "{}")]
    for content in ('{"name": "Bob"}', 'Here: {"name": "f", "arguments": {}}', '{"a": 1} is JSON'):
        assert parser.parse(content) == type(parsed)(content, ())  # no arguments key, or not at the start
    assert parser.parse('{"name": "f", "arguments": {"a"', truncated=True).content is None  # cut: never content
    deltas, sent = ToolCallDeltas(parser), []
    for end in range(1, len(bare) + 1):
        content, calls = deltas.next(bare[:end], end == len(bare))
        assert content == ""
        sent += calls
    assert accumulated(sent) == list(parsed.calls)
