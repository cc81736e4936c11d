"""Builds a run's parts from its config, failing fast with errors that name the fix.

`build(config, workdir, stack) -> Parts`: task, tokenizer, model, mesh, train state (resumed when a
checkpoint exists), train step, replay buffer, request intake, rollout backend, compute accountant,
metrics writer and row builder. Everything that must be released (reward processes, writers, the
checkpointer, weight directories) is registered on `stack`, a `contextlib.ExitStack` the caller
closes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Callable, Optional

from absl import logging
import jax

from jaxreplay.run import accounting
from jaxreplay.data import buffer as buffer_lib
from jaxreplay.infra import checkpoint as checkpoint_lib
from jaxreplay.config import resolve as resolve_lib
from jaxreplay.config import validation
from jaxreplay.config.validation import PROCEDURAL_TASKS
from jaxreplay.config import memory_plan
from jaxreplay.infra import metric_writers as metrics_lib
from jaxreplay.models import hf_io
from jaxreplay.models import presets
from jaxreplay.models import transformer
from jaxreplay.models.config import ModelConfig
from jaxreplay.learner import optim
from jaxreplay.run import eval_problems as eval_problems_lib
from jaxreplay.run import metrics_row
from jaxreplay.run import regime
from jaxreplay.data import batch_reuse
from jaxreplay.data import reuse
from jaxreplay.data import collate as collate_lib
from jaxreplay.run import schedules
from jaxreplay.infra import sharding
from jaxreplay import tasks
from jaxreplay.tasks import tokenizer
from jaxreplay.learner import adapters
from jaxreplay.learner import loss_fn as loss_fn_lib
from jaxreplay.learner import trainer
from jaxreplay.models import lora as lora_lib
from jaxreplay.data.experience import Intake, PromptSource, make_advantage_fn
from jaxreplay.rollout import multiturn
from jaxreplay.rollout.base import SamplingParams
from jaxreplay.rollout.jax_sampler import JaxSampler
from jaxreplay.tasks import arithmetic as arithmetic_lib
from jaxreplay.tasks import environments
from jaxreplay.tasks import prompt_check
from jaxreplay.rollout import backend_table
from jaxreplay.rollout.backends import RolloutBackend


def make_task(t):
  """The task of a config's task section `t` (config.task: `tasks.make_task` with its keys)."""
  if t.name == "arithmetic":
    kwargs = dict(num_digits=arithmetic_lib.digit_range(t.num_digits), ops=t.ops, seed=0,
                  digit_decay=t.get("digit_decay", 1.0))
  elif t.name == "multiplication":
    kwargs = dict(num_digits=arithmetic_lib.digit_range(t.num_digits), seed=0)
  elif t.name in ("scratchpad", "calculator"):
    kwargs = dict(num_digits=arithmetic_lib.digit_range(t.num_digits), seed=0,
                  digit_decay=t.get("digit_decay", 1.0))
  else:
    kwargs = dict(path=t.path, eval_path=t.eval_path or None, problem_key=t.problem_key,
                  answer_key=t.answer_key, template=t.template,
                  reward_memory_gib=t.reward_memory_gib, reward_fn=t.reward_fn or None,
                  num_reward_workers=t.num_reward_workers)
  return tasks.make_task(t.name, reward_timeout_s=t.reward_timeout_s, **kwargs)



def episode_runner(c, task, codec) -> Optional[multiturn.EpisodeRunner]:
  """The multi-turn runner of a task with an environment (task.env_fn's plug-in, else the task's
  own `make_env`), None for a single-turn task. The factory is checked now: one environment is
  built (`environments.spec_from_factory`)."""
  t = c.task
  if t.env_fn:
    factory, name = environments.import_env_factory(t.env_fn), "task.env_fn"
  elif hasattr(task, "make_env"):
    factory, name = task.make_env, f"task {t.name!r}"
  else:
    return None
  spec = environments.spec_from_factory(factory, t.env_max_turns,
                                        t.env_max_tokens or c.model.max_len,
                                        t.env_step_timeout_s, name=name)
  return multiturn.EpisodeRunner(spec, codec, c.model.max_len)


def optimization(c):
  """(optax optimizer, learning-rate schedule, loss function) of `config.trainer`: what the
  trainer and the gradient-noise probe (`noise_probe`) both build."""
  t = c.trainer
  optimizer = optim.make_optimizer(
      t.learning_rate, warmup_steps=t.warmup_steps, total_steps=c.total_steps,
      schedule=t.schedule, weight_decay=t.weight_decay, b1=t.b1, b2=t.b2,
      max_grad_norm=t.max_grad_norm)
  lr_fn = optim.make_schedule(t.learning_rate, t.warmup_steps, c.total_steps, t.schedule)
  loss_fn = loss_fn_lib.loss_fn_from_config(t)
  return optimizer, lr_fn, loss_fn

