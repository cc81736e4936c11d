r"""Supervised warm-start: RL needs a policy that is sometimes right.

  python -m jaxreplay.sft --config=configs/tiny.py --out=assets/tiny-arith-sft

trains the config's model preset from random weights on the config's task with cross-entropy on
the answer tokens (+ eos), with the settings of `config.sft` (steps, batch, learning_rate, seed,
carry_drop, slip, slip_range: noisy demonstrations, see `NOISE_KEYS`; the `--sft_*` flags are
aliases of `--config.sft.*`), then writes an HF model directory
(weights, config.json, tokenizer) that the RL run starts from (`config.model.path`). The task,
tokenizer and model come from `jaxreplay.run.build`, batches from `collate`, the optimizer from `optim`.
Greedy held-out accuracy is measured by teacher forcing: greedy decoding produces exactly
answer + eos iff every answer token is the argmax given the right prefix, so the fraction of
problems where all answer tokens are argmax IS greedy exact-match accuracy.
The tiny default ships the result of this command with configs/tiny.py's settings (1.6 MB),
configs/scratchpad.py ships `assets/scratchpad-sft`.

Multi-turn tasks (an environment: `task.make_env`, e.g. the calculator): a demonstration's target
is a list of segments [(text, trained)], the policy's turns (trained) and the environment's
observations (encoded as observations, `completion_mask` 0: never trained on, as in RL); the
held-out accuracy is then the success of real greedy episodes with the environment
(`sft/greedy_accuracy`), with their tool use (`sft/tool_correct`, `sft/tool_calls_mean`);
configs/multiturn.py ships `assets/calculator-sft`.
"""
from __future__ import annotations

import functools
import os
import sys
import tempfile
import time
from typing import Optional

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np
import optax

from jaxreplay.run import build
from jaxreplay.data import collate as collate_lib
from jaxreplay.models import hf_io
from jaxreplay.models import logprobs as logprobs_lib
from jaxreplay.models import transformer
from jaxreplay.learner import optim
from jaxreplay.learner.batch import Batch
from jaxreplay.learner.batch import Rollout
from jaxreplay.rollout import base
from jaxreplay.rollout import multiturn
from jaxreplay.rollout.jax_sampler import JaxSampler
from jaxreplay.run import evaluation
from jaxreplay.tasks import environments

_CONFIG = config_flags.DEFINE_config_file("config", None, "RL config file (model preset, task).",
                                          lock_config=True)
_OUT = flags.DEFINE_string("out", None, "Output HF model directory.")
# Aliases of --config.sft.<key>: each flag, when given, overrides that key.
_ALIASES = {
    "steps": flags.DEFINE_integer("sft_steps", None, "Alias of --config.sft.steps."),
    "batch": flags.DEFINE_integer("sft_batch", None, "Alias of --config.sft.batch."),
    "learning_rate": flags.DEFINE_float("sft_lr", None, "Alias of --config.sft.learning_rate."),
    "seed": flags.DEFINE_integer("sft_seed", None, "Alias of --config.sft.seed."),
    "carry_drop": flags.DEFINE_float("sft_carry_drop", None, "Alias of --config.sft.carry_drop."),
}
# The config.sft keys that make demonstrations noisy, the tasks whose `sft_examples` take them.
NOISE_KEYS = {"carry_drop": ("arithmetic", "scratchpad", "calculator"),
              "slip": ("scratchpad", "multiplication", "calculator"), "tool_rate": ("calculator",),
              "ignore_rate": ("calculator",)}
WARMUP_STEPS = 20
WEIGHT_DECAY = 1e-4  # optax.adamw's default, applied to every parameter


def encode_examples(codec, pairs, seq_len: int) -> Batch:
  """(prompt, target) pairs -> a `Batch` of [N, seq_len] rows (`collate.collate`).

  A target is the answer text: the row is bos + prompt + answer + eos, right-padded, and
  `completion_mask` is 1 on the targets that are answer or eos tokens. Or (multi-turn) segments
  [(text, trained)]: the policy's turns (trained, the last one followed by eos) and the
  environment's observations between them (`TextCodec.encode_observation`, mask 0)."""
  rollouts = [example_rollout(codec, prompt, target) for prompt, target in pairs]
  for r in rollouts:
    if r.length > seq_len:
      raise ValueError(f"an SFT example has {r.length} tokens > seq_len={seq_len}; raise "
                       "config.model.max_len")
  return collate_lib.collate(rollouts, buckets=(seq_len,), pad_id=codec.pad_id)


