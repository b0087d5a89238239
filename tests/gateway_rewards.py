"""Reward functions the gateway tests load by dotted path."""


def exact_match(trajectory: dict) -> float:
    """1.0 when the last answer equals the ground truth given at init_trajectory."""
    return float(trajectory["response_text"].strip() == trajectory["metadata"].get("answer"))
