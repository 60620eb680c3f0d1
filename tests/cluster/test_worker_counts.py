"""What a combine's home reports as cache hits when it computed part of the prompt for the request itself."""

from __future__ import annotations

from nebula_engine.cluster.runtime.prefill_tasks import MadeForRequest
from nebula_engine.cluster.runtime.worker_codec import output_to_wire
from nebula_engine.engine.outputs import CompletionOutput, RequestOutput
from nebula_engine.pic.segments import PromptSegment, SegmentedPrompt, SegmentKind

# a 32-token lead, two 16-token documents, a 4-token question
PROMPT = SegmentedPrompt(tuple(range(68)), (PromptSegment(SegmentKind.REGULAR, 0, 32),
                                            PromptSegment(SegmentKind.PIC, 32, 16),
                                            PromptSegment(SegmentKind.PIC, 48, 16),
                                            PromptSegment(SegmentKind.REGULAR, 64, 4)))


def combined(prefix: int, pic: int) -> RequestOutput:
    return RequestOutput("r", None, list(PROMPT.token_ids), [CompletionOutput(0, "x", [7], token_logprobs=[-0.1])],
                         finished=True, num_cached_tokens=prefix + pic, num_prefix_cached_tokens=prefix,
                         num_pic_cached_tokens=pic, num_recomputed_tokens=4)


def test_a_lead_prefilled_for_the_request_is_no_hit():
    """16 of the lead's 32 tokens were cached before; the home prefilled the rest and the first document for the
    request while it waited: the hits are the 16 cached lead tokens and the second document."""
    made = MadeForRequest(frozenset({0}), lead_cached_before=16)
    assert made.tokens(PROMPT, 32) == (16 + 16, 16)
    wire = output_to_wire("p0", "r", combined(32, 32), 0, fresh=made.tokens(PROMPT, 32))
    assert wire.cached == [16, 32, 4, 32]


def test_without_a_lead_prefill_the_prefix_hits_stand():
    made = MadeForRequest(frozenset({0}))
    assert made.tokens(PROMPT, 32) == (16, 0)
    assert output_to_wire("p0", "r", combined(32, 32), 0, fresh=made.tokens(PROMPT, 32)).cached == [32, 32, 4, 48]
    assert output_to_wire("p0", "r", combined(32, 32), 0).cached == [32, 32, 4, 64]
