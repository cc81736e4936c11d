"""Builds a run's parts from its config, failing fast with errors that name the fix.

`build(config, workdir) -> Parts`: task, tokenizer, model, mesh, train state (resumed when a
checkpoint exists), train step, replay buffer, prompt stream, rollout workers, weight publishing,
metrics writer and compute accountant.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any, Callable, Optional

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from jaxreplay import accounting
from jaxreplay import buffer as buffer_lib
from jaxreplay import checkpoint as checkpoint_lib
from jaxreplay import metrics as metrics_lib
from jaxreplay import models
from jaxreplay import optim
from jaxreplay import schedulers
from jaxreplay import sharding
from jaxreplay import tasks
from jaxreplay import trainer
from jaxreplay.experience import PromptSource, make_advantage_fn
from jaxreplay.rollout.jax_sampler import JaxSampler

BACKENDS = ("jax", "vllm", "auto")
SCHEDULES = ("simulated", "async")


def validate_config(c) -> None:
  """Config conflicts a user can make, caught before anything is built."""
  errors = []
  if c.scheduler.kind not in SCHEDULES:
    errors.append(f"scheduler.kind={c.scheduler.kind!r}: expected one of {SCHEDULES}")
  if c.rollout.backend not in BACKENDS:
    errors.append(f"rollout.backend={c.rollout.backend!r}: expected one of {BACKENDS}")
  if c.trainer.loss not in trainer.LOSSES:
    errors.append(f"trainer.loss={c.trainer.loss!r}: expected one of {trainer.LOSSES}")
  if c.buffer.batch_size > c.buffer.size:
    errors.append(f"buffer.batch_size (B={c.buffer.batch_size}) > buffer.size (N={c.buffer.size}): "
                  "a batch can never be sampled; lower B or raise N (N >= B)")
  request = c.rollout.prompts_per_request * c.rollout.group_size
  if c.buffer.on_policy and request > c.buffer.size:
    errors.append(f"buffer.on_policy: one request ({request} rollouts) does not fit the queue "
                  f"(buffer.size={c.buffer.size}); raise buffer.size to >= {request}")
  if c.buffer.on_policy and c.buffer.positive_fraction:
    errors.append("buffer.on_policy=True cannot use buffer.positive_fraction; set it to 0")
  if c.rollout.group_size < 2 and c.trainer.loss == "grpo":
    errors.append("rollout.group_size=1 gives GRPO zero advantages; use group_size >= 2 or "
                  "trainer.loss='asymre'")
  if c.rollout.max_tokens >= c.model.max_len:
    errors.append(f"rollout.max_tokens={c.rollout.max_tokens} leaves no room for a prompt in "
                  f"model.max_len={c.model.max_len}; raise model.max_len")
  if c.total_steps < 1:
    errors.append(f"total_steps={c.total_steps} must be >= 1")
  if c.trainer.schedule == "cosine" and c.total_steps <= c.trainer.warmup_steps:
    errors.append(f"trainer.schedule='cosine' needs total_steps={c.total_steps} > "
                  f"trainer.warmup_steps={c.trainer.warmup_steps}; lower warmup_steps or use "
                  "trainer.schedule='constant'")
  if c.rollout.refresh_every < 1:
    errors.append(f"rollout.refresh_every={c.rollout.refresh_every} must be >= 1")
  if c.model.path and not os.path.isdir(c.model.path):
    errors.append(f"model.path={c.model.path!r} is not a directory; pass a Hugging Face model dir "
                  "(config.json + *.safetensors)")
  if c.task.name == "math" and not c.task.path:
    errors.append("task.name='math' needs task.path=<local .jsonl/.parquet file with problem and "
                  "answer fields>")
  if jax.process_count() > 1 and c.scheduler.kind != "simulated":
    errors.append(f"scheduler.kind={c.scheduler.kind!r} with {jax.process_count()} trainer "
                  "processes: multi-process trainers run every process's host pipeline in "
                  "lockstep, which needs scheduler.kind='simulated' (or run one trainer process)")
  if errors:
    raise ValueError("invalid config:\n  " + "\n  ".join(errors))


def make_task(c):
  t = c.task
  if t.name == "arithmetic":
    return tasks.ArithmeticTask(num_digits=tuple(t.num_digits), ops=t.ops, seed=0,
                                reward_timeout_s=t.reward_timeout_s)
  if t.name == "math":
    return tasks.make_task("math", path=t.path, problem_key=t.problem_key,
                           answer_key=t.answer_key, template=t.template,
                           reward_timeout_s=t.reward_timeout_s)
  raise ValueError(f"task.name={t.name!r}: expected 'arithmetic' or 'math'")


def check_prompt_lengths(codec, problems, max_prompt: int, where: str) -> None:
  for p in problems:
    n = len(codec.encode_prompt(p.prompt))
    if n > max_prompt:
      raise ValueError(f"a {where} prompt has {n} tokens > model.max_len - rollout.max_tokens = "
                       f"{max_prompt}: raise config.model.max_len or filter long prompts "
                       f"(prompt starts {p.prompt[:60]!r})")


@dataclasses.dataclass
class Parts:
  """Everything a run holds. `publish(params, version)` refreshes the rollout workers."""
  config: Any
  task: Any
  codec: Any
  tokenizer_dir: Optional[str]
  model_cfg: models.ModelConfig
  mesh: Any
  state: Any
  train_step: Callable
  logprob_fn: Callable
  buffer: buffer_lib.ReplayBuffer
  prompts: PromptSource
  advantage_fn: Callable
  accountant: accounting.ComputeAccountant
  sim_state: schedulers.SimState
  writer: metrics_lib.MetricsWriter
  checkpointer: checkpoint_lib.Checkpointer
  resumed_host: Optional[dict]
  eval_sampler: JaxSampler
  eval_problems: list
  buckets: tuple
  gen_seconds_per_rollout: float
  workers: Any = None
  sampler: Any = None
  publisher: Any = None
  _closers: list = dataclasses.field(default_factory=list)

  def publish(self, params, version: int) -> None:
    self.workers.publish(params, version)

  def sim_compute_metrics(self) -> dict[str, float]:
    """The modelled hardware's compute (simulated schedule): virtual device-seconds."""
    c = self.config
    if c.scheduler.kind != "simulated":
      return {}
    s = self.sim_state
    return {"sim/clock": s.clock, "sim/generation_device_seconds": s.generation_device_seconds,
            "sim/training_device_seconds": s.training_device_seconds,
            "sim/compute_seconds": s.generation_device_seconds + s.training_device_seconds,
            "sim/mu": c.scheduler.mu,
            "sim/gamma": accounting.gamma(c.rollout.num_workers, c.trainer.num_devices,
                                          c.scheduler.mu)}

  def run_async(self, pipeline) -> None:
    self.workers.run_async(pipeline)

  def close(self) -> None:
    for fn in reversed(self._closers):
      try:
        fn()
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("error while closing: %s", e)
    self._closers.clear()


