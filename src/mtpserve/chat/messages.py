"""Chat messages and tools as llama.cpp hands them to a template (common_chat_msgs_parse_oaicompat): role
`developer` -> `system`; content always a string ("" when absent) or typed text parts; `reasoning_content`, `name`,
`tool_call_id` only when non-empty; tool-call `arguments` parsed from JSON into objects; tools normalised to
type/function/name/description/parameters. Anything of the wrong shape is a ChatTemplateError."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import ChatTemplateError


def as_text(content: str | list[dict[str, str]]) -> str:
    return content if isinstance(content, str) else "\n".join(p["text"] for p in content)


def normalize_messages(messages: Any, keep_developer: bool) -> list[dict[str, Any]]:
    """OpenAI-style messages -> what llama.cpp hands the template (common_chat_msgs_parse_oaicompat)."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ChatTemplateError("'messages' must be an array of message objects")
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"Expected 'message' to be an object, got {_dump(message)}")
        role = message.get("role")
        if not isinstance(role, str):
            raise ChatTemplateError(f"Missing 'role' in message: {_dump(message)}")
        if role == "developer" and not keep_developer:
            role = "system"
        content = message.get("content")
        tool_calls = message.get("tool_calls")
        if "content" not in message and "tool_calls" not in message:
            raise ChatTemplateError("Expected 'content' or 'tool_calls' in message")
        norm: dict[str, Any] = {"role": role, "content": _normalize_content(content)}
        for key in ("reasoning_content", "name", "tool_call_id"):
            value = message.get(key)
            if value is not None and not isinstance(value, str):
                raise ChatTemplateError(f"'{key}' must be a string in message: {_dump(message)}")
            if value:
                norm[key] = value
        if tool_calls:
            if not isinstance(tool_calls, Sequence) or isinstance(tool_calls, (str, bytes)):
                raise ChatTemplateError(f"'tool_calls' must be an array of tool calls, got {_dump(tool_calls)}")
            norm["tool_calls"] = [_normalize_tool_call(call) for call in tool_calls]
        out.append(norm)
    return out


def _normalize_content(content: Any) -> str | list[dict[str, str]]:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, Sequence):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or "type" not in part:
                raise ChatTemplateError(f"Missing content part type: {_dump(part)}")
            if part["type"] != "text":
                raise ChatTemplateError(f"Unsupported content part type: {_dump(part['type'])}")
            if not isinstance(part.get("text"), str):
                raise ChatTemplateError(f"Content part without text: {_dump(part)}")
            parts.append({"type": "text", "text": part["text"]})
        return parts if parts else ""
    raise ChatTemplateError(f"Invalid 'content' type: expected string or array, got {_dump(content)}")


def _normalize_tool_call(call: Any) -> dict[str, Any]:
    if not isinstance(call, Mapping) or call.get("type") != "function" or not isinstance(call.get("function"), Mapping):
        raise ChatTemplateError(f"Unsupported tool call: {_dump(call)}")
    function = call["function"]
    if not isinstance(function.get("name"), str):
        raise ChatTemplateError(f"Missing tool call name: {_dump(call)}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ChatTemplateError(f"Failed to parse tool call arguments as JSON: {e}") from None
    norm = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if call.get("id"):
        norm["id"] = call["id"]
    return norm


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise ChatTemplateError(f"Failed to parse tools: expected an array, got {_dump(tools)}")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise ChatTemplateError(f"Failed to parse tools: unsupported tool {_dump(tool)}")
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatTemplateError(f"Failed to parse tools: missing function name in {_dump(tool)}")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise ChatTemplateError(
                f"Failed to parse tools: 'tools[{i}].function.parameters' is not a JSON Schema object"
            )
        function_out = {
            "name": function["name"],
            "description": function.get("description") or "",
            "parameters": parameters if parameters is not None else {},
        }
        out.append({"type": "function", "function": function_out})
    return out


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)[:200]
