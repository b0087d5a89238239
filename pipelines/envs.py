"""Environments the env managers roll out: a math question, and a calculator tool.

Both read their items from a dataset (a ``GlobalDataset``, local or a Ray
actor) by episode seed, and score the final answer by exact match of its last
number with the item's label. ``CalculatorEnv`` offers a ``calculator`` tool
and answers tool calls with the evaluated expression, so multi-turn tool use
goes through the black-box gateway as a real agent's would.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from dataclasses import dataclass, field
from typing import Any

from trajbus.infra.tiny_model import CALCULATOR_TOOL


@dataclass
class Observation:
    """The start of an episode: the conversation, the tools offered, the item."""

    messages: list[dict[str, Any]]
    label: str
    tools: list[dict[str, Any]] | None = None
    item: dict[str, Any] = field(default_factory=dict)


@dataclass
class Feedback:
    """The environment's answer to one model reply."""

    messages: list[dict[str, Any]]
    reward: float
    done: bool


def _item(dataset: Any, seed: int) -> dict[str, Any] | None:
    if hasattr(dataset.get_data_item, "remote"):
        import ray

        return ray.get(dataset.get_data_item.remote(seed))
    return dataset.get_data_item(seed)


def final_number(text: str | None) -> str | None:
    numbers = re.findall(r"-?\d+", text or "")
    return numbers[-1] if numbers else None


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """Arithmetic only (no names, no calls): the calculator tool's result, or an error text."""
    def evaluate(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](evaluate(node.operand))
        raise ValueError("only numbers and + - * / // % are allowed")

    try:
        value = evaluate(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else str(value)


class MathEnv:
    """One question, one answer; reward 1.0 for the exact number."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.label = ""

    def reset(self, seed: int) -> Observation | None:
        item = _item(self.dataset, seed)
        if item is None:
            return None
        self.label = str(item["label"])
        return Observation([{"role": "user", "content": item["prompt"]}], self.label, None, item)

    def step(self, reply: dict[str, Any]) -> Feedback:
        return Feedback([], float(final_number(reply.get("content")) == self.label), True)


class CalculatorEnv(MathEnv):
    """A question with a ``calculator`` tool: tool calls are answered until a final answer or ``max_turns``."""

    def __init__(self, dataset: Any, max_turns: int = 3) -> None:
        super().__init__(dataset)
        self.max_turns = max_turns
        self.turns = 0

    def reset(self, seed: int) -> Observation | None:
        observation = super().reset(seed)
        if observation is not None:
            observation.tools = [CALCULATOR_TOOL]
            self.turns = 0
        return observation

    def step(self, reply: dict[str, Any]) -> Feedback:
        self.turns += 1
        calls = reply.get("tool_calls") or []
        if not calls:
            return super().step(reply)
        results = []
        for call in calls:
            try:
                expression = json.loads(call["function"]["arguments"]).get("expression", "")
            except (ValueError, AttributeError, KeyError):
                expression = ""
            results.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": calculate(str(expression))})
        return Feedback(results, 0.0, self.turns >= self.max_turns)
