"""Rewards for trajectories: a Python function by dotted path, or a named Ray actor.

Black-box agents often finish without a score; ``complete_trajectory`` then asks
this scorer, so no black-box group reaches the trainer without a reward. The
function (sync or async) or the actor's ``compute_reward`` receives one dict:
``trajectory_uid``, ``prompt_uid``, ``channel``, ``metadata`` (e.g. the ground
truth given at ``init_trajectory``), ``messages`` (the last conversation, the
final answer included) and ``response_text``; white-box ``/compute_reward``
passes its JSON body as that dict. It returns a finite number.

``answer_match`` is one such function, shipped so that a gateway scores
arithmetic answers without code of the user's own
(``--reward-function trajbus.gateway.rewards:answer_match``; README.md).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import re
from typing import Any, Callable

from trajbus.gateway.errors import GatewayError
from trajbus.infra import ray_exit
from trajbus.infra.dotted import import_dotted

log = logging.getLogger("trajbus.gateway")

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def answer_match(trajectory: dict[str, Any]) -> float:
    """1.0 when the final reply gives ``metadata["answer"]``, else 0.0. A numeric answer is compared with
    the reply's last number ("3 + 4 = 7." gives 7; "1,000" and "1000.0" are 1000); any other answer with
    the whole reply, stripped and case-folded."""
    metadata = trajectory.get("metadata") or {}
    if "answer" not in metadata:
        raise ValueError("answer_match: the trajectory's metadata has no 'answer' (give it at init_trajectory)")
    answer, reply = str(metadata["answer"]).strip(), str(trajectory.get("response_text") or "").strip()
    expected = _number(answer)
    if expected is None:
        return float(reply.casefold() == answer.casefold())
    numbers = NUMBER.findall(reply)
    return float(bool(numbers) and _number(numbers[-1]) == expected)


def _number(text: str) -> float | None:
    """``text`` as a number if it is one ("1,000" included; "nan" is text), else None."""
    return float(text.replace(",", "")) if NUMBER.fullmatch(text) else None


class RewardUnavailable(RuntimeError):
    """No reward function or worker is configured, or it cannot be reached."""


class RewardScorer:
    def __init__(self, function: str | None = None, worker_name: str | None = None,
                 ray_address: str | None = None, ray_namespace: str | None = None) -> None:
        self._function: Callable[[dict[str, Any]], Any] | None = (
            import_dotted(function, "reward_function") if function else None)
        if self._function is not None and not callable(self._function):
            raise ValueError(f"reward_function: {function!r} is not callable")
        self.worker_name = worker_name
        self.ray_address = ray_address
        self.ray_namespace = ray_namespace
        self._actor = None

    @property
    def configured(self) -> bool:
        return self._function is not None or self.worker_name is not None

    def _ray_actor(self):
        if self._actor is None:
            import ray

            if not ray.is_initialized():
                ray_exit.connect(address=self.ray_address or "auto", namespace=self.ray_namespace,
                                 ignore_reinit_error=True, log_to_driver=False)
            self._actor = ray.get_actor(self.worker_name, namespace=self.ray_namespace)
        return self._actor

    async def score(self, trajectory: dict[str, Any]) -> float:
        if self._function is not None:
            if inspect.iscoroutinefunction(self._function):
                value = await self._function(trajectory)
            else:
                value = await asyncio.to_thread(self._function, trajectory)
        elif self.worker_name is not None:
            try:
                with ray_exit.keep_signal_handlers():  # on the event loop's (main) thread: uvicorn's stay
                    actor = await asyncio.to_thread(self._ray_actor)
            except Exception as exc:
                raise RewardUnavailable(f"reward worker {self.worker_name!r} unreachable: {exc}") from exc
            value = await actor.compute_reward.remote(trajectory)
        else:
            raise RewardUnavailable("no reward given and no --reward-function or --reward-worker-name configured")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"reward: the reward function returned {value!r}, not a finite number")
        return float(value)

    async def answer(self, trajectory: dict[str, Any]) -> float:
        """``score`` for a route: its failures as OpenAI-shaped errors (the reward function's own included)."""
        try:
            return await self.score(trajectory)
        except RewardUnavailable as exc:
            raise GatewayError(400 if not self.configured else 503, str(exc), code="no_reward") from None
        except ValueError as exc:
            raise GatewayError(500, str(exc), type_="server_error", code="bad_reward") from None
        except Exception as exc:  # the deployment's reward function failed: its error, as JSON
            log.warning("reward function failed: %r", exc)
            raise GatewayError(500, f"the reward function failed: {exc!r}", type_="server_error",
                               code="reward_failed") from None