def load_codec(c, task, workdir: str):
  """(TextCodec, tokenizer dir): model.tokenizer, else model.path, else a character tokenizer of
  a procedural task's charset written to workdir/tokenizer.

  Stop ids: the tokenizer's eos plus every eos id of model.path (and of the tokenizer dir):
  `tokenizer.model_eos_ids`, from generation_config.json and config.json. Prompts go through the
  tokenizer's chat template per model.chat_template ("auto": when the tokenizer ships one),
  with the variables of model.chat_template_kwargs."""
  tok_dir = c.model.tokenizer or c.model.path
  if not tok_dir:
    if c.task.name not in PROCEDURAL_TASKS:
      raise ValueError("model.tokenizer (or model.path) is needed for task "
                       f"{c.task.name!r}: the character tokenizer only covers "
                       f"{' and '.join(PROCEDURAL_TASKS)}")
    tok_dir = os.path.join(workdir, "tokenizer")
    if not os.path.isdir(tok_dir):
      tokenizer.build_char_tokenizer(task.charset, tok_dir)
  extra = tokenizer.model_eos_ids(c.model.path) if c.model.path else ()
  codec = tokenizer.load_tokenizer(tok_dir, extra_stop_ids=extra,
                                   use_chat_template=c.model.chat_template,
                                   chat_template_kwargs=validation.chat_template_kwargs(c))
  logging.info("tokenizer %s: stop ids %s, chat template %s", tok_dir, list(codec.stop_ids),
               "on" if codec.use_chat_template else "off")
  return codec, tok_dir


def model_config(c, codec) -> ModelConfig:
  """The policy's architecture: model.path's config.json, else the preset sized to the tokenizer."""
  overrides = dict(dtype=c.model.dtype, param_dtype=c.model.param_dtype, remat=c.model.remat,
                   attention=c.model.attention, scan_unroll=c.model.get("scan_unroll", 0))
  if c.model.path:
    model_cfg = ModelConfig.from_hf_dir(c.model.path, **overrides)
  else:
    model_cfg = presets.PRESETS[c.model.preset](**overrides).replace(
        vocab_size=max(codec.vocab_size, 1), eos_token_id=codec.eos_id,
        bos_token_id=codec.bos_id, pad_token_id=codec.pad_id)
  tokenizer.check_tokenizer_matches_model(codec, model_cfg)
  return model_cfg


def trainer_mesh(c):
  """The trainer's mesh: trainer.mesh_shape over every device JAX sees. On GPUs these must be the
  trainer.num_devices GPUs of `devices.trainer` (`jaxreplay.config.devices` restricts the process to
  them); CPU runs keep the old behaviour (all emulated devices, T only in the accounting)."""
  devs = jax.devices()
  if devs[0].platform == "gpu" and len(devs) != c.trainer.num_devices:
    raise ValueError(f"trainer.num_devices={c.trainer.num_devices} but this process sees "
                     f"{len(devs)} GPUs: start it with `python -m jaxreplay.launch` (which restricts "
                     "it to devices.trainer) or set CUDA_VISIBLE_DEVICES to the trainer's GPUs")
  try:
    return sharding.make_mesh(tuple(c.trainer.mesh_shape))
  except ValueError as e:
    raise ValueError(f"trainer.mesh_shape={tuple(c.trainer.mesh_shape)} over {len(devs)} trainer "
                     f"devices: {e}") from None


@dataclasses.dataclass
class LearnerParts:
  """The trainer's side: the policy's architecture, its mesh, the train state and the jitted
  functions over it. `state` is the train state's one owner: built (or restored) here, replaced
  after each step by `training.Training.train_on` (the step donates the old buffers); every other
  reader (evaluation, checkpoints, exports) reads it here."""
  model_cfg: ModelConfig
  mesh: Any
  state: Any
  train_step: Callable
  logprob_fn: Callable
  lora: Optional[adapters.FrozenBase] = None  # LoRA (model.lora_rank > 0): state.params are adapters


