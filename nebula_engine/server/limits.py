"""Limits of the HTTP API: request size, how long a client may take to send a request, and how much work one
request may ask for (a module without server imports, so the CLI can show the defaults).

A request's cost is bounded by its own size in the engine's units: ``n × max_tokens`` tokens generated and
``n × prompt tokens`` tokens prefilled, per prompt. By default each may be at most the model's context length:
the most an ``n = 1`` request, which the context length already bounds, can cost. Parallel sampling may split
that budget over its n sequences but never multiply it, so one greedy client cannot occupy the engine for n times
the longest request (measured without these caps: one ``n = 128`` request took 39 s of engine time and stretched
concurrent streams from 1.8 s to 8.1 s).
"""

from __future__ import annotations

from dataclasses import dataclass

# Room for the longest context of any family served (Qwen3.5: 262,144 tokens) sent in its densest JSON form,
# token ids at 8 bytes each (2 MiB), and as much again for the rest of the body. Text is smaller: 4.3 bytes per
# token on average, 6.2 at most, measured with the Qwen tokenizer on the SWE-agent and ChatDev traces.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024

# Slow clients. Apache's mod_reqtimeout default (``header=20-40``) gives a request's head 20 s; nginx's
# ``client_body_timeout`` default is 60 s (between reads; here for the whole body, which at the 4 MiB size limit
# still admits a client sending ~70 kB/s). uvicorn's own default closes an idle keep-alive connection after 5 s.
DEFAULT_HEADER_TIMEOUT_S = 20.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5


@dataclass(frozen=True)
class ClientLimits:
    """What one client may take from the server. ``None`` caps: the model's context length (module docstring)."""

    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S  # the whole body must arrive within this, else 408
    max_request_output_tokens: int | None = None  # n × max_tokens of each prompt
    max_request_prompt_tokens: int | None = None  # n × prompt tokens of each prompt

    def __post_init__(self) -> None:
        if not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be positive, got {self.body_timeout_s}")
        for name in ("max_request_output_tokens", "max_request_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be positive, got {value}")

    def cost_violation(self, n: int, max_tokens: int, prompt_tokens: int, max_model_len: int) -> tuple[str, str] | None:
        """(message, the field to change) when one prompt of a request asks for more than these limits allow."""
        output_cap = self.max_request_output_tokens or max_model_len
        prompt_cap = self.max_request_prompt_tokens or max_model_len
        if n * max_tokens > output_cap:
            return (f"n × max_tokens = {n} × {max_tokens} = {n * max_tokens} tokens to generate exceeds this "
                    f"server's per-request limit of {output_cap} (--max-request-output-tokens); lower n or set a "
                    "smaller max_tokens", "max_tokens" if n == 1 else "n")
        if n * prompt_tokens > prompt_cap:
            return (f"n × prompt tokens = {n} × {prompt_tokens} = {n * prompt_tokens} tokens to prefill exceeds this "
                    f"server's per-request limit of {prompt_cap} (--max-request-prompt-tokens); lower n or shorten "
                    "the prompt", "n")
        return None
