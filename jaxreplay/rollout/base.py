"""The rollout-worker interface shared by the JAX sampler and the vLLM engine.

A worker turns prompts into groups of sampled completions, each token with the sampler's own
log-probability, and is tagged with the policy version of the weights that produced them. What the
backends share lives here too (numpy only, so that the generic pool never imports vLLM or JAX):
the weights handle, the records a pool passes around (`PromptBatch`, `Delivery`), the exceptions
(`WorkerDied`, `StaleWeights`, `PoolStopped`), the greedy threshold and the prompt check.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol, Sequence

import numpy as np

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below it sample greedily.


class WorkerDied(RuntimeError):
  """A rollout worker's process is gone (crashed, killed, or stopped answering)."""


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
  `finish_reason` is "stop" (a stop token was sampled) or "length" (max_tokens reached).
  `versions`: int32 [L], the policy version that sampled each token, for a completion continued
  across weight refreshes (config `rollout.partial`, module `rollout.partial`); None: every token
  was sampled at its group's `policy_version`."""
  tokens: np.ndarray
  logprobs: np.ndarray
  finish_reason: str
  versions: Optional[np.ndarray] = None


@dataclasses.dataclass
class Group:
  """The n completions of one prompt, all sampled with weights of `policy_version` (completions
  continued across a refresh: the version they started at, their oldest tokens'; each token's
  own is in `Completion.versions`)."""
  prompt_tokens: np.ndarray
  completions: list[Completion]
  policy_version: int
  prompt_index: int = 0  # position of the prompt in the `generate` call


@dataclasses.dataclass(frozen=True)
class Weights:
  """One policy version's weights as a rollout worker loads them (an opaque handle: the pool
  passes it on).

  version: the policy version; params: a parameter pytree for in-process JAX samplers (None
  otherwise); hf_dir: an HF directory written by hf_io.save_hf, for engines in other processes
  (transport "file"; None otherwise); shm_path: a shared-memory segment of HF tensors
  (`rollout.weights.shm_format`, transport "shm"; None otherwise); cfg: the ModelConfig of params
  (optional); ready: None when the weights are complete, else a `concurrent.futures.Future` that
  the publisher settles when the segment is written (it is written off the trainer's thread).
  lora_dir: LoRA (model.lora_rank > 0) for vLLM engines: the version's adapter directory in PEFT's
  format (`rollout.weights.adapter_publisher`); the engine keeps its base and swaps the adapter.
  object_ref: the Ray object-store copy (rollout.placement="ray", `rollout.ray.group`): a
  `concurrent.futures.Future` of the `ray.publisher.StoredWeights` (settled, like `ready`, when the
  background `ray.put` is done), or such a record itself; None otherwise.
  `ready` and `object_ref` stay in this process: they are not compared, and `portable()` drops them.
  """
  version: int
  params: Any = None
  hf_dir: Optional[str] = None
  cfg: Any = None
  shm_path: Optional[str] = None
  lora_dir: Optional[str] = None
  ready: Any = dataclasses.field(default=None, compare=False, repr=False)
  object_ref: Any = dataclasses.field(default=None, compare=False, repr=False)

  def is_ready(self) -> bool:
    """Whether the weights can be loaded now without waiting for the publisher."""
    return self.ready is None or self.ready.done()

  def wait(self, timeout_s: Optional[float] = None) -> None:
    """Blocks until the publisher has written these weights; re-raises its error."""
    if self.ready is not None:
      self.ready.result(timeout_s)

  def portable(self) -> "Weights":
    """What a worker in another process gets: version, hf_dir, shm_path and lora_dir (waits until
    ready)."""
    self.wait()
    return Weights(version=int(self.version), hf_dir=self.hf_dir, shm_path=self.shm_path,
                   lora_dir=self.lora_dir)


class RolloutWorker(Protocol):
  """What every backend implements.

  policy_version: the version of the weights the worker holds.
  call_count: generate calls so far, for a worker whose sampling noise follows them (the JAX
    sampler: call k draws from fold_in(seed, sampling.seed, k)); assignable, so a resumed run (and
    an evaluation) continues that noise stream. None for a worker without one (vLLM engines seed
    each request themselves).
  """

  policy_version: int
  call_count: Optional[int]

  def generate(self, prompts: Sequence[np.ndarray], n: int, sampling: SamplingParams) -> list[Group]:
    """Samples `n` completions for each prompt (int32 [Lp] token arrays); one Group per prompt."""

  def load_weights(self, weights: Weights) -> None:
    """Loads `weights` (the form this backend needs: params or hf_dir); later groups carry
    `weights.version`. A handle without that form is a ValueError."""

  def close(self) -> None:
    """Releases the engine (processes, memory)."""


def check_prompts(prompts: Sequence[np.ndarray], vocab_size: int, max_len: int, max_tokens: int, *,
                  max_len_name: str = "max_len") -> list[np.ndarray]:
  """Checks the prompts of a `generate` call; returns them as int32 [Lp] arrays, in order.

  Each prompt must be a non-empty 1-D integer array of ids in [0, vocab_size) with
  Lp + max_tokens <= max_len (the worker's longest prompt + completion, in tokens; called
  `max_len_name` in its constructor). An empty list passes (the caller decides what that means).
  Raises ValueError naming the prompt, the problem and the fix.
  """
  out = []
  for i, p in enumerate(prompts):
    p = np.asarray(p)
    if p.ndim != 1 or p.size == 0 or not np.issubdtype(p.dtype, np.integer):
      raise ValueError(f"prompt {i}: expected a non-empty 1-D integer token array, got shape "
                       f"{p.shape} dtype {p.dtype}; pass each prompt as np.asarray(token_ids, "
                       "np.int32)")
    if p.min() < 0 or p.max() >= vocab_size:
      raise ValueError(f"prompt {i} has token ids outside [0, vocab_size={vocab_size}) (min "
                       f"{p.min()}, max {p.max()}); tokenize with this model's tokenizer")
    total = p.size + max_tokens
    if total > max_len:
      raise ValueError(f"prompt {i} has {p.size} tokens and max_tokens={max_tokens}: {p.size} + "
                       f"{max_tokens} = {total} exceeds the worker's {max_len_name}={max_len}; "
                       f"build the worker with {max_len_name} >= {total}, lower "
                       "SamplingParams.max_tokens, or truncate the prompt")
    out.append(p.astype(np.int32))
  return out


# ---- the records of a pool of workers (`rollout.pool`) and its exceptions -----------------

class StaleWeights(RuntimeError):
  """The weights a worker was told to load were superseded before it read them (e.g. a reused
  shared-memory slot): the worker keeps the version it holds and loads the newest next."""


class PoolStopped(RuntimeError):
  """A request finished after the pool was told to stop: not delivered (its prompts go back)."""


@dataclasses.dataclass
class PromptBatch:
  """One request: prompts (int32 [Lp] arrays), n samples each, settings; `meta` rides along."""
  prompts: list[np.ndarray]
  n: int
  sampling: SamplingParams
  meta: Any = None


@dataclasses.dataclass
class Delivery:
  """What the sink receives: the groups of one whole request, all of `policy_version`.
  `generate_seconds` is the request's share (by generated tokens) of the call that made it."""
  groups: list[Group]
  batch: PromptBatch
  worker_index: int
  policy_version: int
  generate_seconds: float
  num_tokens: int
  prepared: Any = None  # what the pool's `prepare` returned for it (None without one)
