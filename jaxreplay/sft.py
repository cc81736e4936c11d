r"""Supervised warm-start: RL needs a policy that is sometimes right.

  python -m jaxreplay.sft --config=configs/tiny.py --out=assets/tiny-arith-sft

trains the config's model preset from random weights on the config's task with cross-entropy on the
answer tokens (+ eos), with the settings of `config.sft` (steps, batch, learning_rate, seed,
carry_drop; the `--sft_*` flags override them), then writes an HF model directory (weights,
config.json, tokenizer) that the RL run starts from (`config.model.path`). Greedy held-out accuracy is measured by teacher forcing:
greedy decoding produces exactly answer + eos iff every answer token is the argmax given the right
prefix, so the fraction of problems where all answer tokens are argmax IS greedy exact-match accuracy.
The tiny default ships the result of this command with configs/tiny.py's settings (1.6 MB).
"""
from __future__ import annotations

import functools
import os
import tempfile
import time

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np
import optax

from jaxreplay import models
from jaxreplay import tasks
from jaxreplay.setup import make_task

_CONFIG = config_flags.DEFINE_config_file("config", None, "RL config file (model preset, task).",
                                          lock_config=True)
_OUT = flags.DEFINE_string("out", None, "Output HF model directory.")
# Each flag overrides its config.sft key when given (the same as --config.sft.<key>=...).
_STEPS = flags.DEFINE_integer("sft_steps", None, "Gradient steps (config.sft.steps).")
_BATCH = flags.DEFINE_integer("sft_batch", None, "Examples per step (config.sft.batch).")
_LR = flags.DEFINE_float("sft_lr", None, "Adam learning rate (config.sft.learning_rate).")
_SEED = flags.DEFINE_integer("sft_seed", None, "Initialisation and data seed (config.sft.seed).")
_CARRY_DROP = flags.DEFINE_float(
    "sft_carry_drop", None, "Arithmetic: probability that a demonstration needing a carry drops "
    "every carry (noisy demonstrations; RL then fixes the error) (config.sft.carry_drop).")


def _setting(flag, value):
  return value if flag.value is None else flag.value


def encode_examples(codec, pairs, seq_len: int):
  """(prompt, answer) pairs -> tokens, targets, loss mask, segment ids: int32/float32 [N, seq_len].

  Each row is bos + prompt + answer + eos, right-padded; the mask is 1 on targets that are answer or
  eos tokens."""
  rows = []
  for prompt, answer in pairs:
    p = codec.encode_prompt(prompt)
    a = np.concatenate([codec.encode(answer, add_bos=False), [codec.eos_id]]).astype(np.int32)
    rows.append((p, a))
  longest = max(len(p) + len(a) for p, a in rows)
  if longest > seq_len:
    raise ValueError(f"an SFT example has {longest} tokens > seq_len={seq_len}; raise "
                     "config.model.max_len")
  n = len(rows)
  tokens = np.full((n, seq_len), codec.pad_id, np.int32)
  mask = np.zeros((n, seq_len), np.float32)
  seg = np.zeros((n, seq_len), np.int32)
  for i, (p, a) in enumerate(rows):
    seq = np.concatenate([p, a])
    tokens[i, :len(seq)] = seq
    seg[i, :len(seq)] = 1
    mask[i, len(p) - 1:len(seq) - 1] = 1.0  # targets[t] = tokens[t+1] is an answer/eos token
  targets = np.concatenate([tokens[:, 1:], np.full((n, 1), codec.pad_id, np.int32)], axis=1)
  return tokens, targets, mask, seg


@functools.partial(jax.jit, static_argnums=0)
def _greedy_hits(model_cfg, params, tokens, targets, mask, seg):
  pos = jnp.maximum(jnp.cumsum(seg, axis=1) - 1, 0)
  logits = models.apply(model_cfg, params, tokens, positions=pos, segment_ids=seg)
  return jnp.all((jnp.argmax(logits, -1) == targets) | (mask == 0), axis=1)


