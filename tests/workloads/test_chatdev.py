import statistics

from nebula_engine.workloads.analysis import LOGGED_PROMPT_TOKENS
from nebula_engine.workloads.artifacts import split_artifacts
from nebula_engine.workloads.chatdev import load_chatdev
from nebula_engine.workloads.chatdev_log import elapsed_seconds, parse_chats
from nebula_engine.workloads.registry import load_workload
from nebula_engine.workloads.request import SegmentKind
from nebula_engine.workloads.segments import LoadOptions, text_content_id

CODE = "main.py\n```python\n" + "\n".join(f"print({i})" for i in range(12)) + "\n```"
COMMENT = "The game loop never ends because the exit condition is checked after the board resets."
PHASE_PROMPT = f'Review the codes.\nIdeas: ""\nCodes:\n"{CODE}\n"\nComments on Codes:\n"{COMMENT}"\nNow reply.'

LOG = f"""[2023-22-08 14:46:15 INFO] **[Preprocessing]**
config stuff
[2023-22-08 14:46:16 INFO] Programmer: **[Start Chat]**

[You are Code Reviewer.]

{PHASE_PROMPT}

[2023-22-08 14:46:20 INFO] **[OpenAI_Usage_Info Receive]**
prompt_tokens: 120
completion_tokens: 30

[2023-22-08 14:46:25 INFO] **[OpenAI_Usage_Info Receive]**
prompt_tokens: 150
completion_tokens: 10

[2023-22-08 14:46:25 INFO] Code Reviewer: **Code Reviewer<->Programmer on : CodeReviewComment, turn 0**

[You are Programmer.]

Fix the loop.
{CODE}

[2023-22-08 14:46:26 INFO] Programmer: **Code Reviewer<->Programmer on : CodeReviewComment, turn 0**

[You are Code Reviewer.]

<INFO> Finished
"""


def test_split_artifacts_separates_code_and_long_quotes_from_the_template():
    pieces = split_artifacts(PHASE_PROMPT)
    assert [piece for is_artifact, piece in pieces if is_artifact] == [CODE, COMMENT]
    assert "".join(piece for _, piece in pieces).replace(CODE, "").replace(COMMENT, "") == \
        PHASE_PROMPT.replace(CODE, "").replace(COMMENT, "")


def test_parse_chats_attaches_calls_and_messages_to_their_chat():
    (chat,), orphans = parse_chats(LOG)
    assert orphans == []
    assert chat.opening.system_prompt == "You are Code Reviewer." and chat.opening.text == PHASE_PROMPT
    assert [m.system_prompt for m in chat.messages] == ["You are Programmer.", "You are Code Reviewer."]
    assert [(c.time_s, c.prompt_tokens) for c in chat.calls] == [(5.0, 120), (10.0, 150)]


def test_elapsed_seconds_ignores_dates_and_survives_midnight():
    assert elapsed_seconds(["23:59:58", "23:59:59", "00:00:03"]) == [0.0, 1.0, 5.0]


def test_each_call_is_answering_agent_prompt_plus_chat_so_far(tmp_path):
    (tmp_path / "WareHouse").mkdir()
    (tmp_path / "WareHouse" / "run.log").write_text(LOG)
    first, second = load_chatdev(tmp_path, LoadOptions())
    assert first.segments[0].content_id == text_content_id("You are Code Reviewer.")
    assert second.segments[0].content_id == text_content_id("You are Programmer.")
    assert [s.kind for s in first.segments] == [SegmentKind.PREFIX, SegmentKind.REGULAR, SegmentKind.PIC,
                                               SegmentKind.REGULAR, SegmentKind.PIC, SegmentKind.REGULAR]
    assert second.segments[1:6] == first.segments[1:]
    # the reply's code block is the same segment as the file in the phase prompt
    assert second.segments[-1].content_id == text_content_id(CODE) == first.segments[2].content_id
    assert (first.metadata[LOGGED_PROMPT_TOKENS], second.metadata[LOGGED_PROMPT_TOKENS]) == (120, 150)
    assert second.arrival_time - first.arrival_time == 5.0


def test_rebuilt_prompts_track_logged_prompt_tokens(shared_traces):
    requests = load_workload("chatdev", shared_traces, limit=4)
    assert len({r.session_id for r in requests}) == 4
    ratio = statistics.median(r.num_tokens / r.metadata[LOGGED_PROMPT_TOKENS] for r in requests)
    assert 0.95 < ratio < 1.05  # Qwen3 tokens (the paper serves ChatDev with Qwen3) vs the logged GPT tokens
