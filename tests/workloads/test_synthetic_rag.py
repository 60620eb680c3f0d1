import pytest

from nebula_engine.workloads.analysis import reuse_stats, segment_stats
from nebula_engine.workloads.paper_figures import PAPER_FIGURES
from nebula_engine.workloads.registry import load_workload
from nebula_engine.workloads.request import SegmentKind


def test_generation_is_seeded():
    assert load_workload("quac", limit=300, seed=3) == load_workload("quac", limit=300, seed=3)
    assert load_workload("quac", limit=300, seed=3) != load_workload("quac", limit=300, seed=4)


def test_limit_is_a_request_count_and_turns_keep_their_order():
    requests = load_workload("doc2dial", limit=250)
    assert len(requests) == 250
    assert [r.arrival_time for r in requests] == sorted(r.arrival_time for r in requests)
    first = requests[0]
    assert first.segments[0].kind is SegmentKind.PREFIX and first.segments[-1].kind is SegmentKind.REGULAR


@pytest.mark.parametrize("name, pc_tol, pic_tol, segs_tol", [("doc2dial", 0.4, 0.2, 3), ("quac", 0.5, 2.0, 4)])
def test_default_generation_approximates_the_paper(name, pc_tol, pic_tol, segs_tol):
    requests = load_workload(name)
    paper, stats, segs = PAPER_FIGURES[name], reuse_stats(requests), segment_stats(requests)
    assert stats.pc == pytest.approx(paper.pc, abs=pc_tol)
    assert stats.pic == pytest.approx(paper.pic, abs=pic_tol)
    assert segs.segments_per_request.p50 == pytest.approx(paper.segments_per_request[0], abs=segs_tol)
    assert segs.segment_length.p50 == pytest.approx(paper.segment_length[0], rel=0.1)
    assert segs.segment_length.p95 == pytest.approx(paper.segment_length[1], rel=0.15)
