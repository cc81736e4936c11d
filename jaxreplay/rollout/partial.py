"""Partial rollouts: requests generated in chunks of tokens and continued across weight refreshes.

With `rollout.partial="continue"` (async schedule) a pool worker does not generate a request in one
`generate` call. It keeps the sequences of the requests it holds in flight (`InFlight`) and
advances them all by at most `chunk_tokens` tokens per call: each sequence's context is its
original prompt followed by the tokens it has generated so far, sampled with n = 1 and
`max_tokens` = the chunk. Between two chunks the worker loads the newest weights (`rollout.pool`),
so a refresh reaches a request in flight within one chunk: its prefix stays as it was (nothing is
regenerated; it is the prompt of the next chunk) and its next tokens come from the new policy.
Every token keeps the version that sampled it (`Completion.versions`, then
`Rollout.token_versions`), and its log-prob is the one that version gave it in that context.

The prefix's KV cache is recomputed by each chunk's prefill, under the weights of that chunk, on
both backends (the JAX sampler prefills every call; a vLLM engine resets its prefix cache at a
refresh, so the first chunk after one recomputes the prefix, and later chunks at the same weights
hit its automatic prefix cache). It is never kept across a refresh: a token's behaviour log-prob
must be one policy's probability of it given the whole context, which is what the trainer
recomputes; keys and values of the prefix computed by the previous weights would make the sampled
distribution a mixture that no trainer forward reproduces (the mismatch probe would see it).

Chunk boundaries are also where sequences leave and join: a finished request is delivered at the
end of its chunk and the freed rows are refilled with new requests, so a worker's call stays full
while long completions finish (a whole-request call runs at the width of its longest completion).
All sequences of a request start in the same chunk, so its completions' first tokens share one
version, the request's (`Group.policy_version`, the oldest).

This module is numpy only (the pool imports it): the state of one worker's requests in flight.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from jaxreplay.rollout.base import Completion, Group, PromptBatch, SamplingParams


@dataclasses.dataclass
class _Sequence:
  """One sample of one prompt being generated: its chunks so far."""
  prompt: np.ndarray
  sampling: SamplingParams
  tokens: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)
  generated: int = 0
  finish_reason: Optional[str] = None

  @property
  def done(self) -> bool:
    return self.finish_reason is not None

  def context(self) -> np.ndarray:
    """The prompt of its next chunk: the original prompt, then every token generated so far."""
    return np.concatenate([self.prompt] + self.tokens).astype(np.int32)

  def completion(self) -> Completion:
    cat = lambda parts, dtype: (np.concatenate(parts).astype(dtype) if parts
                                else np.zeros(0, dtype))
    return Completion(cat(self.tokens, np.int32), cat(self.logprobs, np.float32),
                      self.finish_reason, versions=cat(self.versions, np.int32))


@dataclasses.dataclass
class _Request:
  """A request in flight: its P x n sequences (prompt-major) and its share of the calls' seconds."""
  batch: PromptBatch
  sequences: list[_Sequence]
  seconds: float = 0.0

  @property
  def done(self) -> bool:
    return all(s.done for s in self.sequences)


@dataclasses.dataclass
class Finished:
  """A request whose every sequence finished: its groups (one per prompt, each completion with
  per-token versions), the oldest version among them, its generated tokens and its seconds."""
  batch: PromptBatch
  groups: list[Group]
  policy_version: int
  num_tokens: int
  seconds: float


@dataclasses.dataclass
class Chunk:
  """One `generate(contexts, 1, sampling)` call of a chunk: the sequences it advances."""
  sampling: SamplingParams
  contexts: list[np.ndarray]
  sequences: list[_Sequence]