def example_rollout(codec, prompt: str, target) -> Rollout:
  """The `Rollout` of one demonstration (`encode_examples`)."""
  p = codec.encode_prompt(prompt)
  if isinstance(target, str):
    a = np.concatenate([codec.encode(target, add_bos=False), [codec.eos_id]]).astype(np.int32)
    return Rollout(prompt_tokens=p, completion_tokens=a, logprobs=np.zeros(len(a)), reward=0.0,
                   advantage=0.0, policy_version=0, group_id=0)
  if not target or not target[0][1] or not target[-1][1]:
    raise ValueError("a multi-turn demonstration starts and ends with a policy turn (trained)")
  pieces, masks, starts, length = [], [], [], 0
  for k, (text, trained) in enumerate(target):
    ids = (codec.encode(text, add_bos=False) if trained else codec.encode_observation(text))
    if k == len(target) - 1:
      ids = np.concatenate([ids, [codec.eos_id]])
    if trained and (k == 0 or not target[k - 1][1]):
      starts.append(length)
    pieces.append(np.asarray(ids, np.int32))
    masks.append(np.full(len(ids), 1.0 if trained else 0.0, np.float32))
    length += len(ids)
  tokens = np.concatenate(pieces)
  return Rollout(prompt_tokens=p, completion_tokens=tokens, logprobs=np.zeros(len(tokens)),
                 reward=0.0, advantage=0.0, policy_version=0, group_id=0,
                 completion_mask=np.concatenate(masks), turn_starts=np.asarray(starts, np.int32))


@functools.partial(jax.jit, static_argnums=0)
def _greedy_hits(model_cfg, params, batch: Batch):
  logits = transformer.apply(model_cfg, params, batch.tokens, positions=batch.positions,
                             segment_ids=batch.segment_ids)
  return jnp.all((jnp.argmax(logits, -1) == batch.targets) | (batch.completion_mask == 0), axis=1)


def greedy_exact_match(model_cfg, params, codec, pairs, seq_len: int) -> np.ndarray:
  """bool [N]: whether greedy decoding of each (prompt, target) pair produces exactly target + eos,
  computed by teacher forcing (every target token is the argmax given the right prefix)."""
  return np.asarray(_greedy_hits(model_cfg, params, encode_examples(codec, pairs, seq_len)))


def noise_kwargs(sft_config, task_name: str) -> dict:
  """The `task.sft_examples` keyword arguments of `config.sft`'s nonzero noise settings; raises
  ValueError when the task does not take one of them."""
  kwargs = {}
  for key, task_names in NOISE_KEYS.items():
    if sft_config[key]:
      if task_name not in task_names:
        raise ValueError(f"sft {key} applies to task.name in {task_names} only; set "
                         f"--config.sft.{key}=0")
      kwargs[key] = sft_config[key]
  if "slip" in kwargs:
    kwargs["slip_range"] = tuple(sft_config["slip_range"])
  return kwargs


def train_sft(model_cfg, codec, task, steps: int, batch: int, lr: float, seed: int,
              seq_len: int, log_every: int = 50, carry_drop: float = 0.0,
              noise: Optional[dict] = None):
  """Returns (params, {"sft/greedy_accuracy": held-out greedy exact match, ...}).

  Adam with global-norm clipping at 1 (`optim.make_optimizer`), learning rate warmed up from 0 over
  20 steps, then cosine to 10% at `steps`. `carry_drop` and `noise` (more keyword arguments) go to
  `task.sft_examples` when nonzero."""
  params = transformer.init_params(model_cfg, jax.random.PRNGKey(seed))
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, WARMUP_STEPS, steps, lr * 0.1)
  opt = optim.make_optimizer(schedule, weight_decay=WEIGHT_DECAY, max_grad_norm=1.0,
                             decay_mask=None)
  opt_state = opt.init(params)

  def loss_fn(p, b: Batch):
    lp = logprobs_lib.token_logprobs(model_cfg, p, b.tokens, b.targets, positions=b.positions,
                                     segment_ids=b.segment_ids)
    return -(lp * b.completion_mask).sum() / jnp.maximum(b.completion_mask.sum(), 1.0)

  @jax.jit
  def step(p, s, b: Batch):
    loss, g = jax.value_and_grad(loss_fn)(p, b)
    updates, s = opt.update(g, s, p)
    return optax.apply_updates(p, updates), s, loss

  noise = dict(noise or {})
  if carry_drop:
    noise["carry_drop"] = carry_drop
  examples = task.sft_examples(steps * batch, seed=seed, **noise)
  t0 = time.time()
  for i in range(steps):
    pairs = [next(examples) for _ in range(batch)]
    params, opt_state, loss = step(params, opt_state, encode_examples(codec, pairs, seq_len))
    if (i + 1) % log_every == 0 or i == 0:
      rate = (i + 1) / (time.time() - t0)
      logging.info("sft step %d/%d loss %.4f (%.1f steps/s, ETA %.0f s)", i + 1, steps,
                   float(loss), rate, (steps - i - 1) / rate)
  held_out = task.eval_set(256)
  if hasattr(task, "make_env"):
    stats = episode_accuracy(model_cfg, params, codec, task, held_out, seq_len)
  else:
    stats = {"sft/greedy_accuracy": float(np.mean(greedy_exact_match(
        model_cfg, params, codec, [(p.prompt, p.answer) for p in held_out], seq_len)))}
  return params, {"sft/loss": float(loss), **stats, "sft/seconds": time.time() - t0}


