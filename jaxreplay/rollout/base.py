"""The rollout-worker interface shared by the JAX sampler and the vLLM engine.

A worker turns prompts into groups of sampled completions, each token with the sampler's own
log-probability, and is tagged with the policy version of the weights that produced them. What the
backends share lives here too (numpy only, so that the generic pool never imports vLLM or JAX):
the weights handle, the records a pool passes around (`PromptBatch`, `Delivery`), the exceptions
(`WorkerDied`, `StaleWeights`, `PoolStopped`), the greedy threshold and the prompt check.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Protocol, Sequence

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

  A multi-turn trajectory (`rollout.multiturn`) is one completion too: `tokens` holds the policy's
  turns and the environment's observations between them, `mask` float32 [L] is 1 on the policy's
  tokens and 0 on the environment's (whose `logprobs` are 0), `turn_starts` int32 [K] where each
  of the K policy turns starts, `episode` the `multiturn.EpisodeInfo` (reward, status, counts);
  `finish_reason` is then the trajectory's end (`multiturn.FINISH_REASONS`). All three are None
  for a single-turn completion.

  `versions`: int32 [L], the policy version that sampled each token, for a completion continued
  across weight refreshes (config `rollout.partial`, module `rollout.partial`); None: every token
  was sampled at its group's `policy_version`."""
  tokens: np.ndarray
  logprobs: np.ndarray
  finish_reason: str
  versions: Optional[np.ndarray] = None
  mask: Optional[np.ndarray] = None
  turn_starts: Optional[np.ndarray] = None
  episode: Any = None

  @property
  def policy_tokens(self) -> int:
    """Tokens the policy generated (all of them unless multi-turn)."""
    return len(self.tokens) if self.mask is None else int(np.sum(self.mask))

  @property
  def num_turns(self) -> int:
    """The policy's turns (1 unless multi-turn)."""
    return 1 if self.turn_starts is None else len(self.turn_starts)


class TrajectoryBuilder:
  """One row's multi-turn trajectory, assembled turn by turn: the policy's turns (mask 1, their
  log-probs) and the observations between them (mask 0, log-prob 0).

  `length` counts prompt + everything appended [tokens]; `end(reason)` closes it; `completion()`
  is the `Completion` (tokens, logprobs, mask, turn_starts; `episode` set by the caller).
  """

  def __init__(self, prompt_len: int):
    self.prompt_len = int(prompt_len)
    self.length = self.prompt_len
    self._tokens: list[np.ndarray] = []
    self._logprobs: list[np.ndarray] = []
    self._mask: list[np.ndarray] = []
    self.turn_starts: list[int] = []
    self.finish_reason: Optional[str] = None
    self.last_turn: Optional[Completion] = None

  def add_turn(self, turn: Completion) -> None:
    """Appends the policy's turn (tokens [Lt] >= 1 with their log-probs)."""
    n = len(turn.tokens)
    self.turn_starts.append(self.length - self.prompt_len)
    self._tokens.append(np.asarray(turn.tokens, np.int32))
    self._logprobs.append(np.asarray(turn.logprobs, np.float32))
    self._mask.append(np.ones(n, np.float32))
    self.length += n
    self.last_turn = turn

  def add_observation(self, tokens: np.ndarray) -> None:
    """Appends the environment's observation tokens [Lo] (never trained on)."""
    n = len(tokens)
    self._tokens.append(np.asarray(tokens, np.int32))
    self._logprobs.append(np.zeros(n, np.float32))
    self._mask.append(np.zeros(n, np.float32))
    self.length += n

  def end(self, reason: str) -> None:
    self.finish_reason = str(reason)

  @property
  def done(self) -> bool:
    return self.finish_reason is not None

  def tokens(self) -> np.ndarray:
    """int32 [length - prompt_len]: everything after the prompt so far."""
    return np.concatenate(self._tokens) if self._tokens else np.zeros(0, np.int32)

  def completion(self) -> Completion:
    return Completion(tokens=self.tokens(), logprobs=np.concatenate(self._logprobs),
                      finish_reason=self.finish_reason or "stop", mask=np.concatenate(self._mask),
                      turn_starts=np.asarray(self.turn_starts, np.int32))


