"""Turns a scheduled batch into tensors, runs the model over the paged cache, samples.

Legend: T = new tokens in the batch, B = scheduled sequences, S = page size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nebula_engine.engine.sampler import Sampler, SamplerOutput
from nebula_engine.engine.scheduler import ScheduledSequence, SchedulerOutput
from nebula_engine.kernels.attention import AttentionBackend, AttentionContext, AttentionMetadata
from nebula_engine.kvcache.pool import KVCacheStorage


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the last token of each sampling sequence


@dataclass(frozen=True)
class ModelRunnerOutput:
    seq_ids: list[str]  # sequences that sampled a token this step, in batch order
    sampled: SamplerOutput


class ModelRunner:
    def __init__(self, model: nn.Module, kv_storage: KVCacheStorage, attention_backend: AttentionBackend,
                 sampler: Sampler, device: torch.device | str):
        self.model = model
        self.kv_storage = kv_storage
        self.attention_backend = attention_backend
        self.sampler = sampler
        self.device = torch.device(device)

    @torch.inference_mode()
    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for seq_id in output.finished_seq_ids:
            self.sampler.release(seq_id)
        hidden = self.forward(output.scheduled)
        sampling = [s for s in output.scheduled if s.samples]
        if not sampling:  # every sequence is mid-prefill
            return ModelRunnerOutput([], SamplerOutput([], []))
        seq_ids = [s.seq_id for s in sampling]
        logits = self.model.compute_logits(hidden)
        return ModelRunnerOutput(seq_ids, self.sampler(logits, seq_ids, [s.seq.sampling_params for s in sampling]))

    def forward(self, scheduled: tuple[ScheduledSequence, ...]) -> torch.Tensor:
        """Hidden states [n, D] of the last token of each sequence that samples this step."""
        inputs = self.prepare_inputs(scheduled)
        ctx = AttentionContext(self.attention_backend, inputs.meta, self.kv_storage.layer_caches)
        hidden = self.model.forward(inputs.input_ids, inputs.positions, ctx)
        return hidden.index_select(0, inputs.logits_indices)

    def prepare_inputs(self, scheduled: tuple[ScheduledSequence, ...]) -> ModelInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        logits_indices = []
        for entry in scheduled:
            start, end = entry.num_computed_tokens, entry.num_computed_tokens + entry.num_new_tokens
            input_ids += entry.seq.token_ids[start:end]
            positions += range(start, end)
            query_start_loc.append(query_start_loc[-1] + entry.num_new_tokens)
            if entry.samples:
                logits_indices.append(query_start_loc[-1] - 1)
        positions_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        block_tables = self._block_tables(scheduled)
        meta = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=[s.num_computed_tokens + s.num_new_tokens for s in scheduled],
            block_tables=block_tables,
            slot_mapping=self._slot_mapping(block_tables, query_start_loc, positions_t),
            page_size=self.kv_storage.page_size,
        )
        return ModelInputs(torch.tensor(input_ids, dtype=torch.long, device=self.device), positions_t, meta,
                           torch.tensor(logits_indices, dtype=torch.long, device=self.device))

    def _block_tables(self, scheduled: tuple[ScheduledSequence, ...]) -> torch.Tensor:
        width = max(len(s.block_table) for s in scheduled)
        rows = [s.block_table + [0] * (width - len(s.block_table)) for s in scheduled]
        return torch.tensor(rows, dtype=torch.long, device=self.device)  # [B, max_pages]

    def _slot_mapping(self, block_tables: torch.Tensor, query_start_loc: list[int],
                      positions: torch.Tensor) -> torch.Tensor:
        page_size = self.kv_storage.page_size
        query_lens = torch.tensor(query_start_loc[1:], device=self.device) - torch.tensor(query_start_loc[:-1], device=self.device)
        seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens), device=self.device), query_lens)
        pages = block_tables[seq_of_token, positions // page_size]
        return pages * page_size + positions % page_size  # [T]