@dataclasses.dataclass
class DataParts:
  """The data plane: the task and its tokenizer, the replay buffer and the request intake that
  fills it, the reuse controller that paces it, the reuse of each fresh batch for several updates,
  the collate buckets and the held-out problems."""
  task: Any
  codec: Any
  tokenizer_dir: Optional[str]
  buffer: buffer_lib.ReplayBuffer
  intake: Intake
  buckets: tuple
  eval_problems: list
  reuse: Optional[Any] = None   # data.reuse.ReuseController
  # data.batch_reuse.BatchReuse: several updates per fresh batch (ppo_epochs, the gradient gate)
  batch_reuse: Any = dataclasses.field(default_factory=lambda: batch_reuse.BatchReuse(1))


@dataclasses.dataclass
class GenerationParts:
  """Where rollouts come from: the rollout backend (workers, weight publishing), the trainer's
  eval sampler, and the simulated clock with its per-rollout cost."""
  rollouts: RolloutBackend
  eval_sampler: Optional[JaxSampler]  # eval.backend="trainer" only (None: eval on the engines)
  sim_state: schedules.SimState
  gen_seconds_per_rollout: float


@dataclasses.dataclass
class TelemetryParts:
  """What the run measures and writes: compute accounting, the metrics rows, their writer, the
  regime diagnostics."""
  accountant: accounting.ComputeAccountant
  metrics: metrics_row.RunMetrics
  writer: metrics_lib.MetricsWriter
  regime: Optional[Any] = None  # run.regime.RegimeDiagnostics
  problems: Optional[eval_problems_lib.ProblemLog] = None  # eval.per_problem: eval_problems.jsonl


@dataclasses.dataclass
class Parts:
  """Everything a run holds, built once by `build`, in groups: `learner`, `data`, `generation`,
  `telemetry`, plus the config, the workdir, the checkpointer and the resumed host state. A part
  is read through its group: `parts.data.buffer`, `parts.learner.state`, ..."""
  config: Any
  workdir: str
  learner: LearnerParts
  data: DataParts
  generation: GenerationParts
  telemetry: TelemetryParts
  checkpointer: checkpoint_lib.Checkpointer
  resumed_host: Optional[dict]

  def model_params(self, params):
    """The policy's params of train-state params `params` (with LoRA: the base with them attached)."""
    lora = self.learner.lora
    return params if lora is None else lora.model_params(params)


def make_learner(c, model_cfg: ModelConfig, mesh) -> tuple[LearnerParts, Any, Any]:
  """The trainer's parts on `mesh`: the initial train state (model.path's params, a preset's init,
  or LoRA adapters over a frozen base), the jitted train step and log-prob function. Returns
  (learner, loss function, the train state's shardings)."""
  shapes = jax.eval_shape(lambda: transformer.init_params(model_cfg, jax.random.PRNGKey(0)))
  storage = sharding.storage_shapes(shapes, mesh)  # padded where the mesh does not divide
  padded = sharding.padded_leaves(shapes, mesh)
  if padded:
    logging.info("stored padded to shard over mesh %s: %s", dict(mesh.shape), ", ".join(
        f"{k} {a}->{b}" for k, (a, b) in padded.items()))
  params = None
  if c.model.path:
    _, params = hf_io.load_hf(c.model.path, dtype=model_cfg.params_dtype,
                              shardings=sharding.param_shardings(storage, mesh))
  t = c.trainer
  optimizer, lr_fn, loss_fn = optimization(c)
  lora_spec, base = lora_lib.spec_from_config(c.model), None
  if lora_spec is None:
    state = trainer.init_train_state(model_cfg, optimizer, jax.random.PRNGKey(c.seed),
                                     params=params, mesh=mesh, with_ref_params=t.kl_coef != 0.0,
                                     donate_params=params is not None)
  else:
    base, state = lora_state(c, model_cfg, lora_spec, optimizer, mesh, params)
  del params
  state_sh = jax.tree.map(lambda x: x.sharding, state)
  gated = c.buffer.get("reuse_control", "off") == batch_reuse.GATE_CONTROL
  train_step = trainer.make_train_step(model_cfg, optimizer, loss_fn, mesh, state_sh,
                                       num_microbatches=t.num_microbatches,
                                       chunk_size=t.logprob_chunk, learning_rate_fn=lr_fn,
                                       logprob_processing=trainer.logprob_processing(c),
                                       lora=base, **trainer.step_options(t),
                                       gate_leaf=trainer.gate_leaf(model_cfg) if gated else None)
  logprob_fn = trainer.make_logprob_fn(model_cfg, mesh, state_sh.params, chunk_size=t.logprob_chunk,
                                       logprob_processing=trainer.logprob_processing(c), lora=base)
  return (LearnerParts(model_cfg=model_cfg, mesh=mesh, state=state, train_step=train_step,
                       logprob_fn=logprob_fn, lora=base), loss_fn, state_sh)


