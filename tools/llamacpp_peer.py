"""llama.cpp as a benchmark peer: its C API through llama-cpp-python, on the same GGUF file, the way llama.cpp's
own ``llama-batched-bench`` drives it (one context, one sequence id per request, a batch of one token per
sequence for each decode step, greedy argmax over the logits it returns).

Install it with ``pip install -e '.[llamacpp]'`` (it compiles llama.cpp: minutes on a small machine). Its context
keeps llama.cpp's defaults (512-token physical micro-batch, unified KV buffer off, flash attention auto) except the
thread counts, which are the caller's so both engines use the same cores.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch


class LlamaCppRunner:
    """``prefill`` and ``decode`` with the interface of the other runners of ``tools/bench_forward.py``."""

    def __init__(self, gguf_path: str, *, threads: int, max_prompt_len: int, max_batch: int,
                 decode_prompt_len: int, decode_steps: int, clock):
        self._clock = clock  # the tool's clock (wall or process CPU time)
        try:
            import llama_cpp
            from llama_cpp._logger import set_verbose
        except ImportError as error:
            raise SystemExit("--peer llamacpp needs llama-cpp-python: pip install -e '.[llamacpp]'") from error
        set_verbose(False)
        self._api = api = llama_cpp
        api.llama_backend_init()
        self._model = api.llama_model_load_from_file(gguf_path.encode(), api.llama_model_default_params())
        if not self._model:
            raise SystemExit(f"llama.cpp could not load {gguf_path}")
        params = api.llama_context_default_params()
        # without a unified KV buffer each sequence owns n_ctx / n_seq_max cells (llama.cpp rounds to 256)
        per_sequence = -(-max(max_prompt_len + 2, decode_prompt_len + decode_steps + 2) // 256) * 256
        params.n_ctx = per_sequence * max_batch
        params.n_batch = max(max_prompt_len, max_batch * decode_prompt_len)  # one llama_decode call per prefill
        params.n_seq_max = max_batch
        params.n_threads = params.n_threads_batch = threads
        self._ctx = api.llama_init_from_model(self._model, params)
        if not self._ctx:
            raise SystemExit(f"llama.cpp could not create a context of {params.n_ctx} tokens")
        self.vocab_size = api.llama_vocab_n_tokens(api.llama_model_get_vocab(self._model))
        self._batch = api.llama_batch_init(params.n_batch, 0, max_batch)

    def close(self) -> None:
        self._api.llama_batch_free(self._batch)
        self._api.llama_free(self._ctx)
        self._api.llama_model_free(self._model)

    def _fill(self, rows: list[list[int]], first_position: int, logits_last_only: bool) -> None:
        batch, n = self._batch, 0
        for seq_id, row in enumerate(rows):
            for offset, token in enumerate(row):
                batch.token[n] = token
                batch.pos[n] = first_position + offset
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq_id
                batch.logits[n] = not logits_last_only or offset == len(row) - 1
                n += 1
        batch.n_tokens = n

    def _decode_and_argmax(self, rows: int) -> list[int]:
        if self._api.llama_decode(self._ctx, self._batch) != 0:
            raise RuntimeError("llama_decode failed")
        logits = self._api.llama_get_logits(self._ctx)  # one row per token that asked for logits, in batch order
        array = np.ctypeslib.as_array(ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)),
                                      shape=(rows, self.vocab_size))
        return array.argmax(axis=1).tolist()

    def _clear(self) -> None:
        self._api.llama_memory_clear(self._api.llama_get_memory(self._ctx), True)

    def prefill(self, prompts: torch.Tensor) -> float:
        """Seconds to prefill each prompt of ``prompts`` [B, L] and pick its first token (B = 1 in the tool)."""
        self._clear()
        rows = prompts.tolist()
        start = self._clock()
        self._fill(rows, 0, logits_last_only=True)
        self._decode_and_argmax(len(rows))
        return self._clock() - start

    def decode(self, prompts: torch.Tensor, steps: int) -> float:
        """Seconds per decode step (median) of ``prompts`` [B, L] decoding together, one sequence each."""
        self._clear()
        rows = prompts.tolist()
        self._fill(rows, 0, logits_last_only=True)
        next_tokens = self._decode_and_argmax(len(rows))
        position, seconds = len(rows[0]), []
        for _ in range(steps):  # a step: its batch built, decoded, its tokens picked (as our engine's step)
            start = self._clock()
            self._fill([[token] for token in next_tokens], position, logits_last_only=True)
            next_tokens = self._decode_and_argmax(len(rows))
            seconds.append(self._clock() - start)
            position += 1
        return float(np.median(seconds))
