"""Output constraints from a request body, checked before any replica sees them.

Two sources, at most one per request:

* **A format for the reply**: OpenAI's ``response_format`` (``text``, ``json_object``,
  ``json_schema``), vLLM's ``structured_outputs`` extra (``json``, ``json_object``, ``regex``,
  ``choice``, ``grammar``) or its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
  ``guided_grammar`` fields (:func:`constraint_of`).
* **Tool calling** (chat): ``tools`` and ``tool_choice`` (:func:`tool_plan`). ``none``: the model
  writes text and sees no tools. ``auto`` (the default with tools): the model sees the tools and
  may call them in its family's format, which :mod:`router.response.tool_calls` parses out of its text.
  ``required``: the reply is constrained to a JSON array of one or more calls, each
  ``{"name": <a tool's name>, "arguments": <valid under that tool's parameters>}`` (one call at
  most with ``parallel_tool_calls: false``). A named function: the reply is constrained to that
  function's arguments (vLLM's behaviour for both).

Every constraint is compiled once here without the tokenizer
(:func:`~replica.protocol.constraints.grammar_error`), so a schema, regex or grammar llguidance
cannot compile is a 400 naming its field; the replica compiles it again with the vocabulary
(cached by constraint).
"""

# No "from __future__ import annotations", as in router/ingress.py.

import json
import re
from dataclasses import dataclass
from typing import Any