def _load_tokenizer(c, task, workdir: str):
  tok_dir = c.model.tokenizer or c.model.path
  if not tok_dir:
    if c.task.name != "arithmetic":
      raise ValueError("model.tokenizer (or model.path) is needed for task "
                       f"{c.task.name!r}: the character tokenizer only covers arithmetic")
    tok_dir = os.path.join(workdir, "tokenizer")
    if not os.path.isdir(tok_dir):
      tasks.build_char_tokenizer(task.charset, tok_dir)
  return tasks.load_tokenizer(tok_dir), tok_dir


def resolve_backend(c) -> str:
  """Sets rollout.backend="auto" to "vllm" when vLLM is installed, else "jax"; returns it."""
  if c.rollout.backend == "auto":
    import importlib.util  # pylint: disable=g-import-not-at-top
    c.rollout.backend = "vllm" if importlib.util.find_spec("vllm") is not None else "jax"
    logging.info("rollout.backend=auto -> %s", c.rollout.backend)
  return c.rollout.backend


def build(c, workdir: str) -> Parts:
  validate_config(c)
  resolve_backend(c)
  from jaxreplay import workers as workers_lib  # pylint: disable=g-import-not-at-top
  if c.rollout.backend == "vllm":
    workers_lib.check_vllm_available()
  task = make_task(c)
  codec, tok_dir = _load_tokenizer(c, task, workdir)
  overrides = dict(dtype=c.model.dtype, param_dtype=c.model.param_dtype, remat=c.model.remat)
  if c.model.path:
    model_cfg = models.ModelConfig.from_hf_dir(c.model.path, **overrides)
  else:
    model_cfg = models.presets.PRESETS[c.model.preset](**overrides).replace(
        vocab_size=max(codec.vocab_size, 1), eos_token_id=codec.eos_id,
        bos_token_id=codec.bos_id, pad_token_id=codec.pad_id)
  tasks.check_tokenizer_matches_model(codec, model_cfg)
  max_prompt = c.model.max_len - c.rollout.max_tokens
  eval_problems = task.eval_set(c.eval.num_problems) if c.eval.num_problems else []
  check_prompt_lengths(codec, eval_problems, max_prompt, "held-out")
  check_prompt_lengths(codec, task.sample(np.random.default_rng(c.seed), 64), max_prompt, "training")
  buckets = tuple(b for b in c.trainer.buckets if b < c.model.max_len) + (c.model.max_len,)

  mesh = sharding.make_mesh(tuple(c.trainer.mesh_shape))
  multiple = sharding.batch_size_multiple(mesh) * c.trainer.num_microbatches
  if c.buffer.batch_size % multiple:
    raise ValueError(f"buffer.batch_size={c.buffer.batch_size} must be a multiple of data * fsdp * "
                     f"num_microbatches = {multiple}; change trainer.mesh_shape or the batch size")
  shapes = jax.eval_shape(lambda: models.init_params(model_cfg, jax.random.PRNGKey(0)))
  param_sh = sharding.param_shardings(shapes, mesh)
  if c.model.path:
    _, params = models.load_hf(c.model.path, dtype=model_cfg.params_dtype, shardings=param_sh)
  else:
    params = None
  optimizer = optim.make_optimizer(
      c.trainer.learning_rate, warmup_steps=c.trainer.warmup_steps, total_steps=c.total_steps,
      schedule=c.trainer.schedule, weight_decay=c.trainer.weight_decay, b1=c.trainer.b1,
      b2=c.trainer.b2, max_grad_norm=c.trainer.max_grad_norm)
  lr_fn = optim.make_schedule(c.trainer.learning_rate, c.trainer.warmup_steps, c.total_steps,
                              c.trainer.schedule)
  state = trainer.init_train_state(model_cfg, optimizer, jax.random.PRNGKey(c.seed), params=params,
                                   mesh=mesh, with_ref_params=c.trainer.kl_coef != 0.0)
  state_sh = jax.tree.map(lambda x: x.sharding, state)
  loss_fn = trainer.make_loss_fn(c.trainer.loss, aggregation=c.trainer.aggregation,
                                 eps_low=c.trainer.eps_low, eps_high=c.trainer.eps_high,
                                 kl_coef=c.trainer.kl_coef, tis_cap=c.trainer.tis_cap)
  train_step = trainer.make_train_step(model_cfg, optimizer, loss_fn, mesh, state_sh,
                                       num_microbatches=c.trainer.num_microbatches,
                                       chunk_size=c.trainer.logprob_chunk, learning_rate_fn=lr_fn)
  logprob_fn = trainer.make_logprob_fn(model_cfg, mesh, state_sh.params,
                                       chunk_size=c.trainer.logprob_chunk)

  checkpointer = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                             max_to_keep=c.checkpoint.keep)
  resumed_host = None
  if checkpointer.latest_step() is not None:
    restored = checkpointer.restore(abstract_state=state)
    state, resumed_host = restored
    logging.info("restoring checkpoint step %d", int(jax.device_get(state.step)))
  step = int(jax.device_get(state.step))

  buf = buffer_lib.ReplayBuffer(c.buffer.size, seed=c.seed,
                                positive_fraction=c.buffer.positive_fraction,
                                consume=c.buffer.on_policy)
  accountant = accounting.ComputeAccountant(c.rollout.num_workers, c.trainer.num_devices,
                                            model_cfg=model_cfg, seq_len=c.model.max_len)
  writer = metrics_lib.MetricsWriter(workdir, resume_step=step if resumed_host else None,
                                     enabled=jax.process_index() == 0)
  if not resumed_host:
    writer.truncate_after(-1)  # a fresh run in a used workdir starts a fresh log
  eval_sampler = JaxSampler(model_cfg, sharding.local_params(state.params), c.model.max_len,
                            batch_size=c.rollout.sampler_batch_size,
                            eos_token_ids=codec.stop_ids, seed=c.seed + 1)
  gen_per_rollout = (c.scheduler.mu * c.scheduler.train_seconds_per_step / c.buffer.batch_size)
  parts = Parts(
      config=c, task=task, codec=codec, tokenizer_dir=tok_dir, model_cfg=model_cfg, mesh=mesh,
      state=state, train_step=train_step, logprob_fn=logprob_fn, buffer=buf,
      prompts=PromptSource(task, c.seed), advantage_fn=make_advantage_fn(
          c.trainer.loss, c.trainer.adv_eps, c.trainer.tau),
      accountant=accountant, sim_state=schedulers.SimState(), writer=writer,
      checkpointer=checkpointer, resumed_host=resumed_host, eval_sampler=eval_sampler,
      eval_problems=eval_problems, buckets=buckets, gen_seconds_per_rollout=gen_per_rollout)
  parts._closers += [task.close, writer.close, checkpointer.close]
  parts.workers = workers_lib.RolloutWorkers(c, parts, workdir)
  parts.sampler = parts.workers.local_worker()
  parts._closers.append(parts.workers.close)
  return parts
