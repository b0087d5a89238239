"""A real GRPO update of the tiny policy on batches that came through trajbus.

verl computes the group-normalised advantages (``compute_grpo_outcome_advantage``)
and the clipped policy loss (``vanilla``) on the ``DataProto`` the consumer
built; torch computes the current log-probs of the sampled response tokens and
takes the optimizer step. The new weights are saved where the inference
server reloads them from. Runs on CPU; on a GPU when one is there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class StepReport:
    loss: float
    nll: float
    """Mean negative log-likelihood of the sampled response tokens under the policy before the update."""
    reward: float
    rows: int
    tokens: int


class GRPOTrainer:
    def __init__(self, model_dir: Path, learning_rate: float = 2e-3, clip_ratio: float = 0.2,
                 device: str | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the demo prints its own progress
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model_dir = Path(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=learning_rate, weight_decay=0.0)
        self.clip_ratio = clip_ratio

    def step(self, batch: Any) -> StepReport:
        import torch
        from omegaconf import OmegaConf
        from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, get_policy_loss_fn

        tensors = {k: v.to(self.device) for k, v in batch.batch.items()}
        mask = tensors["response_mask"]
        advantages, _ = compute_grpo_outcome_advantage(token_level_rewards=tensors["rm_scores"],
                                                       response_mask=mask, index=batch.non_tensor_batch["uid"])
        self.model.train()
        responses = tensors["responses"]
        logits = self.model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"],
                            position_ids=tensors["position_ids"]).logits
        logits = logits[:, -responses.size(1) - 1:-1].float() / batch.meta_info.get("temperature", 1.0)
        log_probs = torch.log_softmax(logits, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        old = tensors.get("rollout_log_probs", log_probs.detach())
        tokens = int(mask.sum())
        config = OmegaConf.create({"clip_ratio": self.clip_ratio, "clip_ratio_low": self.clip_ratio,
                                   "clip_ratio_high": self.clip_ratio,
                                   "global_batch_info": {"dp_size": 1, "batch_num_tokens": tokens,
                                                         "global_batch_size": responses.size(0)}})
        loss, _metrics = get_policy_loss_fn("vanilla")(old_log_prob=old, log_prob=log_probs, advantages=advantages,
                                                      response_mask=mask, loss_agg_mode="token-mean", config=config)
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        nll = float(-(log_probs.detach() * mask).sum() / mask.sum().clamp(min=1))
        reward = float(tensors["rm_scores"].sum(-1).mean())
        return StepReport(loss.item(), nll, reward, responses.size(0), int(tensors["attention_mask"].sum()))

    def save(self) -> Path:
        """Write the weights where the inference server reloads them from."""
        self.model.save_pretrained(self.model_dir)
        return self.model_dir