from replica.protocol.constraints import StructuredOutputsParams, grammar_error
from router.request.protocol import ChatCompletionRequest, OpenAIError, _SamplingRequest

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's function and schema names
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _refuse(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(f"{param}: {message}", param=param, code=code)


def _checked(params: StructuredOutputsParams, param: str) -> StructuredOutputsParams:
    """``params`` if llguidance compiles it, else a 400 naming ``param``."""
    error = grammar_error(params)
    if error:
        raise _refuse(param, f"the constraint does not compile: {error.strip()[:500]}")
    return params


def _build(param: str, **fields: Any) -> StructuredOutputsParams:
    """The constraint of ``fields`` (one kind), naming ``param`` in the replica's errors too."""
    try:
        return StructuredOutputsParams(**fields, field=param)
    except ValueError as exc:
        message = str(exc).split(": ", 1)[-1] if str(exc).startswith("structured_outputs") else str(exc)
        raise _refuse(param, message) from None


def _schema(value: Any, param: str) -> dict[str, Any]:
    """A JSON schema given as an object or as its JSON text: standard JSON only (no NaN or
    Infinity, which Python's parser would take), nested at most as deep as Python can walk."""
    try:
        if isinstance(value, str):
            value = json.loads(value, parse_constant=_no_constant)
        json.dumps(value, allow_nan=False)
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise _refuse(param, f"not valid JSON: {reason}") from None
    if not isinstance(value, dict):
        raise _refuse(param, f"must be a JSON schema (an object), got {type(value).__name__}")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _response_format(value: Any) -> tuple[StructuredOutputsParams | None, str]:
    """OpenAI's ``response_format`` as a constraint (None for ``text``) and the param to blame."""
    if not isinstance(value, dict):
        raise _refuse("response_format", f"must be an object with a 'type', got {type(value).__name__}")
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise _refuse("response_format.type", f"unknown type {str(kind)[:40]!r}; expected one of {', '.join(RESPONSE_FORMAT_TYPES)}")
    if kind == "text":
        return None, "response_format"
    if kind == "json_object":
        return _build("response_format", json_object=True), "response_format"
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _refuse("response_format.json_schema", "must be an object with 'name' and 'schema'")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _refuse("response_format.json_schema.name", "must be 1 to 64 letters, digits, '_', '-' or '.'")
    if "strict" in spec and not isinstance(spec["strict"], (bool, type(None))):
        raise _refuse("response_format.json_schema.strict", "must be a boolean")
    if "schema" not in spec:
        raise _refuse("response_format.json_schema.schema", "is required")
    param = "response_format.json_schema.schema"
    return _build(param, json=_schema(spec["schema"], param)), param


def constraint_of(body: _SamplingRequest) -> StructuredOutputsParams | None:
    """The reply's format constraint from ``response_format``, ``structured_outputs`` or a
    ``guided_*`` field; None for none (or ``response_format: text``).

    Raises:
        OpenAIError: 400 naming the field: an unknown ``response_format`` type, a malformed
            format, a schema, regex, choice or grammar llguidance cannot compile, or two sources
            at once.
    """
    found: list[tuple[StructuredOutputsParams, str]] = []
    if body.response_format is not None:
        params, param = _response_format(body.response_format)
        if params is not None:
            found.append((params, param))
    if body.structured_outputs is not None:
        so = body.structured_outputs
        if not isinstance(so, dict):
            raise _refuse("structured_outputs", f"must be an object, got {type(so).__name__}")
        fields = {k: v for k, v in so.items() if k in ("json", "json_object", "regex", "choice", "grammar") and v not in (None, False)}
        if "json" in fields:
            fields["json"] = _schema(fields["json"], "structured_outputs.json")
        param = f"structured_outputs.{next(iter(fields))}" if len(fields) == 1 else "structured_outputs"
        found.append((_build(param, **fields), param))
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(body, name)
        if value is not None:
            if kind == "json":
                value = _schema(value, name)
            found.append((_build(name, **{kind: value}), name))
    if len(found) > 1:
        raise _refuse(found[1][1].split(".")[0], f"only one output constraint per request; {found[0][1].split('.')[0]} is set too")
    return _checked(*found[0]) if found else None


@dataclass
class ToolPlan:
    """How a chat request uses its tools.

    Attributes:
        tools: the tool definitions as sent (``{"type": "function", "function": {...}}``), for the
            chat template; empty with ``mode == "none"``.
        mode: ``none``, ``auto``, ``required`` or ``named``.
        name: the function ``tool_choice`` names (``named``), else None.
        parallel: more than one call per reply allowed (``parallel_tool_calls``).
        constraint: the reply's constraint (``required`` and ``named``), else None.
    """

    tools: list[dict[str, Any]]
    mode: str
    name: str | None
    parallel: bool
    constraint: StructuredOutputsParams | None = None


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return _schema(function.get("parameters") or {"type": "object", "properties": {}}, "tools")  # JSON text parsed


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _refuse("tools", f"must be a list of tools, got {type(tools).__name__}")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        param = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise _refuse(param, "must be {'type': 'function', 'function': {'name': ..., 'parameters': ...}}")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _refuse(f"{param}.function.name", "must be 1 to 64 letters, digits, '_', '-' or '.'")
        if name in names:
            raise _refuse(f"{param}.function.name", f"{name!r} is defined twice")
        names.add(name)
        if "parameters" in function and function["parameters"] is not None:
            schema = _schema(function["parameters"], f"{param}.function.parameters")
            if schema.get("type", "object") != "object":
                raise _refuse(f"{param}.function.parameters", "must be a JSON schema of an object (arguments are named)")
            _checked(_build(f"{param}.function.parameters", json=schema), f"{param}.function.parameters")
            if schema is not function["parameters"]:  # given as JSON text: the template shows the object
                tools = [*tools[:i], {**tool, "function": {**function, "parameters": schema}}, *tools[i + 1 :]]
    return tools


def _calls_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """JSON schema of a ``required`` reply: an array of ``{"name", "arguments"}`` calls."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, "arguments": _parameters(t["function"])},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """The request's :class:`ToolPlan`, or None when it sends no tools and no ``tool_choice``.

    Raises:
        OpenAIError: 400 naming the field: malformed ``tools`` (names, duplicates, a parameters
            schema that does not compile), a ``tool_choice`` that is not ``none``/``auto``/
            ``required`` or names no defined function, ``tool_choice`` other than ``none``
            without tools, or a tool choice combined with an output format.
    """
    tools = _check_tools(body.tools) if body.tools is not None else []
    choice = body.tool_choice
    if not tools and choice in (None, "none"):
        return None
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _refuse("tool_choice", f"must be 'none', 'auto', 'required' or a named function, got {choice[:40]!r}")
        mode, name = choice, None
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        mode, name = "named", choice["function"].get("name")
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise _refuse("tool_choice", f"names the function {str(name)[:64]!r}, which is not among the tools")
    else:
        raise _refuse("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")
    if mode != "none" and not tools:
        raise _refuse("tool_choice", f"{mode!r} needs tools")
    if mode == "none":
        return ToolPlan([], "none", None, body.parallel_tool_calls)
    plan = ToolPlan(tools, mode, name, body.parallel_tool_calls)
    if mode == "named":
        function = next(t["function"] for t in tools if t["function"]["name"] == name)
        plan.constraint = _build("tool_choice", json=_parameters(function))
    elif mode == "required":
        plan.constraint = _checked(_build("tools", json=_calls_schema(tools, body.parallel_tool_calls)), "tools")
    return plan


def chat_constraints(body: ChatCompletionRequest) -> tuple[ToolPlan | None, Any]:
    """The chat request's tool plan and the one constraint on its reply (the tool choice's or
    the format's; both at once is a 400 naming ``response_format``)."""
    plan = tool_plan(body)
    constraint = constraint_of(body)
    if plan is not None and plan.mode != "none" and constraint is not None:
        raise OpenAIError(
            f"response_format: an output format cannot be combined with tool_choice {plan.mode!r}; "
            "send tool_choice 'none' to get the format", param="response_format", code="invalid_value",
        )
    return plan, plan.constraint if plan is not None and plan.constraint is not None else constraint


def constrained(body: _SamplingRequest) -> bool:
    """The body sends a field that may constrain the output (checked in a worker thread)."""
    fields = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
    return any(getattr(body, f) is not None for f in fields) or getattr(body, "tools", None) is not None or getattr(
        body, "tool_choice", None
    ) is not None
