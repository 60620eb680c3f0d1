import json

from nebula_engine.workloads.analysis import segment_stats
from nebula_engine.workloads.registry import load_workload
from nebula_engine.workloads.request import SegmentKind
from nebula_engine.workloads.segments import text_content_id
from nebula_engine.workloads.tau_bench import load_tau_bench, split_messages
from nebula_engine.workloads.segments import LoadOptions

CONVERSATION = "user: hi\nassistant: None\ntool: {\"a\": 1,\n \"b\": 2}\nassistant: done\nuser: bye"


def write_slice(directory, conversations):
    (directory / "wiki.md").write_text("# Retail agent policy\nBe helpful.")
    with (directory / "MockRetailDomainEnv-few_shot.jsonl").open("w") as out:
        for text in conversations:
            out.write(json.dumps({"messages_display": text}) + "\n")


def test_split_messages_keeps_multiline_tool_outputs():
    assert split_messages(CONVERSATION) == [
        ("user", "hi"), ("assistant", "None"), ("tool", "{\"a\": 1,\n \"b\": 2}"),
        ("assistant", "done"), ("user", "bye")]


def test_one_request_per_assistant_turn_with_policy_prefix(tmp_path):
    write_slice(tmp_path, [CONVERSATION, CONVERSATION.replace("hi", "hello")])
    requests = load_tau_bench(tmp_path, LoadOptions(limit=1))
    assert len(requests) == 2
    first, second = sorted(requests, key=lambda r: r.arrival_time)
    policy = text_content_id("# Retail agent policy\nBe helpful.")
    assert [s.content_id for s in first.segments] == [policy, text_content_id("user: hi")]
    assert [s.kind for s in second.segments] == [SegmentKind.PREFIX] + [SegmentKind.PIC] * 3
    assert second.segments[:2] == first.segments
    assert second.arrival_time > first.arrival_time


def test_real_conversations_match_the_paper_shape(shared_traces):
    requests = load_workload("tau-bench", shared_traces)
    assert len(requests) == 943 and len({r.session_id for r in requests}) == 69
    segs = segment_stats(requests).segments_per_request
    assert (segs.p50, segs.p95) == (14, 34)
