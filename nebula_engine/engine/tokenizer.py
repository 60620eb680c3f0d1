"""Tokenizer of a checkpoint directory, chat templates, and incremental detokenization."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from nebula_engine.engine.sampling_params import check_unicode

Message = dict[str, Any]
JINJA_CHARS = "{}\n"  # vLLM's test: a --chat-template value holding none of these is meant as a file path
# apply_chat_template's own parameters: chat_template_kwargs may not set them (they have their own fields)
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                      "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                      "truncation", "max_length", "return_tensors", "return_dict",
                                      "return_assistant_tokens_mask", "tokenizer_kwargs"})


@dataclass(frozen=True)
class ChatOptions:
    """How a conversation is rendered (vLLM's chat request fields): ``add_generation_prompt`` ends it with the
    assistant's turn opener; ``continue_final_message`` leaves the last (assistant) message open, so the model
    continues it; ``template_kwargs`` are extra template variables (``enable_thinking``, ...)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    chat_template: str | None = None  # this conversation's template (``load_chat_template``): the tokenizer's else

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        if not isinstance(self.template_kwargs, Mapping):
            raise ValueError(f"chat_template_kwargs must be an object, got {type(self.template_kwargs).__name__}")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(self.template_kwargs))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)} (each has its own option)")


def load_chat_template(value: str) -> str:
    """A ``--chat-template`` value, as vLLM reads it: the file it names, else (if it looks like Jinja) the template
    itself; a one-line template has its backslash escapes (``\\n``) decoded, as a shell passes them. ValueError for
    a missing file or a template that does not parse."""
    import codecs

    import jinja2

    template = None
    if not any(c in value for c in JINJA_CHARS):
        path = Path(value).expanduser()
        try:
            template = path.read_text()
        except OSError as exc:
            raise ValueError(f"the chat template {value!r} looks like a file path, but it cannot be read: "
                             f"{exc.strerror or exc}") from exc
    elif "\n" in value:
        template = value  # a template's own text
    else:
        path = Path(value).expanduser()
        try:
            template = path.read_text() if path.is_file() else None
        except OSError:  # too long for a path: the template itself
            template = None
        if template is None:
            template = codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template does not parse: {exc} (line {exc.lineno})") from exc
    return template