def greedy_exact_match(model_cfg, params, codec, pairs, seq_len: int) -> np.ndarray:
  """bool [N]: whether greedy decoding of each (prompt, target) pair produces exactly target + eos,
  computed by teacher forcing (every target token is the argmax given the right prefix)."""
  arrays = encode_examples(codec, pairs, seq_len)
  return np.asarray(_greedy_hits(model_cfg, params, *arrays))


def train_sft(model_cfg, codec, task, steps: int, batch: int, lr: float, seed: int,
              seq_len: int, log_every: int = 50, carry_drop: float = 0.0):
  """Returns (params, {"sft/greedy_accuracy": held-out greedy exact match, ...})."""
  params = models.init_params(model_cfg, jax.random.PRNGKey(seed))
  opt = optax.chain(optax.clip_by_global_norm(1.0),
                    optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, 20, steps, lr * 0.1)))
  opt_state = opt.init(params)

  def loss_fn(p, tokens, targets, mask, seg):
    pos = jnp.maximum(jnp.cumsum(seg, axis=1) - 1, 0)
    lp = models.token_logprobs(model_cfg, p, tokens, targets, positions=pos, segment_ids=seg)
    return -(lp * mask).sum() / jnp.maximum(mask.sum(), 1.0)

  @jax.jit
  def step(p, s, tokens, targets, mask, seg):
    loss, g = jax.value_and_grad(loss_fn)(p, tokens, targets, mask, seg)
    updates, s = opt.update(g, s, p)
    return optax.apply_updates(p, updates), s, loss

  examples = (task.sft_examples(steps * batch, seed=seed, carry_drop=carry_drop) if carry_drop
              else task.sft_examples(steps * batch, seed=seed))
  t0 = time.time()
  for i in range(steps):
    pairs = [next(examples) for _ in range(batch)]
    arrays = encode_examples(codec, pairs, seq_len)
    params, opt_state, loss = step(params, opt_state, *arrays)
    if (i + 1) % log_every == 0 or i == 0:
      rate = (i + 1) / (time.time() - t0)
      logging.info("sft step %d/%d loss %.4f (%.1f steps/s, ETA %.0f s)", i + 1, steps,
                   float(loss), rate, (steps - i - 1) / rate)
  held_out = task.eval_set(256)
  acc = float(np.mean(greedy_exact_match(model_cfg, params, codec,
                                         [(p.prompt, p.answer) for p in held_out], seq_len)))
  return params, {"sft/loss": float(loss), "sft/greedy_accuracy": acc,
                  "sft/seconds": time.time() - t0}


def main(argv):
  del argv
  config = _CONFIG.value
  if _setting(_CARRY_DROP, config.sft.carry_drop) and config.task.name != "arithmetic":
    raise ValueError("sft carry_drop applies to task.name='arithmetic' only; set "
                     "--config.sft.carry_drop=0")
  task = make_task(config)
  with tempfile.TemporaryDirectory() as tok_dir:
    tasks.build_char_tokenizer(task.charset, tok_dir)
    codec = tasks.load_tokenizer(tok_dir)
    model_cfg = models.presets.PRESETS[config.model.preset](
        vocab_size=codec.vocab_size, bos_token_id=codec.bos_id, eos_token_id=codec.eos_id,
        pad_token_id=codec.pad_id)
    seq_len = config.model.max_len
    s = config.sft
    params, stats = train_sft(model_cfg, codec, task, _setting(_STEPS, s.steps),
                              _setting(_BATCH, s.batch), _setting(_LR, s.learning_rate),
                              _setting(_SEED, s.seed), seq_len,
                              carry_drop=_setting(_CARRY_DROP, s.carry_drop))
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    models.save_hf(model_cfg, params, _OUT.value, tokenizer_dir=tok_dir)
  logging.info("wrote %s: %s", _OUT.value, stats)
  print(stats)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "out"])
  app.run(main)
