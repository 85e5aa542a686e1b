"""The OpenAPI description of the request bodies (the handlers read raw JSON to give llama-server's error
messages, so FastAPI cannot infer them). Published at /openapi.json; schemathesis fuzzes the server
from it. Loose where llama-server is loose: unknown fields are allowed, and the server, not the schema,
has the last word on what it refuses."""

from __future__ import annotations

from typing import Any

NUMBER = {"type": "number"}
INTEGER = {"type": "integer"}
BOOLEAN = {"type": "boolean"}
STOP = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}

SAMPLING: dict[str, Any] = {
    "temperature": NUMBER,
    "top_k": INTEGER,
    "top_p": NUMBER,
    "min_p": NUMBER,
    "typical_p": NUMBER,
    "repeat_penalty": NUMBER,
    "repeat_last_n": INTEGER,
    "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER,
    "seed": INTEGER,
    "stop": STOP,
    "stream": BOOLEAN,
    "cache_prompt": BOOLEAN,
    "ignore_eos": BOOLEAN,
    "id_slot": INTEGER,
    "logit_bias": {"type": "object"},
    "model": {"type": "string"},
}

# a JSON schema as clients send them for formats and tool parameters: shaped enough that fuzzed bodies reach the
# grammar compiler (most draws compile), loose enough that broken schemas are drawn too
JSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "type": {"type": "string", "enum": ["object", "string", "integer", "number", "boolean", "array", "null"]},
        "properties": {"type": "object", "additionalProperties": {"type": "object"}},
        "required": {"type": "array", "items": {"type": "string"}},
        "enum": {"type": "array"},
        "items": {"type": "object"},
        "additionalProperties": BOOLEAN,
    },
}
FUNCTION_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string"}, "description": {"type": "string"}, "parameters": JSON_SCHEMA},
        },
    },
}
RESPONSE_FORMAT = {
    "oneOf": [
        {"type": "object", "properties": {"type": {"type": "string", "enum": ["text", "json_object"]}}},
        {
            "type": "object",
            "required": ["type", "json_schema"],
            "properties": {
                "type": {"type": "string", "enum": ["json_schema"]},
                "json_schema": {"type": "object", "properties": {"name": {"type": "string"}, "schema": JSON_SCHEMA}},
            },
        },
    ]
}

PROMPT = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"oneOf": [INTEGER, {"type": "string"}]}}]}
MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {"type": "object"}}]},
        "reasoning_content": {"type": "string"},
        "tool_calls": {"type": "array", "items": {"type": "object"}},
        "tool_call_id": {"type": "string"},
        "name": {"type": "string"},
    },
}

CHAT = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        **SAMPLING,
        "messages": {"type": "array", "items": MESSAGE},
        "max_tokens": INTEGER,
        "max_completion_tokens": INTEGER,
        "n": INTEGER,
        "logprobs": BOOLEAN,
        "top_logprobs": INTEGER,
        "tools": {"type": "array", "items": {"oneOf": [FUNCTION_TOOL, {"type": "object"}]}},
        "tool_choice": {"oneOf": [{"type": "string", "enum": ["auto", "none", "required"]}, {"type": "object"}]},
        "parallel_tool_calls": BOOLEAN,
        "response_format": RESPONSE_FORMAT,
        "chat_template_kwargs": {"type": "object"},
        "reasoning_format": {"type": "string"},
        "stream_options": {"type": "object", "properties": {"include_usage": BOOLEAN}},
    },
}
COMPLETION = {
    "type": "object",
    "required": ["prompt"],
    "properties": {**SAMPLING, "prompt": PROMPT, "max_tokens": INTEGER, "logprobs": INTEGER, "n": INTEGER},
}
NATIVE = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        **SAMPLING,
        "prompt": PROMPT,
        "n_predict": INTEGER,
        "n_probs": INTEGER,
        "return_tokens": BOOLEAN,
        "grammar": {"type": "string"},
        "json_schema": JSON_SCHEMA,
    },
}
INFILL = {
    "type": "object",
    "required": ["input_prefix", "input_suffix"],
    "properties": {
        **NATIVE["properties"],
        "prompt": {"type": "string"},
        "input_prefix": PROMPT,
        "input_suffix": PROMPT,
        "input_extra": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["text"],
                "properties": {"text": {"type": "string"}, "filename": {"type": "string"}},
            },
        },
    },
}
TOKENIZE = {
    "type": "object",
    "required": ["content"],
    "properties": {"content": PROMPT, "add_special": BOOLEAN, "parse_special": BOOLEAN, "with_pieces": BOOLEAN},
}
DETOKENIZE = {"type": "object", "required": ["tokens"], "properties": {"tokens": {"type": "array", "items": INTEGER}}}


def body(schema: dict[str, Any]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body follows `schema`."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
