"""Reward functions the gateway tests load by dotted path."""


def exact_match(trajectory: dict) -> float:
    """1.0 when the last answer equals the ground truth given at init_trajectory."""
    return float(trajectory["response_text"].strip() == trajectory["metadata"].get("answer"))


class RewardActor:
    """The same reward behind a named Ray actor (``--reward-worker-name``); counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def compute_reward(self, trajectory: dict) -> float:
        self.calls += 1
        return exact_match(trajectory)

    def count(self) -> int:
        return self.calls
