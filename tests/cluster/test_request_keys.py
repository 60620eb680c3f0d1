"""How the router keys a real prompt: regular tokens in blocks, so prompts sharing the start of a segment share keys."""

from nebula_engine.cluster.control.request_keys import block_segments, prompt_keys


def lengths(blocks):
    return [(kind, len(ids)) for kind, ids in blocks]


def test_regular_tokens_are_cut_where_the_prompt_offset_reaches_a_block_boundary_and_pic_segments_stay_whole():
    segments = [("regular", list(range(600))), ("pic", list(range(300))), ("regular", list(range(200)))]
    blocks = block_segments(segments, block_tokens=256)
    assert lengths(blocks) == [("regular", 256), ("regular", 256), ("regular", 88), ("pic", 300),
                               ("regular", 124), ("regular", 76)]  # 900 + 124 = 1024, a boundary
    assert [t for _, ids in blocks for t in ids] == [t for _, ids in segments for t in ids]
    assert lengths(block_segments([("regular", [1] * 256)], block_tokens=256)) == [("regular", 256)]


def test_two_system_prompts_that_differ_only_at_their_end_share_their_first_blocks_keys():
    start = list(range(1000, 1600))
    first = prompt_keys("a", block_segments([("regular", start + [1] * 100), ("pic", [7] * 50)]), str)
    second = prompt_keys("b", block_segments([("regular", start + [2] * 100), ("pic", [7] * 50)]), str)
    assert first.pc_keys[:2] == second.pc_keys[:2] and first.pc_keys[2] != second.pc_keys[2]
    assert first.tokens == (256, 256, 188, 50) and first.pic_indices == (3,)
