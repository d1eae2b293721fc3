"""A request's structured output, as vLLM 0.33 reads it: OpenAI's `response_format` (json_object, json_schema) or
vLLM's `structured_outputs` (one of json, regex, choice, grammar, json_object) -> a GrammarSpec, parsed here (no
token masks: that compile is the engine's) so that a grammar xgrammar cannot read is a 400 naming the part."""

from __future__ import annotations

import json
from typing import Any

from blockdraft.decoding.grammar import GrammarSpec, parse_grammar
from blockdraft.errors import BlockdraftError
from blockdraft.serve.errors import ApiError

_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "json"}
# vLLM's other structured_outputs fields, accepted at their neutral values
_NEUTRAL = {"disable_fallback": False, "disable_any_whitespace": False, "disable_additional_properties": False,
            "whitespace_pattern": None, "structural_tag": None}


def grammar_spec(response_format: dict[str, Any] | None, structured: dict[str, Any] | None, tokenizer: Any
                 ) -> GrammarSpec | None:
    """The request's grammar (None: free text), checked by parsing it."""
    spec, param = _from_response_format(response_format)
    if structured is not None:
        if spec is not None:
            raise ApiError(400, "send `response_format` or `structured_outputs`, not both", "structured_outputs")
        spec, param = _from_structured_outputs(structured)
    if spec is None:
        return None
    if tokenizer is None:
        raise ApiError(400, "structured outputs need a tokenizer and this target has none", param)
    try:
        parse_grammar(spec)
    except BlockdraftError as exc:
        raise ApiError(400, f"`{param}`: {exc}", param) from None
    return spec


def _from_response_format(value: dict[str, Any] | None) -> tuple[GrammarSpec | None, str]:
    if value is None:
        return None, ""
    kind = value.get("type")
    if kind == "text" and set(value) == {"type"}:
        return None, ""
    if kind == "json_object" and set(value) == {"type"}:
        return GrammarSpec("json"), "response_format"
    if kind == "json_schema":
        body = value.get("json_schema")
        if not isinstance(body, dict) or not isinstance(body.get("schema", {}), dict):
            raise ApiError(400, "`response_format.json_schema` must be an object with a `schema` object",
                           "response_format.json_schema")
        extra = set(body) - {"name", "schema", "strict", "description"}
        unknown = sorted(extra | set(value) - {"type", "json_schema"})
        if unknown:
            raise ApiError(400, f"`response_format` has unknown fields {unknown}", "response_format")
        return GrammarSpec("json_schema", json.dumps(body.get("schema", {}))), "response_format.json_schema.schema"
    raise ApiError(400, "`response_format.type` must be text, json_object or json_schema (with only its own fields)",
                   "response_format.type")


def _from_structured_outputs(value: dict[str, Any]) -> tuple[GrammarSpec, str]:
    if not isinstance(value, dict):
        raise ApiError(400, "`structured_outputs` must be an object", "structured_outputs")
    for key, neutral in _NEUTRAL.items():
        if value.get(key, neutral) not in (neutral, None):
            raise ApiError(400, f"`structured_outputs.{key}`={value[key]!r} is not supported by blockdraft serve",
                           f"structured_outputs.{key}")
    unknown = set(value) - set(_KINDS) - set(_NEUTRAL)
    if unknown:
        raise ApiError(400, f"unknown field `structured_outputs.{sorted(unknown)[0]}`", "structured_outputs")
    given = [key for key in _KINDS if value.get(key) not in (None, False)]
    if len(given) != 1:
        raise ApiError(400, "`structured_outputs` takes exactly one of json, regex, choice, grammar, json_object",
                       "structured_outputs")
    key = given[0]
    source = value[key]
    param = f"structured_outputs.{key}"
    if key == "json_object":
        return GrammarSpec("json"), param
    if key == "json":
        text = source if isinstance(source, str) else json.dumps(source)
        return GrammarSpec("json_schema", text), param
    if key == "choice":
        if not isinstance(source, list) or not source or not all(isinstance(c, str) for c in source):
            raise ApiError(400, f"`{param}` must be a non-empty list of strings", param)
        return GrammarSpec("choice", json.dumps(source)), param
    if not isinstance(source, str):
        raise ApiError(400, f"`{param}` must be a string", param)
    return GrammarSpec(_KINDS[key], source), param