def make_intake(c, task, codec, loss_fn, episodes: Optional[multiturn.EpisodeRunner] = None):
  """The data plane: the replay buffer (config.buffer), the reuse controller that paces it and
  the request intake that fills it (with `episodes`: multi-turn requests). Returns (buffer,
  intake, reuse controller)."""
  t = c.trainer
  buf = buffer_lib.ReplayBuffer(c.buffer.size, seed=c.seed,
                                positive_fraction=c.buffer.positive_fraction,
                                consume=c.buffer.on_policy, consume_order=c.buffer.on_policy_order,
                                max_staleness=c.buffer.get("max_staleness", 0),
                                **buffer_lib.sampler_options(c.buffer))
  sampling = SamplingParams(temperature=c.rollout.temperature, top_p=c.rollout.top_p,
                            top_k=c.rollout.top_k, max_tokens=c.rollout.max_tokens,
                            stop_token_ids=tuple(codec.stop_ids), seed=c.seed)
  reuse_controller = reuse.ReuseController(reuse.ReuseSettings.from_config(c.buffer,
                                                                           c.scheduler.mu),
                                           c.buffer.batch_size,
                                           c.rollout.prompts_per_request * c.rollout.group_size,
                                           buffer=buf)
  gate = None
  if reuse_controller.active:
    gate = lambda in_flight: reuse_controller.may_start_request(buf.total_added, in_flight)
  intake = Intake(task, codec, PromptSource(task, c.seed), buf,
                  make_advantage_fn(t.loss, options=loss_fn.options), sampling,
                  c.rollout.prompts_per_request, c.rollout.group_size, on_policy=c.buffer.on_policy,
                  gate=gate, episodes=episodes)
  return buf, intake, reuse_controller


