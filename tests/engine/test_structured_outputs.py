"""Structured outputs (xgrammar): the output of a constrained request parses and validates, on a random tiny
Qwen3 (whose unconstrained output is never JSON) and on the real SmolLM2, PIC prompts included."""

import json

import jsonschema
import pytest

from nebula_engine import SamplingParams
from nebula_engine.engine.structured_outputs import StructuredOutputsParams

PROMPT = "The quick brown fox jumps over"
PIC_PROMPT = "Notes: <pic>Paris is the capital of France.</pic> Answer in JSON:"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "ok", "count", "color"],
    "additionalProperties": False,
}


def constrained(max_tokens=80, **structured):
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=3,
                          structured_outputs=StructuredOutputsParams(**structured))


@pytest.mark.parametrize("prompt", [PROMPT, PIC_PROMPT])
def test_json_schema_output_parses_and_validates(llm, prompt):
    plain = llm.generate(prompt, SamplingParams(max_tokens=30, temperature=1.0, seed=3))[0].outputs[0]
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain.text)
    outputs = llm.generate([prompt] * 3, [constrained(json=SCHEMA, disable_any_whitespace=True).for_completion(i)
                                         for i in range(3)])
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text  # the grammar ended: only EOS was allowed
        jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_schema_given_as_text_and_n_completions_all_validate(llm):
    [out] = llm.generate(PROMPT, SamplingParams(n=3, max_tokens=80, temperature=1.0, seed=11, structured_outputs=
                                                StructuredOutputsParams(json=json.dumps(SCHEMA),
                                                                        disable_any_whitespace=True)))
    assert len(out.outputs) == 3
    for completion in out.outputs:
        jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_regex_and_choice(llm):
    [digits] = llm.generate(PROMPT, constrained(regex=r"[0-9]{3}-[a-c]{2}"))
    assert len(digits.outputs[0].text) == 6 and digits.outputs[0].text[3] == "-"
    assert digits.outputs[0].text[:3].isdigit() and set(digits.outputs[0].text[4:]) <= set("abc")
    choices = ["alpha", "beta gamma", "delta"]
    texts = {llm.generate(PROMPT, constrained(choice=choices).for_completion(i))[0].outputs[0].text for i in range(4)}
    assert texts <= set(choices)


@pytest.mark.parametrize("structured, message", [
    (dict(json={"type": "objekt"}), "not a valid JSON schema"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(regex="([a-z"), "regex is not valid"),
    (dict(grammar="root ::= undefined_rule"), "grammar is not valid"),
])
def test_invalid_constraints_are_value_errors_before_anything_runs(llm, structured, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPT, constrained(**structured))
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("fields, message", [
    (dict(), "exactly one of"),
    (dict(json=SCHEMA, regex="a"), "exactly one of"),
    (dict(choice=[]), "choice"),
    (dict(choice="abc"), "choice"),
    (dict(json=3), "JSON schema"),
])
def test_malformed_params_are_value_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_json_object_on_smollm2_chat():
    from nebula_engine import LLM

    llm = LLM("smollm2", num_pages=64, page_size=16)
    messages = [{"role": "user", "content": "Describe a cat as a JSON object with a name and an age."}]
    params = SamplingParams(max_tokens=120, temperature=0.0, structured_outputs=StructuredOutputsParams(json_object=True))
    [out] = llm.chat(messages, params)
    completion = out.outputs[0]
    assert completion.finish_reason == "stop", completion.text
    assert isinstance(json.loads(completion.text), dict)
