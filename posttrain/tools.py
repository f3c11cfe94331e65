"""Tools the policy may call between turns: resolving them, the JSON schema the chat template
shows, parsing the model's calls, and the built-ins.

A tool is a plain Python function with type hints and a Google-style docstring (an `Args:` line
per parameter); transformers' `get_json_schema` turns it into the JSON schema that
`apply_chat_template(..., tools=...)` renders. A spec names it the way a reward is named:
a built-in (`calculator`, `python`), `package.module:function`, or `path/to/file.py:function`.

The model calls tools in its own syntax; `agent.parser` picks the parser:
  hermes  Qwen3 / Hermes / NousResearch: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
          one block per call (JSON inside, `arguments` an object or a JSON string).
A parse never raises: a block that is not valid JSON, or lacks a name, is a malformed call that
the environment answers with an error message (and counts).
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from posttrain.errors import UserError
from posttrain.plugins import load_object
from posttrain.sandbox import run_program


@dataclass
class ToolCall:
    name: str | None
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # why the call is malformed (then name/arguments are unusable)


# ---- parsers -------------------------------------------------------------------------------------
_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    """Every `<tool_call>...</tool_call>` block of a model turn, in order."""
    calls = []
    for m in _HERMES.finditer(text):
        body, closed = m.group(1).strip(), bool(m.group(2))
        if not closed:
            calls.append(ToolCall(None, error="a <tool_call> block is not closed by </tool_call>"))
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, error=f"the tool call is not valid JSON ({e.msg} at "
                                              f"char {e.pos})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall(None, error='a tool call is {"name": ..., "arguments": {...}}'))
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], error="the call's arguments are not a JSON object"))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


PARSERS: dict[str, Callable[[str], list[ToolCall]]] = {"hermes": parse_hermes}


def format_hermes(name: str, arguments: dict) -> str:
    """A call as the hermes parser reads it (what the chat template writes for `tool_calls`)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# ---- built-in tools --------------------------------------------------------------------------------
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def _arith(node):
    if isinstance(node, ast.Expression):
        return _arith(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arith(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _arith(node.left), _arith(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {ast.unparse(node)}")


def calculator(expression: str) -> str:
    """Evaluate arithmetic.

    Args:
        expression: e.g. 37 * 48
    """
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = _arith(ast.parse(expression.strip(), mode="eval"))
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def python(code: str) -> str:
    """Run a Python program in an isolated sandbox and return what it prints.

    Args:
        code: the program; its standard output is the result
    """
    out = run_program(code)
    if out.status != "ok":
        return f"{out.status}: {out.error}"
    return out.stdout


def builtin_tools() -> dict[str, Callable]:
    return {"calculator": calculator, "python": python}


def resolve_tool(fn: str) -> Callable:
    """A tool spec to its function (the same forms as a reward spec)."""
    builtins = builtin_tools()
    if fn in builtins:
        return builtins[fn]
    if ":" not in fn:
        raise UserError(f"tool {fn!r}: not a built-in ({', '.join(sorted(builtins))}), "
                        "module:function or file.py:function")
    f = load_object(fn)
    if not callable(f):
        raise UserError(f"tool {fn!r}: resolves to a non-callable {type(f).__name__}")
    return f


def tool_schema(f: Callable, spec: str, bound: tuple[str, ...] = ()) -> dict:
    """The JSON schema the chat template shows for a tool (from its type hints and docstring),
    without the `bound` parameters (the recipe's kwargs: the model never sees them)."""
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(f)
    except Exception as e:  # DocstringParsingException, TypeHintParsingException
        raise UserError(f"tool {spec}: cannot build its JSON schema: {e}. A tool needs type hints "
                        "and a docstring with a description and an `Args:` line per parameter "
                        "(Google style)") from None
    params = schema["function"].get("parameters", {})
    for name in bound:
        if name not in params.get("properties", {}):
            raise UserError(f"tool {spec}: kwargs names {name!r}, which is not a parameter")
        del params["properties"][name]
        if name in params.get("required", []):
            params["required"].remove(name)
    return schema


def call_tool(fn: str, arguments: dict, kwargs: dict) -> str:
    """Run one call (in a tool worker process); the result is what the model reads."""
    out = resolve_tool(fn)(**arguments, **kwargs)
    return out if isinstance(out, str) else json.dumps(out)
