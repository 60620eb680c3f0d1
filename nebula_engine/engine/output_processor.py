"""Per-request output state: incremental text, stop conditions, the final ``RequestOutput``.

A request's ``bad_words`` are tokenized here, by the engine's own tokenizer, when its sequence is added: every
path into an engine (offline, the HTTP API, a cluster peer) passes through ``add``.
"""

from __future__ import annotations

from dataclasses import dataclass

from nebula_engine.engine.outputs import CompletionOutput, Logprob, RequestOutput
from nebula_engine.engine.sampler import TopLogprobs
from nebula_engine.engine.sequence import Sequence
from nebula_engine.engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class StopDecision:
    finish_reason: str  # "stop" | "length"
    stop_reason: int | str | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add(self, seq: Sequence) -> None:
        if seq.sampling_params.bad_words and self.tokenizer is not None:
            seq.sampling_params = seq.sampling_params.with_bad_words_tokenized(self.tokenizer.encode_plain)
        skip = seq.sampling_params.skip_special_tokens
        self._detokenizers[seq.seq_id] = (IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, skip)
                                          if self.tokenizer is not None else NoText())
        if seq.sampling_params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * seq.num_prompt_tokens  # the first stays None: nothing predicts it

    def add_prompt_logprobs(self, seq: Sequence, first: int, entries: list[TopLogprobs]) -> None:
        """Prompt tokens ``first``, ``first + 1``, ... (a recompute after preemption writes the same again)."""
        for position, entry in enumerate(entries, start=first):
            seq.prompt_logprobs[position] = self.logprob_dict(entry)

    def process_token(self, seq: Sequence, top_logprobs: TopLogprobs | None = None) -> StopDecision | None:
        """Detokenize ``seq``'s newest token (and its top logprobs, when asked) and decide whether ``seq`` stops
        here. Before ``min_tokens`` output tokens nothing but the length limit stops it (as vLLM)."""
        token = seq.token_ids[-1]
        params = seq.sampling_params
        detokenizer = self._detokenizers[seq.seq_id]
        if top_logprobs is not None:
            seq.output_top_logprobs.append(self.logprob_dict(top_logprobs))
        may_stop = seq.num_output_tokens >= params.min_tokens  # the sampler masked EOS and stop ids before that
        if may_stop and not params.ignore_eos and token in self.eos_token_ids:
            return StopDecision("stop")  # EOS itself never reaches the text
        if may_stop and token in params.stop_token_ids:
            if params.include_stop_str_in_output:
                detokenizer.add_token(token)
            return StopDecision("stop", token)
        delta = detokenizer.add_token(token)
        if delta and params.stop and seq.num_output_tokens > params.min_tokens:  # vLLM's detokenizer: strictly after
            stop = find_stop_string(detokenizer.text, len(delta), params.stop)
            if stop is not None:
                kept = len(stop[0]) if params.include_stop_str_in_output else 0
                detokenizer.truncate(stop[1] + kept)
                return StopDecision("stop", stop[0])
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return StopDecision("length")
        return None

    def snapshot(self, seq: Sequence) -> RequestOutput:
        """``seq`` so far (cumulative text and tokens), not finished: what a stream reports each step."""
        return self._output(seq, self._detokenizers[seq.seq_id].text, finished=False)

    def finish(self, seq: Sequence) -> RequestOutput:
        return self._output(seq, self._detokenizers.pop(seq.seq_id).text, finished=True)

    def discard(self, seq_id: str) -> None:
        self._detokenizers.pop(seq_id, None)

    def logprob_dict(self, top: TopLogprobs) -> dict[int, Logprob]:
        """vLLM's ``{token_id: Logprob}`` of one position; each token's text decoded alone, special tokens kept."""
        texts = (self.tokenizer.hf.batch_decode([[t] for t in top.token_ids], skip_special_tokens=False)
                 if self.tokenizer is not None else [None] * len(top.token_ids))
        return {t: Logprob(lp, rank, text) for t, lp, rank, text in zip(top.token_ids, top.logprobs, top.ranks, texts)}

    @staticmethod
    def _output(seq: Sequence, text: str, finished: bool) -> RequestOutput:
        asked = seq.sampling_params.logprobs is not None
        completion = CompletionOutput(0, text, seq.output_token_ids,
                                      sum(seq.output_logprobs) if asked else None,
                                      list(seq.output_top_logprobs) if asked else None,
                                      seq.finish_reason, seq.stop_reason, list(seq.output_logprobs))
        prompt_logprobs = list(seq.prompt_logprobs) if seq.prompt_logprobs is not None else None
        return RequestOutput(seq.seq_id, seq.prompt, seq.prompt_token_ids, [completion], finished=finished,
                             prompt_logprobs=prompt_logprobs,
                             num_cached_tokens=seq.num_cached_tokens,
                             num_prefix_cached_tokens=seq.num_prefix_cached_tokens,
                             num_pic_cached_tokens=seq.num_pic_cached_tokens,
                             num_recomputed_tokens=seq.num_recomputed_tokens, times=seq.times)


class NoText:
    """The detokenizer of an engine without a tokenizer (``skip_tokenizer_init``): outputs are token ids only."""

    text = ""

    def add_token(self, token_id: int) -> str:
        return ""

    def truncate(self, length: int) -> None:
        pass


def find_stop_string(text: str, num_new_chars: int, stops: tuple[str, ...]) -> tuple[str, int] | None:
    """Earliest stop string that overlaps the newest ``num_new_chars`` characters: (stop, index)."""
    best = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[1]):
            best = (stop, index)
    return best
