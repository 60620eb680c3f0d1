"""Batch tensors built by the model runner from a scheduled batch (no model needed)."""

import torch

from nebula_engine.engine.model_runner import ModelRunner
from nebula_engine.engine.sampler import Sampler
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.engine.scheduler import ScheduledSequence
from nebula_engine.engine.sequence import Sequence
from nebula_engine.kernels.attention import get_attention_backend
from nebula_engine.kvcache.pool import KVCacheStorage
from nebula_engine.kvcache.spec import full_attention_groups


def test_slot_mapping_positions_and_logits_rows_follow_block_tables():
    storage = KVCacheStorage(full_attention_groups([(1, 4, 4)], torch.float32), num_pages=4, page_size=4, device="cpu")
    runner = ModelRunner(None, storage, get_attention_backend("torch"), None, Sampler(0), "cpu")
    decoding = Sequence("a", [10, 11, 12, 13, 14, 15, 16], SamplingParams())
    chunked = Sequence("b", [20, 21, 22, 23, 24], SamplingParams())
    batch = (
        ScheduledSequence(decoding, num_computed_tokens=5, num_new_tokens=2, block_table=[3, 1], samples=True),
        ScheduledSequence(chunked, num_computed_tokens=0, num_new_tokens=3, block_table=[2], samples=False),
    )
    inputs = runner.prepare_inputs(batch)
    assert inputs.input_ids.tolist() == [15, 16, 20, 21, 22]
    assert inputs.positions.tolist() == [5, 6, 0, 1, 2]
    assert inputs.meta.slot_mapping.tolist() == [1 * 4 + 1, 1 * 4 + 2, 8, 9, 10]
    assert inputs.meta.query_start_loc == [0, 2, 5]
    assert inputs.meta.seq_lens == [7, 3]
    assert inputs.meta.block_tables.tolist() == [[3, 1], [2, 0]]
    assert inputs.logits_indices.tolist() == [1]
