"""Agents for slime's agentic rollout (``pipelines.slime.agentic``): the demo's environments, one sample each.

An agent is any callable ``agent(base_url, sample, sampling) -> reward | None``: it talks to the
model through ``base_url`` (an OpenAI-compatible endpoint of trajbus's gateway, which records every
call token-exactly), reads the prompt and label off slime's ``sample``, passes ``sampling``
(temperature, top_p, max_tokens from slime's arguments) to its calls, and returns its reward (None:
the gateway's ``--reward-function`` scores the trajectory). The rollout opens and completes the
trajectory around it; an exception gives the sample's whole group up.

``calculator_agent`` is the demo's ``CalculatorEnv``: the model may call a ``calculator`` tool, each
call is answered with the evaluated expression (a tool turn, loss-masked), and the reward is 1.0 when
the last number of its final answer is the label. ``math_agent`` is ``MathEnv``: one answer, same reward.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from trajbus.pipelines.agents import converse
from trajbus.pipelines.envs import CalculatorEnv, MathEnv

__all__ = ["Agent", "calculator_agent", "env_agent", "math_agent"]

Agent = Callable[[str, Any, dict[str, Any]], "float | None"]
MAX_TURNS = 8


_shared: Any = None
_shared_lock = threading.Lock()


def _client(base_url: str) -> Any:
    """An ``openai.OpenAI`` on ``base_url`` sharing one connection pool: a new client costs ~20 ms of CPU
    (its SSL context), a copy with another base_url 0.1 ms."""
    global _shared
    with _shared_lock:
        if _shared is None:
            import openai

            _shared = openai.OpenAI(base_url=base_url, api_key="trajbus", max_retries=0)
    return _shared.with_options(base_url=base_url)


class _OneItem:
    """A dataset of one item, the sample's prompt and label, as the demo's environments read theirs."""

    def __init__(self, sample: Any) -> None:
        self.item = {"prompt": sample.prompt if isinstance(sample.prompt, str) else "", "label": sample.label}

    def get_data_item(self, seed: int) -> dict[str, Any]:
        return self.item


def env_agent(env_class: Callable[[Any], Any], max_turns: int = MAX_TURNS) -> Agent:
    """An agent that plays ``env_class`` (built on a dataset of one item) on the sample's prompt; a prompt
    that is a list of messages (slime's chat-format prompts) is the conversation as it is."""

    def agent(base_url: str, sample: Any, sampling: dict[str, Any]) -> float:
        env = env_class(_OneItem(sample))
        observation = env.reset(0)
        if isinstance(sample.prompt, list):
            observation.messages = list(sample.prompt)
        feedback, _turns = converse(_client(base_url), env, observation, sampling, max_turns)
        return feedback.reward

    agent.__name__ = f"{getattr(env_class, '__name__', 'env')}_agent"
    return agent


calculator_agent = env_agent(CalculatorEnv)
math_agent = env_agent(MathEnv)
