"""Per-request output state: incremental text, stop conditions, the final ``RequestOutput``."""

from __future__ import annotations

from dataclasses import dataclass

from nebula_engine.engine.outputs import CompletionOutput, RequestOutput
from nebula_engine.engine.sequence import Sequence
from nebula_engine.engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class StopDecision:
    finish_reason: str  # "stop" | "length"
    stop_reason: int | str | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add(self, seq: Sequence) -> None:
        skip = seq.sampling_params.skip_special_tokens
        self._detokenizers[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, skip)

    def process_token(self, seq: Sequence) -> StopDecision | None:
        """Detokenize ``seq``'s newest token and decide whether ``seq`` stops here."""
        token = seq.token_ids[-1]
        params = seq.sampling_params
        detokenizer = self._detokenizers[seq.seq_id]
        if not params.ignore_eos and token in self.eos_token_ids:
            return StopDecision("stop")  # EOS itself never reaches the text
        if token in params.stop_token_ids:
            return StopDecision("stop", token)
        delta = detokenizer.add_token(token)
        if delta and params.stop:
            stop = find_stop_string(detokenizer.text, len(delta), params.stop)
            if stop is not None:
                detokenizer.truncate(stop[1])
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

    @staticmethod
    def _output(seq: Sequence, text: str, finished: bool) -> RequestOutput:
        completion = CompletionOutput(0, text, seq.output_token_ids, list(seq.output_logprobs),
                                      seq.finish_reason, seq.stop_reason)
        return RequestOutput(seq.seq_id, seq.prompt, seq.prompt_token_ids, [completion], finished=finished,
                             num_cached_tokens=seq.num_cached_tokens,
                             num_prefix_cached_tokens=seq.num_prefix_cached_tokens,
                             num_pic_cached_tokens=seq.num_pic_cached_tokens,
                             num_recomputed_tokens=seq.num_recomputed_tokens)


def find_stop_string(text: str, num_new_chars: int, stops: tuple[str, ...]) -> tuple[str, int] | None:
    """Earliest stop string that overlaps the newest ``num_new_chars`` characters: (stop, index)."""
    best = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[1]):
            best = (stop, index)
    return best
