import pytest

from nebula_engine.workloads.analysis import Distribution, logged_size_ratio, reuse_stats, segment_stats
from nebula_engine.workloads.request import Request, Segment, SegmentKind

P, R, C = SegmentKind.PREFIX, SegmentKind.REGULAR, SegmentKind.PIC


def request(*segments: tuple[SegmentKind, str, int], **metadata) -> Request:
    return Request(f"r{id(segments)}", 0.0, "s", tuple(Segment(k, c, n) for k, c, n in segments),
                   metadata=metadata)


def test_identical_requests_hit_fully_through_prefix():
    stats = reuse_stats([request((P, "a", 10), (R, "b", 5))] * 2)
    assert (stats.total_tokens, stats.pc_hit_tokens, stats.pic_hit_tokens) == (30, 15, 15)
    assert stats.nphr == 0.0


def test_reordered_pic_segments_hit_only_through_pic():
    first = request((P, "sys", 10), (C, "x", 20), (C, "y", 30))
    reordered = request((P, "sys", 10), (C, "y", 30), (C, "x", 20))
    stats = reuse_stats([first, reordered])
    assert (stats.pc_hit_tokens, stats.pic_hit_tokens) == (10, 60)
    assert stats.pc == pytest.approx(100 * 10 / 120)
    assert stats.pic == pytest.approx(100 * 60 / 120)
    assert stats.nphr == pytest.approx(100 * 50 / 120)
    assert stats.pmrr == pytest.approx(100 * 50 / 110)


def test_regular_segment_reuses_only_as_part_of_a_prefix():
    stats = reuse_stats([request((P, "s1", 4), (R, "q", 6)), request((P, "s2", 4), (R, "q", 6))])
    assert (stats.pc_hit_tokens, stats.pic_hit_tokens) == (0, 0)


def test_prefix_kind_segment_reuses_anywhere_under_pic():
    stats = reuse_stats([request((P, "a", 4), (P, "b", 6)), request((P, "z", 4), (P, "b", 6))])
    assert (stats.pc_hit_tokens, stats.pic_hit_tokens) == (0, 6)


def test_repeat_inside_one_request_is_a_pic_hit():
    stats = reuse_stats([request((P, "s", 4), (C, "x", 6), (C, "x", 6))])
    assert (stats.pc_hit_tokens, stats.pic_hit_tokens) == (0, 6)


def test_prefix_match_follows_the_chain_not_the_ids():
    stats = reuse_stats([
        request((P, "a", 1), (C, "b", 2), (C, "c", 4)),
        request((P, "a", 1), (C, "b", 2), (C, "d", 8)),  # PC: a, b
        request((P, "a", 1), (C, "d", 8)),  # PC: a only; d is a PIC hit
    ])
    assert stats.pc_hit_tokens == 1 + 2 + 1
    assert stats.pic_hit_tokens == (1 + 2) + (1 + 8)


def test_empty_stream_has_zero_rates():
    stats = reuse_stats([])
    assert (stats.pc, stats.pic, stats.nphr, stats.pmrr) == (0.0, 0.0, 0.0, 0.0)
    assert segment_stats([]).segments_per_request == Distribution(0.0, 0.0, 0.0)


def test_segment_stats_count_every_occurrence():
    requests = [request(*[(C, f"x{i}", 10 * (i + 1)) for i in range(n)]) for n in range(1, 102)]
    stats = segment_stats(requests)
    assert stats.segments_per_request == Distribution(51.0, 96.0, 100.0)
    assert stats.segment_length.p50 == 300.0  # lengths 10..1010 weighted toward short ones


def test_logged_size_ratio_skips_requests_without_a_log():
    requests = [request((C, "a", 90), logged_prompt_tokens=100), request((C, "b", 50))]
    assert logged_size_ratio(requests) == Distribution(0.9, 0.9, 0.9)
    assert logged_size_ratio([request((C, "b", 50))]) is None
