"""The ``calculator`` tool: arithmetic on int and float literals, parsed with ``ast`` and never evaluated by
Python: ``+ - * / // % **``, unary ``+``/``-`` and parentheses, nothing else (no names, calls, attributes).

Guards keep a call cheap whatever the model writes: the expression's length, exponents (``|e| <= 100``) and
the size of every intermediate integer (``MAX_INT_BITS``, checked before a power is computed). Results: an
integral value prints as an int (``5535``, also ``10/2`` -> ``5``), another float with 15 significant digits
(``0.1+0.2`` -> ``0.3``).
"""

from __future__ import annotations

import ast
import math
import operator

from hybridflow.agent.tools import Tool, ToolResult, register_tool

__all__ = ["Calculator", "evaluate"]

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 100
MAX_INT_BITS = 4000  # ~1200 digits, under Python's 4300-digit int <-> str limit

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_HINTS = {ast.BitXor: " (use ** for powers)"}


class CalculatorError(ValueError):
    """The expression is not one the calculator evaluates (a message for the model)."""


def _check_size(value):
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"result too large (more than {MAX_INT_BITS} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number")
    return value


def _power(base, exp):
    if abs(exp) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exp} too large (at most {MAX_EXPONENT} in absolute value)")
    if isinstance(base, int) and isinstance(exp, int) and exp > 0 and base.bit_length() * exp > MAX_INT_BITS:
        raise CalculatorError(f"result too large (more than {MAX_INT_BITS} bits)")
    result = base ** exp
    if isinstance(result, complex):  # e.g. (-8) ** 0.5
        raise CalculatorError("result is not a real number")
    return result


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, complex or str
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(left, right))
        return _check_size(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.BinOp):
        raise CalculatorError(f"unsupported operator {type(node.op).__name__}{_HINTS.get(type(node.op), '')}")
    if isinstance(node, ast.Constant):
        raise CalculatorError(f"unsupported literal {node.value!r}: only numbers")
    raise CalculatorError(f"unsupported expression: {type(node).__name__} (only numbers, + - * / // % ** and "
                          "parentheses)")


def _format(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.15g}"
    return str(value)


def evaluate(expression: str) -> str:
    """The value of ``expression`` as text; CalculatorError (or ZeroDivisionError, OverflowError) if none."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression too long ({len(expression)} characters, at most {MAX_EXPRESSION_CHARS})")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise CalculatorError(f"cannot parse the expression: {getattr(e, 'msg', e)}") from None
    return _format(_eval(tree))


@register_tool("calculator")
class Calculator(Tool):
    default_schema = {"type": "function", "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        "parameters": {"type": "object", "required": ["expression"], "properties": {
            "expression": {"type": "string", "description": "e.g. (12 + 3.5) * 4 / 2"}}}}}
    config_keys = ()

    def run(self, arguments: dict) -> str | ToolResult:
        try:
            return evaluate(arguments["expression"])
        except CalculatorError as e:
            return ToolResult(f"Error: {e}", "bad_arguments")
        except ZeroDivisionError:
            return ToolResult("Error: division by zero", "exception")
        except (OverflowError, RecursionError) as e:
            return ToolResult(f"Error: {e}", "exception")