class Tokenizer:
    """Thin wrapper over the checkpoint's Hugging Face tokenizer.

    ``checkpoint`` is a directory, or a ``.gguf`` file whose metadata holds the vocabulary, merges, special
    tokens, BOS policy and chat template (transformers rebuilds the same tokenizer llama.cpp describes).

    Text is encoded by a private copy of the fast tokenizer's Rust backend through ``encode_batch_fast``, which
    releases the GIL for all of its work (``hf.encode`` holds it while it builds offsets: ~0.5 s for 4 MB of
    text), so a long prompt tokenized in a worker thread does not stall the server's event loop. The copy is
    never reconfigured, so threads can share it. The ids equal ``hf.encode``'s.
    """

    def __init__(self, checkpoint: str | Path, chat_template: str | None = None):
        """``chat_template``: replaces the checkpoint's (a file or the Jinja text, ``load_chat_template``)."""
        self._chat_template = load_chat_template(chat_template) if chat_template is not None else None
        path = Path(checkpoint)
        if path.suffix == ".gguf" and path.is_file():
            self.hf = _gguf_tokenizer(path)
        else:
            from transformers import AutoTokenizer

            self.hf = AutoTokenizer.from_pretrained(str(path))
        self._backend = _encoding_backend(self.hf)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._encode(text, add_special_tokens=True)

    def encode_plain(self, text: str) -> list[int]:
        """``text`` alone, no special tokens: how each ``<pic>`` segment is tokenized."""
        return self._encode(text, add_special_tokens=False)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """ValueError for text that is not valid Unicode (a lone surrogate)."""
        check_unicode("text", text)
        if self._backend is None:  # a slow (pure Python) tokenizer
            return list(self.hf.encode(text, add_special_tokens=add_special_tokens))
        return self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    @property
    def prompt_prefix_ids(self) -> list[int]:
        """Special tokens ``encode`` puts before any text (BOS for Mistral, none for Qwen)."""
        return list(self.hf.encode("", add_special_tokens=True))

    def segment_prompt(self, text: str):
        """A completion prompt with ``<pic>`` tags -> ``SegmentedPrompt`` (``PICSyntaxError`` on bad tags)."""
        from nebula_engine.pic.segments import segment_prompt

        prefix = self.prompt_prefix_ids
        return segment_prompt(text, self.encode_plain, prefix[0] if len(prefix) == 1 else None)

    def segment_chat(self, messages: list[Message], tools: list[dict[str, Any]] | None = None,
                     options: ChatOptions = ChatOptions()):
        """A conversation whose contents may carry ``<pic>`` tags -> ``SegmentedPrompt``; ``tools``: OpenAI
        function definitions, rendered by the template (``apply_chat_template``)."""
        from nebula_engine.pic.segments import segment_chat

        return segment_chat(messages, lambda m: self.apply_chat_template(m, tools, options)[0], self.encode_plain)

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        """The Jinja template (or HF's named templates), None without one; the one given at construction wins."""
        return self._chat_template or getattr(self.hf, "chat_template", None) or None

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[Message], tools: list[dict[str, Any]] | None = None,
                            options: ChatOptions = ChatOptions()) -> tuple[str, list[int]]:
        """(prompt text, token ids) of a conversation, by default ending with the assistant's turn opener
        (``options``); ``tools`` is the template's ``tools`` variable, as in Hugging Face's
        ``apply_chat_template(tools=...)``."""
        if not (options.chat_template or self.chat_template):
            raise ValueError("this model's tokenizer has no chat template; use generate() with plain prompts, or "
                             "give one (--chat-template, LLM(chat_template=...))")
        if options.continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        text = self.hf.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=options.chat_template or self._chat_template,
                                           add_generation_prompt=options.add_generation_prompt,
                                           continue_final_message=options.continue_final_message,
                                           **options.template_kwargs)
        # the template already carries BOS and role markers
        return text, self.encode_plain(text)


def _encoding_backend(hf):
    """A copy of ``hf``'s Rust tokenizer set up as ``hf.encode`` uses it (no truncation, no padding); None for a
    slow tokenizer."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer as RustTokenizer

    copy = RustTokenizer.from_str(backend.to_str())
    copy.no_truncation()
    copy.no_padding()
    copy.encode_special_tokens = bool(getattr(hf, "split_special_tokens", False))
    return copy


def _gguf_tokenizer(path: Path):
    """The tokenizer ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` builds, without its detour through
    transformers' legacy GGUF config reader (7 of 8.5 s for SmolLM2, measured): the class comes from the
    file's architecture."""
    import transformers

    from nebula_engine.model.gguf_loader import GGUFCheckpoint

    tokenizer_class = getattr(transformers, GGUFCheckpoint(path).tokenizer_class)
    return tokenizer_class.from_pretrained(str(path.parent), gguf_file=path.name)


class IncrementalDetokenizer:
    """Output text grown one token at a time.

    Decodes a short window that starts a few tokens back, so tokenizers whose pieces depend on
    their left neighbour (leading spaces, multi-byte characters split across tokens) come out right;
    text ending in an incomplete character is held back until the next token completes it.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._token_ids = list(prompt_token_ids[-5:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self.text = ""

    def add_token(self, token_id: int) -> str:
        """Append ``token_id``; returns the text it completed (possibly empty)."""
        self._token_ids.append(token_id)
        prefix = self._decode(self._token_ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._token_ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        self.text += delta
        return delta

    def truncate(self, length: int) -> None:
        self.text = self.text[:length]

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special)