def build(c, workdir: str, stack: contextlib.ExitStack) -> Parts:
  """Builds every part of the run in `workdir` (see the module docstring) from a config that
  `config.validation.validate_config` accepted (`pipeline.run` validates once, before this) and
  `config.resolve.resolve` resolved (a plain config is resolved here; the caller's is untouched).
  `Parts.config` is the resolved, frozen config."""
  c = resolve_lib.resolve(c)
  backend_table.check_installed(c.rollout.backend)
  task = make_task(c.task)
  stack.callback(task.close)
  codec, tok_dir = load_codec(c, task, workdir)
  model_cfg = model_config(c, codec)
  # Every prompt, not a sample: an over-long row would crash the run when drawn (and every resume).
  prompt_check.check_task_prompts(task, codec, prompt_check.Context(c.model.max_len,
                                                                    c.rollout.max_tokens),
                                  c.task.max_skip_fraction, seed=c.seed)
  eval_problems = task.eval_set(c.eval.num_problems) if c.eval.num_problems else []
  buckets = tuple(b for b in c.trainer.buckets if b < c.model.max_len) + (c.model.max_len,)

  mesh = trainer_mesh(c)
  errors = memory_plan.batch_rule_errors(c, mesh)
  if errors:
    raise ValueError("invalid config:\n  " + "\n  ".join(errors))
  learner, loss_fn, state_sh = make_learner(c, model_cfg, mesh)
  t, base, state = c.trainer, learner.lora, learner.state
  regime_diagnostics = regime.RegimeDiagnostics(
      model_cfg, loss_fn, mesh, state_sh.params, every=c.log.diagnostics_every,
      splits=c.log.diagnostics_splits, probe_rollouts=c.log.diagnostics_probe,
      decay=c.log.noise_scale_decay, chunk_size=t.logprob_chunk,
      logprob_remat=trainer.step_options(t)["logprob_remat"],
      logprob_processing=trainer.logprob_processing(c), lora=base,
      collate=lambda rollouts: collate_lib.collate(rollouts, buckets=buckets,
                                                   pad_id=codec.pad_id))

  checkpointer = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                             max_to_keep=c.checkpoint.keep)
  stack.callback(checkpointer.close)
  resumed_host = None
  resumed = checkpointer.restore_latest_valid(abstract_state=state)  # skips damaged steps
  if resumed is not None:
    resumed_step, state, resumed_host, skipped = resumed
    learner.state = state
    logging.info("restored checkpoint step %d%s", resumed_step, f" (skipped damaged steps "
                 f"{', '.join(str(s) for s, _ in skipped)})" if skipped else "")
    if base is not None:  # the adapters only make sense on the base they were trained on
      adapters.check_resume(resumed_host.get("lora"), base, workdir)
  step = int(jax.device_get(state.step))

  episodes = episode_runner(c, task, codec)
  if episodes is not None:
    stack.callback(episodes.close)
  buf, intake, reuse_controller = make_intake(c, task, codec, loss_fn, episodes)
  accountant = accounting.ComputeAccountant(c.rollout.num_workers, t.num_devices,
                                            model_cfg=model_cfg, seq_len=c.model.max_len)
  writer = metrics_lib.MetricsWriter(workdir, resume_step=step if resumed_host else None,
                                     enabled=jax.process_index() == 0,
                                     wandb=metrics_lib.wandb_settings(c.log, c.to_dict()))
  stack.callback(writer.close)
  if not resumed_host:
    writer.truncate_after(-1)  # a fresh run in a used workdir starts a fresh log
  problem_log = None
  if c.eval.per_problem and c.eval.num_problems:
    problem_log = eval_problems_lib.ProblemLog(workdir, resume_step=step if resumed_host else None,
                                               enabled=jax.process_index() == 0)
  sim_state = schedules.SimState()
  mismatch = metrics_row.MismatchProbe(learner.logprob_fn, codec.pad_id, buckets, c.log.mismatch_every)
  # Multi-process async: process 0 owns the workers (and the buffer); the others only train.
  schedule = schedules.schedule_class(c.scheduler.kind)
  follower = schedule.leader_owns_workers and jax.process_index() > 0
  rollouts = RolloutBackend(c, model_cfg, codec.stop_ids, serves_workers=not follower, lora=base,
                            num_actors=schedule.num_actors(c))
  stack.callback(rollouts.close)
  eval_sampler = None  # eval.backend="engines": the rollout workers evaluate (no KV cache here)
  if c.eval.backend == "trainer":
    policy = state.params if base is None else base.model_params(state.params)
    eval_sampler = JaxSampler(model_cfg, sharding.local_params(policy), c.model.max_len,
                              batch_size=c.eval.batch_size or c.rollout.sampler_batch_size,
                              eos_token_ids=codec.stop_ids, seed=c.seed + 1)
  gen_seconds_per_rollout = (c.scheduler.mu * c.scheduler.train_seconds_per_step /
                             c.buffer.batch_size)
  return Parts(
      config=c, workdir=workdir,
      learner=learner,
      data=DataParts(task=task, codec=codec, tokenizer_dir=tok_dir, buffer=buf, intake=intake,
                     buckets=buckets, eval_problems=eval_problems, reuse=reuse_controller,
                     batch_reuse=batch_reuse.BatchReuse.from_config(c)),
      generation=GenerationParts(rollouts=rollouts, eval_sampler=eval_sampler, sim_state=sim_state,
                                 gen_seconds_per_rollout=gen_seconds_per_rollout),
      telemetry=TelemetryParts(
          accountant=accountant, writer=writer, regime=regime_diagnostics, problems=problem_log,
          metrics=metrics_row.RunMetrics.from_config(c, buf, accountant, task, intake, sim_state,
                                                     mismatch)),
      checkpointer=checkpointer, resumed_host=resumed_host)


def lora_state(c, model_cfg, spec, optimizer, mesh, params):
  """LoRA (model.lora_rank > 0): (the frozen base, the adapters' train state). The base is
  model.path's params (loaded, placed), else the preset initialised as a full fine-tuning run's
  params are (the first split of PRNGKey(seed)); the adapters draw from fold_in(PRNGKey(seed), 1)."""
  if jax.process_count() > 1:
    raise ValueError("model.lora_rank > 0 with several trainer processes is not built (the "
                     "samplers need the base on every process); run LoRA on one trainer process")
  key = jax.random.PRNGKey(c.seed)
  base = adapters.frozen_base(model_cfg, spec, mesh, params, rng=jax.random.split(key)[0],
                              path=c.model.path)
  state = adapters.init_adapter_state(model_cfg, spec, optimizer, jax.random.fold_in(key, 1), mesh)
  logging.info("LoRA rank %d (alpha %g, scale %.4g) on %s: %d adapter parameters, base %s frozen",
               spec.rank, spec.alpha, spec.scale, ",".join(spec.targets),
               lora_lib.num_params(model_cfg, spec), model_cfg.param_dtype)
  return base, state
