"""A calculator tool for arithmetic tasks: the expression is parsed with ``ast`` and only
numbers, ``+ - * / // % **``, unary minus/plus and parentheses are evaluated (never ``eval``),
with bounded sizes so that no expression can take long or use much memory."""

from __future__ import annotations

import ast
import operator

MAX_EXPRESSION_CHARS = 200
MAX_INTEGER_BITS = 256  # every integer operand and result; floats are bounded by their type
MAX_EXPONENT = 64

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers combined with + - * / // % ** and parentheses, e.g. "(12 + 7) * 3".
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from error
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponents are limited to {MAX_EXPONENT} in absolute value")
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) \
                and left.bit_length() * right > MAX_INTEGER_BITS:
            raise ValueError(f"the result would have more than {MAX_INTEGER_BITS} bits")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large") from None
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {ast.unparse(node)!r}")


def _bounded(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_INTEGER_BITS:
        raise ValueError(f"numbers are limited to {MAX_INTEGER_BITS} bits")
    if isinstance(value, complex):
        raise ValueError("the result is not a real number")
    return value
