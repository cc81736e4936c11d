"""The rollout-worker interface shared by the JAX sampler and the vLLM engine.

A worker turns prompts into groups of sampled completions, each token with the sampler's own
log-probability, and is tagged with the policy version of the weights that produced them.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Sampling settings. `top_k=0` and `top_p=1.0` disable those filters; `max_tokens` counts
  generated tokens; generation stops after a token in `stop_token_ids` (that token is kept)."""
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  max_tokens: int = 64
  stop_token_ids: tuple[int, ...] = ()
  seed: int = 0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
    if self.top_k < 0:
      raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables it)")
    if self.max_tokens < 1:
      raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")


@dataclasses.dataclass
class Completion:
  """One sampled completion: tokens int32 [L] and their sampler log-probs float32 [L].
  `finish_reason` is "stop" (a stop token was sampled) or "length" (max_tokens reached)."""
  tokens: np.ndarray
  logprobs: np.ndarray
  finish_reason: str


@dataclasses.dataclass
class Group:
  """The n completions of one prompt, all sampled with weights of `policy_version`."""
  prompt_tokens: np.ndarray
  completions: list[Completion]
  policy_version: int
  prompt_index: int = 0  # position of the prompt in the `generate` call


class RolloutWorker(Protocol):
  """What every backend implements."""

  policy_version: int

  def generate(self, prompts: Sequence[np.ndarray], n: int, sampling: SamplingParams) -> list[Group]:
    """Samples `n` completions for each prompt (int32 [Lp] token arrays); one Group per prompt."""

  def update_weights(self, hf_dir: str, version: int) -> None:
    """Loads the weights written by `models.save_hf` into `hf_dir`; later groups carry `version`."""

  def close(self) -> None:
    """Releases the engine (processes, memory)."""