def episode_accuracy(model_cfg, params, codec, task, problems, seq_len: int,
                     max_turns: int = 8) -> dict[str, float]:
  """Held-out success of greedy episodes of a multi-turn task with its environment (the JAX
  sampler, `rollout.multiturn`): {"sft/greedy_accuracy", "sft/tool_correct",
  "sft/tool_calls_mean", "sft/turns_mean"}."""
  spec = environments.spec_from_factory(task.make_env, max_turns, seq_len, 5.0)
  runner = multiturn.EpisodeRunner(spec, codec, seq_len)
  sampler = JaxSampler(model_cfg, params, seq_len, batch_size=64, eos_token_ids=codec.stop_ids)
  try:
    out = evaluation.evaluate(functools.partial(base.generate_request, sampler), task, problems,
                              codec, n_samples=0, temperature_pass1=0.0, n_pass1=1,
                              max_tokens=seq_len - 1, prefix="sft/", episodes=runner)
  finally:
    runner.close()
  return {"sft/greedy_accuracy": out["sft/pass@1"], "sft/tool_correct": out["sft/env/tool_correct"],
          "sft/tool_calls_mean": out["sft/env/tool_calls_mean"],
          "sft/turns_mean": out["sft/env/turns_mean"]}


def _quiet_console() -> None:
  """As the launcher's console: on a machine without a GPU, JAX starts on the CPU without probing
  for a TPU (no "Unable to initialize backend 'tpu'" line), and progress lines carry no absl
  prefix. JAX is imported already, so its platform is set through its config, before any array."""
  from jaxreplay.config import devices  # pylint: disable=g-import-not-at-top
  from jaxreplay.config import host_devices  # pylint: disable=g-import-not-at-top
  from jaxreplay.infra import console_log  # pylint: disable=g-import-not-at-top
  changed = host_devices.cpu_environment(gpus_visible=bool(devices.visible_gpus()))
  if "JAX_PLATFORMS" in changed:
    jax.config.update("jax_platforms", changed["JAX_PLATFORMS"])
  console_log.setup()


def main(argv):
  del argv
  _quiet_console()
  config = _CONFIG.value
  for key, flag in _ALIASES.items():
    if flag.value is not None:
      config.sft[key] = flag.value
  s = config.sft
  if s.steps <= WARMUP_STEPS:
    print(f"error: sft.steps={s.steps} must be > {WARMUP_STEPS} (the learning rate's warm-up "
          f"steps); e.g. --sft_steps={WARMUP_STEPS + 10}", file=sys.stderr, flush=True)
    sys.exit(2)
  noise = noise_kwargs(s, config.task.name)
  config.model.path = ""  # train the preset from scratch (model.path is usually this run's output)
  config.model.tokenizer = ""
  task = build.make_task(config.task)
  with tempfile.TemporaryDirectory() as workdir:
    codec, tok_dir = build.load_codec(config, task, workdir)  # a character tokenizer of the task
    model_cfg = build.model_config(config, codec)
    params, stats = train_sft(model_cfg, codec, task, s.steps, s.batch, s.learning_rate, s.seed,
                              config.model.max_len, noise=noise)
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    hf_io.save_hf(model_cfg, params, _OUT.value, tokenizer_dir=tok_dir)
  task.close()
  logging.info("wrote %s: %s", _OUT.value, stats)
  print(stats)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "out"])
  app.run(main)
