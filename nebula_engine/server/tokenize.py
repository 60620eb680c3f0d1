"""vLLM's ``/tokenize`` and ``/detokenize``: a prompt or a conversation (through the chat template, tools
included) -> token ids, and back.

As in vLLM, a prompt gets the tokenizer's special tokens (BOS) unless ``add_special_tokens`` is false, and a
conversation does not (its template writes them). ``<pic>`` tags are text here: these routes show the tokenizer.
"""

from __future__ import annotations

from jinja2 import TemplateError

from nebula_engine.engine.tokenizer import Tokenizer
from nebula_engine.server.chat_messages import template_messages, template_tools
from nebula_engine.server.errors import APIError
from nebula_engine.server.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse


def tokenize_request(request: TokenizeRequest, tokenizer: Tokenizer, max_model_len: int) -> TokenizeResponse:
    if request.prompt is not None:
        text, add_special = request.prompt, request.add_special_tokens is not False
    else:
        try:
            text, _ = tokenizer.apply_chat_template(template_messages(request.messages),
                                                    template_tools(request.tools), request.chat_options)
        except (ValueError, TemplateError) as exc:  # no template, or the template's own checks
            raise APIError(f"cannot render the messages: {exc}", param="messages") from exc
        add_special = bool(request.add_special_tokens)
    tokens = tokenizer.encode(text) if add_special else tokenizer.encode_plain(text)
    strs = tokenizer.hf.convert_ids_to_tokens(tokens) if request.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=max_model_len, tokens=tokens, token_strs=strs)


def detokenize_request(request: DetokenizeRequest, tokenizer: Tokenizer) -> DetokenizeResponse:
    vocab_size = len(tokenizer.hf)
    outside = [t for t in request.tokens if t >= vocab_size]
    if outside:
        raise APIError(f"token ids outside the vocabulary (size {vocab_size}): {outside[:8]}", param="tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(request.tokens, skip_special_tokens=False))
