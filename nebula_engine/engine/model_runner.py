"""Turns a scheduled batch into tensors, runs the model over the paged cache, samples.

Legend: T = new tokens in the batch, B = scheduled sequences, S = page size, L = linear-attention layers.
Models with linear-attention layers also carry per-sequence state in the storage's state slots: each step
loads the scheduled sequences' states (none for a sequence starting at token 0, which also covers
recompute after preemption), runs ``forward_with_states`` and stores the states it returns.

A failure is pinned on the requests that cause it, which fail alone (``ModelRunnerOutput.failed``): a combine
prefill and a row's sampling state are per request; when the batched forward raises, it runs again on each half
of the batch, down to the sequences that make it fail. A retry is safe: it rewrites the same KV slots with the
same values, and linear-attention states are stored only after a forward succeeds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from nebula_engine.engine.pic_executor import PICExecutor
from nebula_engine.engine.sampler import RowHistory, Sampler, SamplerOutput, TopLogprobs, top_logprobs
from nebula_engine.engine.scheduler import ScheduledSequence, SchedulerOutput
from nebula_engine.kernels.attention import AttentionBackend, AttentionContext, AttentionMetadata
from nebula_engine.kernels.mla_attention import MLAAttentionBackend, mla_backend_for
from nebula_engine.kvcache.cache_lock import CacheLock
from nebula_engine.kvcache.pool import KVCacheStorage
from nebula_engine.kvcache.spec import KVCacheGroupSpec, MLALatentSpec
from nebula_engine.model.gated_deltanet import LinearAttentionState

logger = logging.getLogger(__name__)


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
    failed: dict[str, Exception] = field(default_factory=dict)  # seq id -> the error that stopped it this step
    # seq id -> (the prompt position of its first entry, one entry per prompt token this step predicted)
    prompt_logprobs: dict[str, tuple[int, list[TopLogprobs]]] = field(default_factory=dict)


# rows of [rows, V] fp32 logits computed at once for prompt logprobs: 512 x a 152k vocabulary is 311 MB
PROMPT_LOGPROBS_ROWS = 512


def latent_attention_backend(attention_backend: AttentionBackend,
                             groups: list[KVCacheGroupSpec]) -> MLAAttentionBackend | None:
    """The backend MLA layers read their latent caches through: the MLA backend named like ``attention_backend``
    (torch where there is none); None for a model without MLA layers."""
    has_latent = any(isinstance(g.spec, MLALatentSpec) for g in groups)
    return mla_backend_for(attention_backend.name) if has_latent else None


class ModelRunner:
    def __init__(self, model: nn.Module, kv_storage: KVCacheStorage, attention_backend: AttentionBackend,
                 mla_backend: MLAAttentionBackend | None, sampler: Sampler, device: torch.device | str,
                 pic_executor: PICExecutor | None = None, cache_lock: CacheLock | None = None):
        """``mla_backend``: ``latent_attention_backend`` of the storage's groups; ``pic_executor``: runs the combine
        prefills (None: this engine serves no PIC backend); ``cache_lock``: the engine's, let go during the batch's
        forward and sampling, which touch only the pages already scheduled."""
        self.model = model
        self.kv_storage = kv_storage
        self.attention_backend = attention_backend
        self.mla_backend = mla_backend
        self.sampler = sampler
        self.device = torch.device(device)
        self.pic_executor = pic_executor
        self.cache_lock = cache_lock or CacheLock()

    @torch.inference_mode()
    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for seq_id in output.finished_seq_ids:
            self.sampler.release(seq_id)
        failed: dict[str, Exception] = {}
        prompt_hidden: dict[str, tuple[int, torch.Tensor]] = {}
        parts = self._forward_isolated(output.scheduled, failed, prompt_hidden) if output.scheduled else []
        combined = self.pic_executor.run_many(output.combines) if output.combines else {}
        for entry in output.combines:
            outcome = combined[entry.seq_id]
            if isinstance(outcome, Exception):  # one request's combine prefill
                self._record_failure(entry, outcome, failed)
            elif entry.samples:  # not a resumed sequence, whose output tokens are prefilled next
                parts.append(([entry], outcome))
        prompt_logprobs = self._prompt_logprobs(output.scheduled, prompt_hidden, failed)
        sampling = [entry for entries, _ in parts for entry in entries]
        if not sampling:  # every sequence is mid-prefill (or failed)
            return ModelRunnerOutput([], SamplerOutput([], []), failed, prompt_logprobs)
        seq_ids = [s.seq_id for s in sampling]
        with self.cache_lock.released():
            logits = self.model.compute_logits(torch.cat([hidden for _, hidden in parts]))
            sampled = self.sampler(logits, seq_ids, [s.seq.sampling_params for s in sampling],
                                   [RowHistory(s.seq.token_ids, s.seq.num_prompt_tokens) for s in sampling])
        for seq_id, exc in sampled.failed.items():
            logger.error("request %s failed: its sampling state could not be built", seq_id, exc_info=exc)
        failed.update(sampled.failed)
        return ModelRunnerOutput([i for i in seq_ids if i not in sampled.failed], sampled, failed, prompt_logprobs)

    def _prompt_logprobs(self, scheduled: tuple[ScheduledSequence, ...], prompt_hidden: dict[str, tuple[int, torch.Tensor]],
                         failed: dict[str, Exception]) -> dict[str, tuple[int, list[TopLogprobs]]]:
        """Logprobs of the prompt tokens predicted by this step's hidden states, for requests that asked."""
        result = {}
        for entry in scheduled:
            if entry.seq_id not in prompt_hidden or entry.seq_id in failed:
                continue
            first, hidden = prompt_hidden[entry.seq_id]
            targets = entry.seq.token_ids[first:first + hidden.shape[0]]
            k = entry.seq.sampling_params.prompt_logprobs
            entries: list[TopLogprobs] = []
            for start in range(0, hidden.shape[0], PROMPT_LOGPROBS_ROWS):
                logits = self.model.compute_logits(hidden[start:start + PROMPT_LOGPROBS_ROWS]).float()
                tokens = torch.tensor(targets[start:start + PROMPT_LOGPROBS_ROWS], dtype=torch.long, device=self.device)
                entries += top_logprobs(torch.log_softmax(logits, dim=-1), tokens, [k] * len(tokens))
            result[entry.seq_id] = (first, entries)
        return result

    def _forward_isolated(self, scheduled: tuple[ScheduledSequence, ...], failed: dict[str, Exception],
                          prompt_hidden: dict[str, tuple[int, torch.Tensor]],
                          ) -> list[tuple[list[ScheduledSequence], torch.Tensor]]:
        """(sampling entries, their hidden states) of the parts of ``scheduled`` whose forward succeeds; the
        sequences whose forward fails even alone go to ``failed``."""
        try:
            hidden, new_states, prompt_rows = self.forward(scheduled)
        except Exception as exc:
            if len(scheduled) == 1:
                self._record_failure(scheduled[0], exc, failed)
                return []
            logger.warning("forward of %d sequences failed (%r); running each half again to find the cause",
                           len(scheduled), exc)
            middle = len(scheduled) // 2
            return (self._forward_isolated(scheduled[:middle], failed, prompt_hidden)
                    + self._forward_isolated(scheduled[middle:], failed, prompt_hidden))
        if new_states is not None:  # outside the retry: a failure here is the engine's, not a request's
            self._store_states(scheduled, new_states)
        prompt_hidden.update(prompt_rows)
        return [([s for s in scheduled if s.samples], hidden)]

    @staticmethod
    def _record_failure(entry: ScheduledSequence, exc: Exception, failed: dict[str, Exception]) -> None:
        logger.error("request %s failed in the model forward", entry.seq_id, exc_info=exc)
        failed[entry.seq_id] = exc

    def forward(self, scheduled: tuple[ScheduledSequence, ...]
                ) -> tuple[torch.Tensor, list[list[LinearAttentionState]] | None, dict[str, tuple[int, torch.Tensor]]]:
        """Hidden states [n, D] of the last token of each sequence that samples this step, the new
        linear-attention states [L][B] to store (None without linear-attention layers), and for each sequence
        that asked for prompt logprobs, (p, the hidden states predicting its prompt tokens p, p+1, ...) in this
        step's tokens. Writes only KV slots."""
        inputs = self.prepare_inputs(scheduled)
        ctx = AttentionContext(self.attention_backend, inputs.meta, self.kv_storage.layer_caches, self.mla_backend)
        new_states = None
        with self.cache_lock.released():
            if self.kv_storage.linear_states:
                hidden, new_states = self.model.forward_with_states(inputs.input_ids, inputs.positions, ctx,
                                                                    self._load_states(scheduled))
            else:
                hidden = self.model.forward(inputs.input_ids, inputs.positions, ctx)
        return hidden.index_select(0, inputs.logits_indices), new_states, self._prompt_rows(scheduled, inputs, hidden)

    @staticmethod
    def _prompt_rows(scheduled: tuple[ScheduledSequence, ...], inputs: ModelInputs, hidden: torch.Tensor
                     ) -> dict[str, tuple[int, torch.Tensor]]:
        """Token at position p predicts prompt token p + 1: the rows of this step's prompt positions before the
        last one, for sequences that asked for prompt logprobs."""
        rows = {}
        for entry, row_start in zip(scheduled, inputs.meta.query_start_loc):
            if entry.seq.sampling_params.prompt_logprobs is None:
                continue
            start = entry.num_computed_tokens
            end = min(start + entry.num_new_tokens, entry.seq.num_prompt_tokens - 1)
            if end > start:
                rows[entry.seq_id] = (start + 1, hidden[row_start:row_start + end - start])
        return rows

    def _load_states(self, scheduled: tuple[ScheduledSequence, ...]) -> list[list[LinearAttentionState | None]]:
        """[L][B] states to continue from; None where a sequence starts (its slot may hold a previous owner's)."""
        return [[LinearAttentionState(conv[s.state_slot], recurrent[s.state_slot]) if s.num_computed_tokens else None
                 for s in scheduled]
                for conv, recurrent in self.kv_storage.linear_states]

    def _store_states(self, scheduled: tuple[ScheduledSequence, ...],
                      new_states: list[list[LinearAttentionState]]) -> None:
        """``new_states`` [L][B] into the slots of ``scheduled``'s sequences."""
        slots = torch.tensor([s.state_slot for s in scheduled], dtype=torch.long, device=self.device)
        for (conv, recurrent), layer_states in zip(self.kv_storage.linear_states, new_states):
            conv.index_copy_(0, slots, torch.stack([state.conv for state in layer_states]).to(conv.dtype))
            recurrent.index_copy_(0, slots, torch.stack([state.recurrent for state in layer_states]))

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
