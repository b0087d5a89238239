"""Agents that play an episode of an environment through the gateway, and submit it once.

``BlackBoxAgent`` is what an external agent framework looks like to trajbus:
it gets a ``base_url`` and uses the official ``openai`` client; the gateway
captures every call as a Step; the agent's one submission is
``complete_trajectory`` with the environment's reward.
``WhiteBoxAgent`` tokenizes itself, calls ``/generate`` with token ids and
submits all of its steps (the last with the reward) in one ``/submit_steps``.

A gateway that paces generation answers a new trajectory 429 while the trainer
lags: both agents ask to be held (``?wait=``) and, refused all the same, wait
``Retry-After`` and ask again, until admitted or stopped.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import httpx

from trajbus.gateway.prompts import tool_calls
from trajbus.infra.retry import RetryLater, retrying_when_told
from trajbus.pipelines.envs import Feedback, Observation


@dataclass
class Episode:
    """What one episode produced, for the env manager's bookkeeping."""

    trajectory_uid: str
    prompt_uid: str
    reward: float
    turns: int


class AgentStopped(Exception):
    """The agent was stopped while a new trajectory waited for admission."""


ADMISSION_WAIT = 30.0
"""Seconds a new trajectory asks the gateway to hold it (``?wait=``) before a 429."""


class GatewayAgent:
    def __init__(self, gateway_url: str, api_key: str | None = None, channel: str = "train",
                 sampling: dict[str, Any] | None = None, timeout: float = 120.0) -> None:
        self.gateway_url = gateway_url.rstrip("/")
        self.channel = channel
        self.sampling = {"temperature": 1.0, "max_tokens": 32, **(sampling or {})}
        self.http = httpx.Client(timeout=timeout, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        self.refusals = 0
        """429s this agent waited out (the gateway pacing it)."""
        self._stopped = threading.Event()

    def _post(self, url: str, **kwargs: Any) -> dict[str, Any]:
        """POST, paced: a 429 is asked again after its ``Retry-After`` (``infra.retry``) until admitted or
        stopped (``AgentStopped``)."""
        try:
            for attempt in retrying_when_told(self._stopped):
                with attempt:
                    response = self.http.post(url, **kwargs)
                    if response.status_code == 429:
                        self.refusals += 1  # paced: wait as told, then ask again
                        raise RetryLater(response.json()["error"]["message"],
                                         float(response.headers.get("retry-after", 1)))
        except RetryLater as refusal:
            raise AgentStopped(f"stopped while {url} was refused: {refusal}") from None
        if response.status_code != 200:
            raise RuntimeError(f"POST {url} -> {response.status_code}: {response.text[:500]}")
        return response.json()

    def stop(self) -> None:
        """Give up waiting for admission (a trajectory already admitted runs to its end)."""
        self._stopped.set()

    def close(self) -> None:
        self.http.close()


def converse(client: Any, env: Any, observation: Observation, sampling: dict[str, Any],
             max_turns: int) -> tuple[Feedback, int]:
    """Chat through ``client`` (an ``openai.OpenAI`` on a base_url) until the environment says done or
    ``max_turns`` replies; returns the last feedback and the replies made."""
    messages = list(observation.messages)
    feedback = Feedback([], 0.0, False)
    turns = 0
    while not feedback.done and turns < max_turns:
        reply = client.chat.completions.create(model="policy", messages=messages, tools=observation.tools, **sampling)
        message = reply.choices[0].message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
        feedback = env.step(message)
        messages += [message, *feedback.messages]
        turns += 1
    return feedback, turns


class BlackBoxAgent(GatewayAgent):
    def run_episode(self, env: Any, observation: Observation, prompt_uid: str, n_rollouts: int,
                    metadata: dict[str, Any], max_turns: int = 8) -> Episode:
        import openai

        t = self._post(f"{self.gateway_url}/init_trajectory", params={"wait": ADMISSION_WAIT},
                       json={"prompt_uid": prompt_uid, "n_rollouts": n_rollouts, "channel": self.channel,
                             "metadata": {**metadata, "label": observation.label}})
        client = openai.OpenAI(base_url=t["base_url"], api_key="black-box", max_retries=0)
        feedback, turns = converse(client, env, observation, self.sampling, max_turns)
        self._post(f"{t['base_url']}/complete_trajectory", json={"reward": feedback.reward})  # the one submission
        return Episode(t["trajectory_uid"], prompt_uid, feedback.reward, turns)


class WhiteBoxAgent(GatewayAgent):
    def __init__(self, gateway_url: str, tokenizer_path: str, policy_version: Callable[[], int] = lambda: 0,
                 **options: Any) -> None:
        from transformers import AutoTokenizer

        super().__init__(gateway_url, **options)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.policy_version = policy_version

    def run_episode(self, env: Any, observation: Observation, prompt_uid: str, n_rollouts: int,
                    metadata: dict[str, Any], trajectory_uid: str, max_turns: int = 8) -> Episode:
        messages = list(observation.messages)
        steps: list[dict[str, Any]] = []
        feedback = Feedback([], 0.0, False)
        while not feedback.done and len(steps) < max_turns:
            text = self.tokenizer.apply_chat_template(messages, tools=observation.tools, tokenize=False,
                                                      add_generation_prompt=True)
            prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
            out = self._post(f"{self.gateway_url}/generate", params={"wait": ADMISSION_WAIT},
                             json={"prompt_ids": prompt_ids, "trajectory_uid": trajectory_uid, "prompt_uid": prompt_uid,
                                   "channel": self.channel, "step_index": len(steps), **self.sampling})
            parsed = tool_calls.parse(out["text"]) if observation.tools else tool_calls.ParsedOutput(out["text"], [])
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            if parsed.tool_calls:
                message["tool_calls"] = parsed.tool_calls
            steps.append({"prompt_ids": prompt_ids, "response_ids": out["response_ids"],
                          "rollout_log_probs": out["log_probs"], "trajectory_uid": trajectory_uid,
                          "prompt_uid": prompt_uid, "step_index": len(steps), "policy_version": self.policy_version(),
                          "metadata": {**metadata, "label": observation.label}})
            feedback = env.step(message)
            messages += [message, *feedback.messages]
        steps[-1].update(is_last=True, reward=feedback.reward)
        self._post(f"{self.gateway_url}/submit_steps", params={"channel": self.channel},  # the one submission
                   json={"steps": steps, "n_rollouts": n_rollouts})
        return Episode(trajectory_uid, prompt_uid, feedback.reward, len(steps))
