"""Grammar-constrained decoding (vLLM's ``StructuredOutputsParams``) through xgrammar.

A request's constraint (a JSON schema, any JSON object, a regex, a choice of strings or an EBNF grammar) is
compiled once per distinct constraint into an xgrammar ``CompiledGrammar``; each sequence then holds its own
``GrammarMatcher``, which yields the bitmask of the tokens allowed next. Once the grammar is complete only the
stop tokens (EOS) are allowed, so the output ends exactly where the grammar does.

xgrammar is imported on first use: engines that never see a constrained request never load it.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Sequence

from nebula_engine.extras import MissingExtra, require_extra

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint: ``json`` (a JSON schema, as a dict or its text), ``regex``, ``choice`` (the output
    is one of these strings), ``grammar`` (EBNF, xgrammar's dialect) or ``json_object=True`` (any JSON object).
    ``disable_any_whitespace``: JSON output without free whitespace between tokens (compact)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(_KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or str), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name} must be a string")
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs.json_object must be a bool")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def key(self) -> tuple:
        """Identifies the compiled grammar: equal constraints share one compilation."""
        spec = self.json if not isinstance(self.json, dict) else json.dumps(self.json, sort_keys=True)
        return spec, self.regex, self.choice, self.grammar, bool(self.json_object), self.disable_any_whitespace


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary (the model's logits width); thread-safe."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        self._hf_tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._lock = threading.Lock()
        self._compiler = None
        self._compiled: dict[tuple, Any] = {}

    def _xgrammar_compiler(self):
        with self._lock:
            if self._compiler is None:
                try:
                    xgrammar = require_extra("xgrammar", "structured")
                except MissingExtra as exc:
                    raise ValueError(f"structured outputs need an extra: {exc}") from exc
                info = xgrammar.TokenizerInfo.from_huggingface(self._hf_tokenizer, vocab_size=self._vocab_size,
                                                                stop_token_ids=self._stop_token_ids or None)
                self._compiler = xgrammar.GrammarCompiler(info)
            return self._compiler

    def compile(self, params: StructuredOutputsParams):
        """The ``CompiledGrammar`` of ``params``; ValueError naming the problem if it is not a valid constraint."""
        key = params.key
        with self._lock:
            found = self._compiled.get(key)
        if found is not None:
            return found
        compiler = self._xgrammar_compiler()
        try:
            compiled = self._compile(compiler, params)
        except ValueError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError / its own errors for a bad schema or grammar
            kind = next(k for k in _KINDS if getattr(params, k) not in (None, False))
            raise ValueError(f"structured_outputs.{kind} is not valid: {exc}") from None
        with self._lock:
            self._compiled[key] = compiled
        return compiled

    @staticmethod
    def _compile(compiler, params: StructuredOutputsParams):
        if params.json is not None:
            schema = params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError("structured_outputs.json must be a JSON schema object")
            _check_schema(schema)
            return compiler.compile_json_schema(json.dumps(schema), any_whitespace=not params.disable_any_whitespace)
        if params.json_object:
            if params.disable_any_whitespace:
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            return compiler.compile_json_schema('{"type": "object"}')
        if params.regex is not None:
            return compiler.compile_regex(params.regex)
        if params.choice is not None:
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in params.choice))
        return compiler.compile_grammar(params.grammar)

    def matcher(self, params: StructuredOutputsParams):
        import xgrammar

        return xgrammar.GrammarMatcher(self.compile(params))


def _check_schema(schema: dict) -> None:
    """Reject a schema that is not valid JSON Schema (jsonschema's metaschema check): xgrammar accepts some invalid
    schemas silently (e.g. ``{"type": "objekt"}``)."""
    try:
        jsonschema = require_extra("jsonschema", "structured")
    except MissingExtra as exc:
        raise ValueError(f"structured outputs need an extra: {exc}") from exc
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"structured_outputs.json is not a valid JSON schema: {exc.message}") from None
