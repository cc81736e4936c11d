"""The PyTorch + transformers GRPO train step: the peer that `bench_train_step.py` times jaxreplay against.

What a torch RL post-training library (TRL's GRPOTrainer) runs per update, reduced to one process:
`transformers.Qwen3ForCausalLM` (float32, SDPA attention) loaded from the same HF dir as jaxreplay,
full [B, T, V] logits -> log_softmax -> the targets' log-probs, the GRPO clipped-ratio loss with
jaxreplay's default aggregation ("token_mean", `jaxreplay.learner.losses.grpo_loss`), backward,
global-norm gradient clipping and `torch.optim.AdamW` with the hyperparameters of
`jaxreplay.learner.optim.make_optimizer` (b1, b2, eps, weight decay on every leaf but norms and biases).

torch is imported only here; `bench_train_step.py` imports this module only when torch is installed.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
import transformers


@dataclasses.dataclass(frozen=True)
class PeerSettings:
  """The optimizer and loss settings the peer shares with jaxreplay's train step."""
  learning_rate: float = 1e-5
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  eps_low: float = 0.2
  eps_high: float = 0.2


def load_model(hf_dir: str) -> torch.nn.Module:
  """Qwen3ForCausalLM from `hf_dir` in float32, SDPA attention, train mode."""
  model = transformers.Qwen3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                        attn_implementation="sdpa")
  model.train()
  return model


def _param_groups(model: torch.nn.Module, weight_decay: float):
  """Weight decay on every parameter but norms and biases (jaxreplay.learner.optim.NO_DECAY_PATTERN)."""
  decay, no_decay = [], []
  for name, p in model.named_parameters():
    (no_decay if name.endswith("norm.weight") or name.endswith("bias") else decay).append(p)
  return [{"params": decay, "weight_decay": weight_decay},
          {"params": no_decay, "weight_decay": 0.0}]


def grpo_loss(logprobs, behaviour, advantages, mask, eps_low: float, eps_high: float):
  """Token-mean GRPO clipped surrogate, as `jaxreplay.learner.losses.grpo_loss` with aggregation token_mean.

  logprobs, behaviour, mask float32 [B, T]; advantages [B] -> scalar loss.
  """
  valid = mask > 0
  lp = torch.where(valid, logprobs, torch.zeros_like(logprobs))
  old = torch.where(valid, behaviour, torch.zeros_like(behaviour))
  ratio = torch.exp(lp - old)
  adv = advantages[:, None]
  objective = torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv)
  return -(objective * mask).sum() / mask.sum().clamp(min=1.0)


class TorchGrpoStep:
  """One GRPO update of a transformers model per call; `step()` returns the loss before the update.

  Args:
    hf_dir: the HF model directory jaxreplay loads too.
    batch: a `jaxreplay.learner.batch.Batch` of numpy arrays (unpacked: one rollout per row).
    settings: the shared hyperparameters.
  """

  def __init__(self, hf_dir: str, batch, settings: PeerSettings = PeerSettings()):
    self.model = load_model(hf_dir)
    self.settings = settings
    self.optimizer = torch.optim.AdamW(
        _param_groups(self.model, settings.weight_decay), lr=settings.learning_rate,
        betas=(settings.b1, settings.b2), eps=settings.eps)
    as_long = lambda x: torch.from_numpy(np.asarray(x, np.int64))
    as_f32 = lambda x: torch.from_numpy(np.asarray(x, np.float32))
    self.tokens = as_long(batch.tokens)
    self.positions = as_long(batch.positions)
    self.attention_mask = as_long(np.asarray(batch.segment_ids) > 0)
    self.targets = as_long(batch.targets)
    self.mask = as_f32(batch.completion_mask)
    self.behaviour = as_f32(batch.behaviour_logprobs)
    self.advantages = as_f32(batch.advantages)

  def step(self) -> float:
    s = self.settings
    self.optimizer.zero_grad(set_to_none=True)
    logits = self.model(input_ids=self.tokens, attention_mask=self.attention_mask,
                        position_ids=self.positions, use_cache=False).logits  # [B, T, V] f32
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, self.targets[..., None])[..., 0]
    loss = grpo_loss(logprobs, self.behaviour, self.advantages, self.mask, s.eps_low, s.eps_high)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(self.model.parameters(), s.max_grad_norm)
    self.optimizer.step()
    return float(loss.detach())
