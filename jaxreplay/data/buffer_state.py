"""The replay buffer's checkpoint format: held rollouts and the RNG as flat numpy arrays.

`ReplayBuffer.state_dict()` is a flat dict of numpy arrays and python ints/floats (picklable;
np.savez / orbax store it). This module holds the format's keys and the pure conversions it needs:
rollouts <-> concatenated token arrays with per-rollout lengths, and a PCG64 generator <-> six
uint64 words. The buffer's own counters are read and written by `ReplayBuffer` itself.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jaxreplay.learner.batch import Rollout

STATE_FORMAT = 1
STATE_KEYS = (
    "format", "capacity", "positive_fraction", "consume", "recent_count", "positive_count",
    "next_uid", "total_added", "total_sampled", "evicted", "evicted_use_count_sum", "promoted",
    "consumed", "rng_state", "uid", "use_count", "reward", "advantage", "policy_version",
    "group_id", "prompt_len", "completion_len", "prompt_tokens", "completion_tokens", "logprobs",
)
# Keys added by issue 27; a state without them (an older checkpoint) loads with: no rollout
# retired, and each held group's reward range taken from its held members.
OPTIONAL_STATE_KEYS = ("retired", "retired_use_count_sum", "group_stats_id", "group_stats_min",
                       "group_stats_max") + (
    # Issue 38 (multi-turn trajectories), only when a held rollout has them: the concatenated
    # completion masks (float32, like completion_tokens), each rollout's turn count (0: single
    # turn, no mask) and the concatenated turn starts.
    "completion_mask", "turn_count", "turn_starts")
# Keys of issue 38, present only when they hold something: "token_versions" (int64, one per
# completion token, concatenated as "logprobs" is) when a held rollout was continued across
# weight refreshes; "stale_dropped" / "stale_dropped_unused" with buffer.max_staleness.
TOKEN_VERSION_KEYS = ("token_versions",)
STALE_KEYS = ("stale_dropped", "stale_dropped_unused")
# Per-rollout arrays, one entry per held rollout in logical order.
PER_ROLLOUT_KEYS = ("uid", "use_count", "reward", "advantage", "policy_version", "group_id",
                    "prompt_len", "completion_len")
_U64 = (1 << 64) - 1


def rollouts_to_arrays(items: Sequence[Rollout]) -> dict[str, np.ndarray]:
  """The PER_ROLLOUT_KEYS arrays [n] plus prompt_tokens / completion_tokens (int32) and logprobs
  (float32), each the concatenation over `items` (lengths in prompt_len / completion_len); and
  token_versions (int64, likewise) when any item carries per-token versions."""
  def cat(arrays, dtype):
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)

  out = {
      "uid": np.array([r.uid for r in items], np.int64),
      "use_count": np.array([r.use_count for r in items], np.int64),
      "reward": np.array([r.reward for r in items], np.float64),
      "advantage": np.array([r.advantage for r in items], np.float64),
      "policy_version": np.array([r.policy_version for r in items], np.int64),
      "group_id": np.array([r.group_id for r in items], np.int64),
      "prompt_len": np.array([r.prompt_tokens.shape[0] for r in items], np.int64),
      "completion_len": np.array([r.completion_tokens.shape[0] for r in items], np.int64),
      "prompt_tokens": cat([r.prompt_tokens for r in items], np.int32),
      "completion_tokens": cat([r.completion_tokens for r in items], np.int32),
      "logprobs": cat([r.logprobs for r in items], np.float32),
  }
  if any(r.completion_mask is not None for r in items):
    out["completion_mask"] = cat([np.ones(r.completion_tokens.shape[0], np.float32)
                                  if r.completion_mask is None else r.completion_mask
                                  for r in items], np.float32)
    out["turn_count"] = np.array([0 if r.turn_starts is None else r.turn_starts.shape[0]
                                  for r in items], np.int64)
    out["turn_starts"] = cat([r.turn_starts for r in items if r.turn_starts is not None], np.int32)
  if any(r.token_versions is not None for r in items):
    out["token_versions"] = cat([r.versions_per_token() for r in items], np.int64)
  return out


def rollouts_from_arrays(state: dict[str, Any], held: int) -> list[Rollout]:
  """Inverse of `rollouts_to_arrays` for `held` rollouts; ValueError naming the bad key when the
  arrays do not fit together."""
  arrays = {k: np.asarray(state[k]) for k in PER_ROLLOUT_KEYS}
  for k, a in arrays.items():
    if a.shape != (held,):
      raise ValueError(f"buffer state {k!r} has shape {a.shape}, expected ({held},)")
  plen, clen = arrays["prompt_len"], arrays["completion_len"]
  ptok = np.asarray(state["prompt_tokens"])
  ctok = np.asarray(state["completion_tokens"])
  lps = np.asarray(state["logprobs"])
  if ptok.shape != (int(plen.sum()),) or ctok.shape != (int(clen.sum()),) or lps.shape != ctok.shape:
    raise ValueError("buffer state token arrays do not match prompt_len / completion_len")
  versions = np.asarray(state["token_versions"]) if "token_versions" in state else None
  if versions is not None and versions.shape != ctok.shape:
    raise ValueError("buffer state token_versions does not match completion_len")
  p_off = np.concatenate([[0], np.cumsum(plen)])
  c_off = np.concatenate([[0], np.cumsum(clen)])
  turns = _turns_from_arrays(state, held, c_off)
  return [Rollout(prompt_tokens=ptok[p_off[i]:p_off[i + 1]].copy(),
                  completion_tokens=ctok[c_off[i]:c_off[i + 1]].copy(),
                  logprobs=lps[c_off[i]:c_off[i + 1]].copy(),
                  reward=float(arrays["reward"][i]), advantage=float(arrays["advantage"][i]),
                  policy_version=int(arrays["policy_version"][i]),
                  group_id=int(arrays["group_id"][i]),
                  uid=int(arrays["uid"][i]), use_count=int(arrays["use_count"][i]),
                  token_versions=(None if versions is None else
                                  versions[c_off[i]:c_off[i + 1]].astype(np.int32)),
                  **turns[i])
          for i in range(held)]


def _turns_from_arrays(state: dict[str, Any], held: int, c_off: np.ndarray) -> list[dict]:
  """Per held rollout, its multi-turn fields (`completion_mask`, `turn_starts`) from the optional
  keys; {} for a single-turn rollout (turn count 0) or a state without them."""
  if "turn_count" not in state:
    return [{} for _ in range(held)]
  count = np.asarray(state["turn_count"], np.int64)
  mask = np.asarray(state["completion_mask"], np.float32)
  starts = np.asarray(state["turn_starts"], np.int32)
  if count.shape != (held,) or mask.shape != (int(c_off[-1]),) or starts.shape != (int(count.sum()),):
    raise ValueError("buffer state multi-turn arrays (turn_count, completion_mask, turn_starts) "
                     "do not match the held rollouts")
  t_off = np.concatenate([[0], np.cumsum(count)])
  return [{} if count[i] == 0 else
          {"completion_mask": mask[c_off[i]:c_off[i + 1]].copy(),
           "turn_starts": starts[t_off[i]:t_off[i + 1]].copy()} for i in range(held)]


def rng_to_words(rng: np.random.Generator) -> np.ndarray:
  """A PCG64 generator's full state as uint64 [6]: state hi/lo, inc hi/lo, has_uint32, uinteger."""
  s = rng.bit_generator.state
  st, inc = s["state"]["state"], s["state"]["inc"]
  return np.array([st >> 64, st & _U64, inc >> 64, inc & _U64, s["has_uint32"], s["uinteger"]],
                  np.uint64)


def rng_from_words(words: np.ndarray) -> np.random.Generator:
  """The generator `rng_to_words` described; it continues the same stream."""
  w = [int(x) for x in np.asarray(words, np.uint64)]
  rng = np.random.Generator(np.random.PCG64())
  rng.bit_generator.state = {"bit_generator": "PCG64",
                             "state": {"state": (w[0] << 64) | w[1], "inc": (w[2] << 64) | w[3]},
                             "has_uint32": w[4], "uinteger": w[5]}
  return rng
