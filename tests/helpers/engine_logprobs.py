"""The JAX forward's log-probs of rollout engines' completions, to compare an engine against the
trainer (tests/rollout/vllm/, the shm weight-transfer tests, the GPU path on CPU)."""
import numpy as np

from jaxreplay.models import logprobs as logprobs_lib
from jaxreplay.models import presets

CFG = presets.tiny()
ROWS, COLS = 16, 32  # every JAX call is on one padded [16, 32] shape: it compiles once


def padded(seqs):
  """Right-padded [k*16, 32] token batches of the given sequences (padding never attends back)."""
  rows = -(-len(seqs) // ROWS) * ROWS
  out = np.zeros((rows, COLS), np.int32)
  for i, s in enumerate(seqs):
    out[i, :len(s)] = s
  return out


def jax_logprobs_many(params, pairs, cfg=CFG):
  """logprobs_lib.token_logprobs of each (group, completion)'s completion tokens: a list of f32 [L]."""
  seqs = [np.concatenate([g.prompt_tokens, c.tokens]) for g, c in pairs]
  tokens = padded(seqs)
  lp = np.asarray(logprobs_lib.token_logprobs(cfg, params, tokens[:, :-1], tokens[:, 1:]))
  return [lp[i, len(g.prompt_tokens) - 1:len(s) - 1] for i, ((g, _), s) in enumerate(zip(pairs, seqs))]


def pairs_of(groups):
  return [(g, c) for g in groups for c in g.completions]


def logprob_diffs(groups, params, cfg=CFG):
  pairs = pairs_of(groups)
  return np.concatenate([np.abs(ref - c.logprobs)
                         for ref, (_, c) in zip(jax_logprobs_many(params, pairs, cfg), pairs)])