class TurnDriver:
  """The token bookkeeping of one multi-turn generate call, shared by every backend's turn loop
  (`run_turns`: the generic one over `generate`, the JAX sampler's KV-cache one).

  Rows are the call's prompt r // n, sample r % n. Each turn of a row may generate up to
  `limit(r)` = min(max_tokens, max_total - its length) tokens: a trajectory never holds more than
  `max_total` tokens (prompt + turns + observations). After each turn `record` hands the turns to
  `respond` (the environment's side) and returns the rows that continue with their observations:
  a row ends when `respond` gives None, or when its observation leaves no room for a token of the
  next turn (finish reason "budget": the observation is not appended, nothing is cut mid-turn).
  A turn's finish reason is "stop" (a stop token), "length" (max_tokens) or "budget" (cut by
  the trajectory budget before max_tokens).
  """

  def __init__(self, prompt_lens: Sequence[int], n: int, max_tokens: int, max_total: int,
               respond: Respond):
    self.n, self.max_tokens, self.max_total = int(n), int(max_tokens), int(max_total)
    self.respond = respond
    self.builders = [TrajectoryBuilder(length) for length in prompt_lens for _ in range(self.n)]

  def limit(self, row: int) -> int:
    """Tokens row `row`'s next turn may generate (>= 1 for a row that continues)."""
    return min(self.max_tokens, self.max_total - self.builders[row].length)

  def record(self, turn_index: int, rows: Sequence[int], turns: Sequence[Completion],
             limits: Sequence[int]) -> list[tuple[int, np.ndarray]]:
    """Records turn `turn_index` of `rows` (generated with `limits`), asks `respond` for their
    observations, appends those that fit; returns [(row, observation tokens)] that continue."""
    rows = list(rows)
    for r, turn, limit in zip(rows, turns, limits):
      reason = turn.finish_reason
      if reason == "length" and limit < self.max_tokens:
        reason = "budget"
      self.builders[r].add_turn(dataclasses.replace(turn, finish_reason=reason))
    observations = self.respond(turn_index, rows, [self.builders[r].last_turn for r in rows])
    if len(observations) != len(rows):
      raise ValueError(f"respond returned {len(observations)} observations for {len(rows)} rows")
    out = []
    for r, obs in zip(rows, observations):
      b = self.builders[r]
      if obs is None:
        b.end(b.last_turn.finish_reason)
      elif b.length + len(obs) >= self.max_total:
        b.end("budget")
      else:
        obs = np.asarray(obs, np.int32).reshape(-1)
        b.add_observation(obs)
        out.append((r, obs))
    return out

  def completions(self) -> list[Completion]:
    """One trajectory per row (`mask`, `turn_starts`; `episode` left to the caller)."""
    return [b.completion() for b in self.builders]


def run_turns(worker: RolloutWorker, prompts: Sequence[np.ndarray], n: int,
              sampling: SamplingParams, driver: TurnDriver) -> None:
  """Generates every row's turns with `worker` until `driver` ends them all: the worker's own
  loop when it has one (`generate_turns`: the JAX sampler carries its KV cache across turns),
  else one `generate` call per turn and limit, each row's conversation so far as the prompt
  (vLLM: its prefix cache holds the shared prefix; the first turn samples n per prompt)."""
  if hasattr(worker, "generate_turns"):
    worker.generate_turns(prompts, n, sampling, driver)
    return
  rows, turns, limits = [], [], []
  by_limit: dict[int, list[int]] = {}
  for i in range(len(prompts)):
    by_limit.setdefault(driver.limit(i * n), []).append(i)
  for limit, idx in by_limit.items():
    groups = worker.generate([prompts[i] for i in idx], n,
                             dataclasses.replace(sampling, max_tokens=limit))
    rows += [i * n + j for i in idx for j in range(n)]
    turns += [c for g in groups for c in g.completions]
    limits += [limit] * (len(idx) * n)
  active = driver.record(0, rows, turns, limits)
  turn = 1
  while active:
    rows, turns, limits = [], [], []
    by_limit = {}
    for r, _ in active:
      by_limit.setdefault(driver.limit(r), []).append(r)
    for limit, group_rows in by_limit.items():
      convs = [np.concatenate([prompts[r // n], driver.builders[r].tokens()]) for r in group_rows]
      groups = worker.generate(convs, 1, dataclasses.replace(sampling, max_tokens=limit))
      rows += group_rows
      turns += [g.completions[0] for g in groups]
      limits += [limit] * len(group_rows)
    active = driver.record(turn, rows, turns, limits)
    turn += 1


# respond(turn, rows, turns) -> per row its next observation's tokens (int32 [Lo]), or None when
# its trajectory ends there: the environment's side of a multi-turn generation. `rows` index the
# call's rows (prompt r // n, sample r % n), `turns` are their policy turns just generated.
Respond = Callable[[int, list[int], list[Completion]], list[Optional[np.ndarray]]]


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
  """One request: prompts (int32 [Lp] arrays), n samples each, settings; `meta` rides along.
  `episodes`: a multi-turn request's `rollout.multiturn.Episodes` (its runner and one problem per
  prompt): `generate_request` runs it as trajectories; None: one completion per sample."""
  prompts: list[np.ndarray]
  n: int
  sampling: SamplingParams
  meta: Any = None
  episodes: Any = None


def generate_request(worker: RolloutWorker, prompts: Sequence[np.ndarray], n: int,
                     sampling: SamplingParams, episodes: Any = None) -> list[Group]:
  """One request on `worker`: `worker.generate(prompts, n, sampling)`, or with `episodes` (a
  `rollout.multiturn.Episodes` of these prompts) its multi-turn trajectories."""
  if episodes is None:
    return worker.generate(prompts, n, sampling)
  return episodes.generate(worker, prompts, n, sampling)


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
