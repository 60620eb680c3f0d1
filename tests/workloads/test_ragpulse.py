import pytest

from nebula_engine.workloads.analysis import reuse_stats, segment_stats
from nebula_engine.workloads.registry import BUNDLED_DIR, load_workload
from nebula_engine.workloads.ragpulse import load_ragpulse
from nebula_engine.workloads.request import SegmentKind
from nebula_engine.workloads.segments import LoadOptions

BUNDLED = BUNDLED_DIR / "ragpulse"


def test_bundled_slice_loads_in_trace_order_with_known_layout():
    requests = load_ragpulse(BUNDLED, LoadOptions())
    assert len(requests) == 1000
    first = requests[0]
    assert first.arrival_time == 82.0 and first.output_tokens == 192
    assert [s.content_id for s in first.segments[:3]] == ["sys_prompt:8302", "sys_prompt:14332", "sys_prompt:15199"]
    assert [s.kind for s in first.segments] == [SegmentKind.PREFIX] * 3 + [SegmentKind.PIC] * 7 + [SegmentKind.REGULAR]
    assert first.segments[-1].content_id == "user_input:26923"


def test_trace_input_length_is_segments_plus_template_tokens():
    for request in load_ragpulse(BUNDLED, LoadOptions(limit=200)):
        assert 6 <= request.metadata["input_length"] - request.num_tokens <= 12


def test_bundled_slice_reuse_is_pinned():
    stats = reuse_stats(load_ragpulse(BUNDLED, LoadOptions()))
    assert (round(stats.pc, 2), round(stats.pic, 2)) == (31.39, 63.86)


def test_same_id_always_yields_the_same_tokens():
    first = load_ragpulse(BUNDLED, LoadOptions(limit=300, with_token_ids=True))
    second = load_ragpulse(BUNDLED, LoadOptions(limit=300, with_token_ids=True))
    tokens_by_id = {}
    for request in first:
        for segment in request.segments:
            assert len(segment.token_ids) == segment.num_tokens
            assert tokens_by_id.setdefault(segment.content_id, segment.token_ids) == segment.token_ids
    assert [r.segments for r in first] == [r.segments for r in second]
    assert len(set(tokens_by_id.values())) == len(tokens_by_id)  # distinct ids, distinct tokens


def test_full_trace_reproduces_the_paper(shared_traces):
    requests = load_workload("ragpulse", shared_traces)
    stats = reuse_stats(requests)
    assert len(requests) == 7106
    assert f"{stats.pc:.2f}" == "31.53" and f"{stats.pic:.2f}" == "72.01"
    assert f"{stats.nphr:.2f}" == "40.48" and f"{stats.pmrr:.1f}" == "59.1"
    segs = segment_stats(requests)
    assert (segs.segments_per_request.p50, segs.segments_per_request.p95, segs.segments_per_request.p99) == (11, 13, 15)


def test_limit_reads_only_the_first_lines(shared_traces):
    requests = load_workload("ragpulse", shared_traces, limit=5)
    assert [r.request_id for r in requests] == [f"ragpulse-{i}" for i in range(5)]


def test_unknown_trace_id_fails_loudly(tmp_path):
    for path in BUNDLED.glob("*.jsonl"):
        (tmp_path / path.name).write_text(path.read_text())
    (tmp_path / "2_passages.jsonl").write_text('{"passage_id": 0, "token_length": 1}\n')
    with pytest.raises(KeyError):
        load_ragpulse(tmp_path, LoadOptions(limit=1))