class InFlight:
  """The requests one pool worker holds in flight under `rollout.partial="continue"`.

  Args:
    chunk_tokens: C, the most tokens a sequence gains per call (`rollout.partial_chunk_tokens`).
    requests_per_call: the worker keeps at most this many requests' rows in flight (measured by
      the size of the requests it has seen), as a whole-request call would hold.
  """

  def __init__(self, chunk_tokens: int, requests_per_call: int = 1):
    if chunk_tokens < 1:
      raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1 (rollout.partial_chunk_tokens)")
    if requests_per_call < 1:
      raise ValueError(f"requests_per_call={requests_per_call} must be >= 1")
    self.chunk_tokens, self.requests_per_call = int(chunk_tokens), int(requests_per_call)
    self._requests: list[_Request] = []
    self._request_rows = 0  # the largest request seen, in rows

  # ---- what is held ---------------------------------------------------------------------------

  @property
  def requests(self) -> int:
    return len(self._requests)

  @property
  def rows(self) -> int:
    """Sequences still being generated."""
    return sum(not s.done for r in self._requests for s in r.sequences)

  def started_rows(self) -> int:
    """Sequences in flight that have generated at least one token (a refresh now continues them
    under new weights)."""
    return sum(s.generated > 0 and not s.done for r in self._requests for s in r.sequences)

  def has_room(self) -> bool:
    """Whether one more request fits: nothing held, or its rows (the size of the requests seen so
    far) fit beside the unfinished rows within `requests_per_call` requests' rows."""
    if not self._requests:
      return True
    return self.rows + self._request_rows <= self.requests_per_call * self._request_rows

  def add(self, batch: PromptBatch) -> None:
    """Takes `batch` in flight: n sequences per prompt, none generated yet."""
    if batch.n < 1 or not batch.prompts:
      raise ValueError(f"a request needs prompts and n >= 1, got {len(batch.prompts)} prompts, "
                       f"n={batch.n}")
    seqs = [_Sequence(np.asarray(p, np.int32), batch.sampling)
            for p in batch.prompts for _ in range(batch.n)]
    self._requests.append(_Request(batch, seqs))
    self._request_rows = max(self._request_rows, len(seqs))

  def drain(self) -> list[PromptBatch]:
    """Gives up every request in flight (the worker died, or the pool stops); returns them."""
    out = [r.batch for r in self._requests]
    self._requests = []
    return out

  # ---- one chunk ------------------------------------------------------------------------------

  def chunks(self) -> list[Chunk]:
    """The calls of the next chunk: the unfinished sequences grouped by their sampling settings,
    each call with max_tokens = min(C, the fewest tokens any of its sequences may still add)."""
    by_sampling: dict[SamplingParams, list[_Sequence]] = {}
    for r in self._requests:
      for s in r.sequences:
        if not s.done:
          by_sampling.setdefault(s.sampling, []).append(s)
    out = []
    for sampling, seqs in by_sampling.items():
      room = min(sampling.max_tokens - s.generated for s in seqs)
      chunk = dataclasses.replace(sampling, max_tokens=min(self.chunk_tokens, room))
      out.append(Chunk(chunk, [s.context() for s in seqs], seqs))
    return out

  def absorb(self, chunk: Chunk, groups: Sequence[Group], version: int, seconds: float) -> int:
    """Appends a call's output (one Group of one completion per context, sampled at `version`)
    to its sequences; a sequence finishes on a stop token ("stop") or at its max_tokens
    ("length"). The call's `seconds` are shared among the requests by the tokens each gained.
    Returns the tokens generated."""
    if len(groups) != len(chunk.sequences):
      raise RuntimeError(f"the worker returned {len(groups)} groups for {len(chunk.sequences)} "
                         "continued sequences")
    gained: dict[int, int] = {}
    owner = {id(s): r for r in self._requests for s in r.sequences}
    for seq, group in zip(chunk.sequences, groups):
      if len(group.completions) != 1:
        raise RuntimeError(f"a chunk of one sample returned {len(group.completions)} completions")
      if group.policy_version != version:
        raise RuntimeError(f"a chunk is tagged version {group.policy_version}, but the worker "
                           f"held version {version} for the whole call")
      c = group.completions[0]
      n = len(c.tokens)
      if not 1 <= n <= chunk.sampling.max_tokens:
        raise RuntimeError(f"a chunk of max_tokens={chunk.sampling.max_tokens} returned {n} tokens")
      seq.tokens.append(np.asarray(c.tokens, np.int32))
      seq.logprobs.append(np.asarray(c.logprobs, np.float32))
      seq.versions.append(np.full(n, version, np.int32))
      seq.generated += n
      if c.finish_reason == "stop":
        seq.finish_reason = "stop"
      elif seq.generated >= seq.sampling.max_tokens:
        seq.finish_reason = "length"
      req = owner[id(seq)]
      gained[id(req)] = gained.get(id(req), 0) + n
    total = max(sum(gained.values()), 1)
    for r in self._requests:
      r.seconds += seconds * gained.get(id(r), 0) / total
    return sum(gained.values())

  def pop_finished(self) -> list[Finished]:
    """The requests whose every sequence finished, in the order they were added (removed)."""
    done = [r for r in self._requests if r.done]
    self._requests = [r for r in self._requests if not r.done]
    return [_finished(r) for r in done]


def _finished(r: _Request) -> Finished:
  n = r.batch.n
  groups = []
  for i, prompt in enumerate(r.batch.prompts):
    comps = [s.completion() for s in r.sequences[i * n:(i + 1) * n]]
    oldest = min(int(c.versions.min()) for c in comps)
    groups.append(Group(np.asarray(prompt), comps, oldest, prompt_index=i))
  return Finished(r.batch, groups, min(g.policy_version for g in groups),
                  sum(len(c.tokens) for g in groups for c in g.completions), r.seconds)


def distinct_versions(groups: Sequence[Group]) -> int:
  """Sum over the groups' completions of the distinct policy versions among its tokens."""
  return sum(int(np.unique(c.versions).size) if c.versions is not None else 1
             for g in groups for c in g.completions)
