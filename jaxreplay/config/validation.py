"""Config validation, section by section, run once before anything is built.

`validate_config(c)` collects the errors of every section (`model_errors(c.model)`,
`trainer_errors(c.trainer, c)`, ...) and raises one ValueError listing them all, each naming the key,
its value and the fix. A new key's check goes in its section's function, next to the other checks of
that section; the allowed values of a key live with the code that reads it and are only read here,
from its table: `rollout.backend_table.BACKENDS` (rollout.backend, placements, transports, dtypes,
LoRA ranks), `data.samplers.SAMPLERS` / `QUEUES` (buffer.priority, buffer.on_policy_order),
`learner.algorithms.ALGORITHMS` (trainer.loss), `learner.corrections.CORRECTIONS`
(trainer.off_policy), `config.schedule_table.SCHEDULES` (scheduler.kind). An algorithm's own options
are checked by their dataclass (`learner.algorithms`), never re-typed here. The config layer never
imports the run layer: what it checks of run/ is in `config.schedule_table`. The rules over single
keys (counts >= 1, tuple elements, keys another key switches off) are tables in `config.key_rules`;
the run directory's checks (a file in the way, a resume that would change the training) are in
`config.workdir`. The error is a `ConfigError` (a ValueError) holding the list of messages, each
"<key>=<value> <what is wrong>; <the fix>": the launcher prints it as one line and exits 2.
"""
from __future__ import annotations

import difflib
import importlib.util
import json
import os

from jaxreplay.config import devices as devices_lib
from jaxreplay.config import key_rules
from jaxreplay.config import schedule_table
from jaxreplay.config import workdir as workdir_lib
from jaxreplay.rollout import backend_table

TASKS = ("arithmetic", "scratchpad", "multiplication", "math", "calculator")
# generated problems over a character tokenizer
PROCEDURAL_TASKS = ("arithmetic", "scratchpad", "multiplication", "calculator")
ENV_TASKS = ("calculator",)  # tasks with an environment of their own (multi-turn)
DIGIT_DECAY_TASKS = ("arithmetic", "scratchpad", "calculator")  # the tasks task.digit_decay shapes


CHARGE_DIAGNOSTICS = ("auto", "on", "off")  # log.charge_diagnostics (run.regime.charges_diagnostics)


class ConfigError(ValueError):
  """The config's problems (`errors`, one message each: the key, its value and the fix)."""

  def __init__(self, errors: list[str]):
    self.errors = list(errors)
    super().__init__("invalid config:\n  " + "\n  ".join(self.errors))


def validate_config(c) -> None:
  """Config conflicts a user can make, caught before anything is built (one `ConfigError`).

  The single-key rules (`key_rules`: counts, tuple elements) go first: the section checks divide
  by those counts."""
  errors = key_rules.count_errors(c) + key_rules.element_errors(c)
  if not errors:
    errors = (run_errors(c) + model_errors(c.model, c.rollout) + task_errors(c.task) +
              rollout_errors(c.rollout, c.model.max_len) + partial_errors(c) +
              buffer_errors(c.buffer, c.rollout, c.log, c.scheduler.mu) +
              trainer_errors(c.trainer, c) + scheduler_errors(c.scheduler, c) + eval_errors(c.eval) + devices_errors(c.devices) +
              log_errors(c) + key_rules.no_effect_errors(c))
  if errors:
    raise ConfigError(errors)


def check_resume(c, workdir: str) -> None:
  """`ConfigError` when rerunning `workdir` with `c` would silently change its training
  (`config.workdir.resume_errors`)."""
  errors = workdir_lib.resume_errors(c, workdir)
  if errors:
    raise ConfigError(errors)


def choice_error(key: str, value, valid, note: str = "") -> str:
  """"key='value': expected one of (...)", the nearest valid value first when one is close."""
  near = difflib.get_close_matches(str(value), [str(v) for v in valid], n=1, cutoff=0.6)
  return (f"{key}={value!r}: expected one of {tuple(valid)}" + (f" ({note})" if note else "")
          + (f"; did you mean {near[0]!r}?" if near else ""))


def run_errors(c) -> list[str]:
  """The top-level keys: compute_budget, export_hf_every (total_steps >= 1: `key_rules`)."""
  errors = []
  if c.compute_budget < 0:
    errors.append(f"compute_budget={c.compute_budget} must be >= 0 (device-seconds; 0 = off)")
  if c.compute_budget > 0 and c.trainer.schedule == "cosine":
    errors.append("compute_budget with trainer.schedule='cosine': the cosine decays over "
                  "total_steps, which the budget cuts short; use trainer.schedule='constant'")
  if c.export_hf_every < 0:
    errors.append(f"export_hf_every={c.export_hf_every} must be >= 0 (0 = at checkpoints)")
  return errors


def model_errors(m, r=None) -> list[str]:
  """model.*: the starting checkpoint, the chat template, LoRA (model.lora_*; `r`: the rollout
  section, whose workers must serve the adapters)."""
  from jaxreplay.tasks import tokenizer  # pylint: disable=g-import-not-at-top
  errors = lora_errors(m, r)
  if m.path and not os.path.isdir(m.path):
    errors.append(f"model.path={m.path!r} is not a directory; pass a Hugging Face model dir "
                  "(config.json + *.safetensors)")
  elif m.path and not os.path.isfile(os.path.join(m.path, "config.json")):
    errors.append(f"model.path={m.path!r} holds no config.json; pass a Hugging Face model dir "
                  "(config.json + *.safetensors), e.g. a run's WORKDIR/hf")
  if m.tokenizer and not os.path.isdir(m.tokenizer):
    errors.append(f"model.tokenizer={m.tokenizer!r} is not a directory; pass a tokenizer dir "
                  "(tokenizer.json), or '' for the one of model.path")
  mode = m.chat_template
  if not isinstance(mode, bool) and mode not in tokenizer.CHAT_TEMPLATE_MODES:
    errors.append(choice_error("model.chat_template", mode, tokenizer.CHAT_TEMPLATE_MODES))
  try:
    chat_template_kwargs(m)
  except ValueError as e:
    errors.append(str(e))
  return errors


def lora_errors(m, r=None) -> list[str]:
  """model.lora_*: rank (0 = off), alpha, targets, dtype (`models.lora.spec_errors`); a rank the
  rollout backend serves (its record's `lora_ranks`; under "auto" every backend it may pick);
  workers placed where the adapters reach them (the records' LoRA workers: local)."""
  from jaxreplay.models import lora  # pylint: disable=g-import-not-at-top
  rank = m.get("lora_rank", 0)
  if rank == 0:
    return []
  errors = lora.spec_errors(rank, m.lora_alpha, tuple(m.lora_targets), m.lora_dtype)
  if r is not None and not errors:
    unlimited = [n for n, b in backend_table.BACKENDS.items() if b.lora_ranks is None]
    for b in backend_table.candidates(r.backend):
      ranks = backend_table.load(b.lora_ranks) if b.lora_ranks is not None else None
      if ranks and rank > ranks[-1]:
        errors.append(f"model.lora_rank={rank}: {b.title} serves LoRA ranks up to {ranks[-1]}; "
                      "lower model.lora_rank or use " +
                      " or ".join(f"rollout.backend={n!r}" for n in unlimited))
    placement = r.get("placement", "local")
    if not any(b.serves_lora(placement) for b in backend_table.BACKENDS.values()):
      errors.append(f"model.lora_rank={rank} with rollout.placement={r.placement!r}: adapter "
                    "refreshes reach local workers only (the JAX sampler or vLLM engines of this "
                    "machine); set rollout.placement='local' or model.lora_rank=0")
  return errors


def chat_template_kwargs(m) -> dict:
  """model.chat_template_kwargs (a JSON object, "" = none) as a dict; ValueError naming the fix.
  `m` is the model section (or the whole config, whose `model` section is read)."""
  m = m.model if "model" in m else m
  text = m.chat_template_kwargs
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


def task_errors(t) -> list[str]:
  """task.*: the task's name, digits, dataset files and reward function."""
  from jaxreplay.tasks import arithmetic  # pylint: disable=g-import-not-at-top
  errors = []
  if t.name not in TASKS:
    errors.append(choice_error("task.name", t.name, TASKS))
  if t.name in PROCEDURAL_TASKS:
    try:
      arithmetic.digit_range(t.num_digits)
    except ValueError as e:
      errors.append(f"task.{e}")
  decay = t.get("digit_decay", 1.0)
  if not (isinstance(decay, (int, float)) and not isinstance(decay, bool) and decay > 0):
    errors.append(f"task.digit_decay={decay!r} must be a number > 0 (1 = operand digit counts "
                  "uniform, < 1 a geometric tail of long problems)")
  elif decay != 1.0 and t.name not in DIGIT_DECAY_TASKS:
    errors.append(f"task.digit_decay={decay} is read by the procedural tasks {DIGIT_DECAY_TASKS} only "
                  f"(task.name={t.name!r}); leave it at 1.0")
  if not 0.0 <= t.max_skip_fraction <= 1.0:
    errors.append(f"task.max_skip_fraction={t.max_skip_fraction} must be in [0, 1] (the "
                  "share of dataset rows that may be dropped for not fitting the context)")
  if not t.reward_memory_gib > 0:
    errors.append(f"task.reward_memory_gib={t.reward_memory_gib} must be > 0 [GiB]")
  if t.name == "math" and not t.path:
    errors.append("task.name='math' needs task.path=<local .jsonl/.parquet file with problem and "
                  "answer fields>")
  elif t.name == "math" and not os.path.exists(t.path):
    errors.append(f"task.path={t.path!r} does not exist; give a local .jsonl, .json or .parquet "
                  "file (or a directory of them) with problem and answer fields")
  if t.path and t.name != "math":
    errors.append(f"task.path={t.path!r} has no effect: only task.name='math' reads a dataset "
                  f"(task.name={t.name!r}); unset it or use the math task")
  for key in ("eval_path", "reward_fn"):
    if t[key] and t.name != "math":
      errors.append(f"task.{key}={t[key]!r} is only read by task.name='math' (task.name="
                    f"{t.name!r}); unset it or use the math task")
  if t.eval_path and not os.path.exists(t.eval_path):
    errors.append(f"task.eval_path={t.eval_path!r} does not exist: give a local .jsonl, "
                  ".json or .parquet file (or a directory of them), e.g. MATH-500's test.jsonl")
  if t.reward_fn and t.reward_fn.count(":") != 1:
    errors.append(f"task.reward_fn={t.reward_fn!r}: expected 'module:function' (e.g. "
                  "'my_rewards:score', a function (completion: str, answer: str) -> float in an "
                  "importable module)")
  if t.num_reward_workers < 1:
    errors.append(f"task.num_reward_workers={t.num_reward_workers} must be >= 1 (reward "
                  "processes of the math task)")
  return errors + env_errors(t)


def env_errors(t) -> list[str]:
  """task.env_*: the environment plug-in and the trajectories' limits (multi-turn)."""
  errors = []
  env_fn = t.get("env_fn", "")
  if env_fn and (env_fn.count(":") != 1 or not all(env_fn.split(":"))):
    errors.append(f"task.env_fn={env_fn!r}: expected 'module:factory' (a function with no "
                  "arguments that returns an environment, jaxreplay.tasks.environments)")
  if env_fn and t.name in ENV_TASKS:
    errors.append(f"task.env_fn={env_fn!r}: task.name={t.name!r} has its own environment; unset "
                  "task.env_fn or use another task's problems")
  if t.get("env_max_turns", 1) < 1:
    errors.append(f"task.env_max_turns={t.env_max_turns} must be >= 1")
  if t.get("env_max_tokens", 0) < 0:
    errors.append(f"task.env_max_tokens={t.env_max_tokens} must be >= 0 (tokens; 0 = "
                  "model.max_len)")
  if not t.get("env_step_timeout_s", 1.0) > 0:
    errors.append(f"task.env_step_timeout_s={t.env_step_timeout_s} must be > 0 [s]")
  return errors


def multiturn(c) -> bool:
  """Whether the run's task is an environment's (multi-turn trajectories)."""
  return c.task.name in ENV_TASKS or bool(c.task.get("env_fn", ""))


def rollout_errors(r, model_max_len: int) -> list[str]:
  """rollout.*: the backend, the request shape, the vLLM engines and the weight transport."""
  from jaxreplay.rollout import backends  # pylint: disable=g-import-not-at-top
  errors = []
  if r.backend not in backend_table.names():
    errors.append(choice_error("rollout.backend", r.backend, backend_table.names()))
  if r.max_tokens >= model_max_len:
    errors.append(f"rollout.max_tokens={r.max_tokens} leaves no room for a prompt in "
                  f"model.max_len={model_max_len}; raise model.max_len")
  if r.refresh_every < 1:
    errors.append(f"rollout.refresh_every={r.refresh_every} must be >= 1")
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
    if str(r[key]).lower() not in backends.TRI_STATE:
      errors.append(f"rollout.{key}={r[key]!r}: expected 'auto', 'true' or 'false'")
  if r.keep_versions < 2:
    errors.append(f"rollout.keep_versions={r.keep_versions} must be >= 2 (a worker may still "
                  "load version v while v + 1 is written)")
  if r.vllm_startup_timeout_s < 0:
    errors.append(f"rollout.vllm_startup_timeout_s={r.vllm_startup_timeout_s} must be >= 0 "
                  "[s] (0 = auto: 300 on CPU, 600 + 300 per engine on GPU)")
  for b in backend_table.BACKENDS.values():  # each backend's weight dtype key
    if b.dtype_key and r.get(b.dtype_key, "auto") not in b.dtypes:
      errors.append(choice_error(f"rollout.{b.dtype_key}", r[b.dtype_key], b.dtypes))
  transports = backend_table.weight_transports()
  if r.weight_transport not in transports:
    errors.append(choice_error("rollout.weight_transport", r.weight_transport, transports,
                               "shm: shared memory, file: an HF directory per refresh"))
  return errors + ray_errors(r)


PARTIAL_MODES = ("off", "continue")  # rollout.partial


def partial_errors(c) -> list[str]:
  """rollout.partial and rollout.partial_chunk_tokens: "continue" needs a schedule whose workers
  run beside the trainer (`schedule_table`'s `partial_rollouts`: async) and local workers of a
  backend whose record `continues_requests` (jax, vllm)."""
  r = c.rollout
  mode = r.get("partial", "off")
  chunk = r.get("partial_chunk_tokens", 16)
  if mode not in PARTIAL_MODES:
    return [f"rollout.partial={mode!r}: expected one of {PARTIAL_MODES}"]
  errors = []
  if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
    errors.append(f"rollout.partial_chunk_tokens={chunk!r} must be an integer >= 1 (tokens a "
                  "request advances per generate call, between two checks for newer weights)")
  if mode == "off":
    return errors
  record = schedule_table.SCHEDULES.get(c.scheduler.kind)
  if record is not None and not record.partial_rollouts:
    errors.append(f"rollout.partial='continue' continues requests in flight at a weight refresh, "
                  f"which happens in the async pool; scheduler.kind={c.scheduler.kind!r} "
                  "generates whole requests: set --config.scheduler.kind=async or "
                  "--config.rollout.partial=off")
  unsupported = [b.name for b in backend_table.candidates(r.backend) if not b.continues_requests]
  if unsupported:
    built = tuple(b.name for b in backend_table.BACKENDS.values() if b.continues_requests)
    errors.append(f"rollout.partial='continue' is built for the backends {built}; "
                  f"rollout.backend={r.backend!r} does not continue a request from its prefix: "
                  f"set --config.rollout.backend to one of {built} or --config.rollout.partial=off")
  if multiturn(c):
    errors.append(f"rollout.partial='continue' advances single completions in chunks; "
                  f"task.name={c.task.name!r} is multi-turn (an environment answers between "
                  "turns): set --config.rollout.partial=off")
  placement = r.get("placement", "local")
  if placement != "local":
    errors.append(f"rollout.partial='continue' runs on local workers; rollout.placement="
                  f"{placement!r}: set --config.rollout.placement=local or "
                  "--config.rollout.partial=off")
  return errors


def ray_errors(r) -> list[str]:
  """rollout.placement and rollout.ray_*. `rollout.ray.group` (which imports Ray) is imported only
  when placement is "ray"; the address is checked for its form here, whether it answers at build
  (`ray.group.connect`)."""
  errors = []
  placement = r.get("placement", "local")
  if placement not in backend_table.placements():
    errors.append(choice_error("rollout.placement", placement, backend_table.placements(),
                               "local: this machine's processes, ray: Ray actors"))
  if placement != "ray":
    return errors
  if importlib.util.find_spec("ray") is None:
    return errors + ["rollout.placement='ray' but Ray is not installed: `pip install -e "
                     "'.[ray]'`, or set --config.rollout.placement=local"]
  from jaxreplay.rollout.ray import group  # pylint: disable=g-import-not-at-top
  if r.ray_placement_strategy not in group.STRATEGIES:
    errors.append(choice_error(
        "rollout.ray_placement_strategy", r.ray_placement_strategy, group.STRATEGIES,
        "PACK: as few nodes as possible, SPREAD: across nodes; STRICT_PACK / STRICT_SPREAD: all on "
        "one node / each on its own, or fail"))
  if not r.ray_num_cpus_per_worker > 0:
    errors.append(f"rollout.ray_num_cpus_per_worker={r.ray_num_cpus_per_worker} must be > 0 "
                  "(CPUs reserved per worker actor; fractions such as 0.5 are allowed)")
  if r.ray_num_gpus_per_worker < 0 and r.ray_num_gpus_per_worker != -1:
    errors.append(f"rollout.ray_num_gpus_per_worker={r.ray_num_gpus_per_worker}: expected -1 "
                  "(auto: vllm_tensor_parallel_size on a GPU machine, else 0) or a count >= 0")
  if r.ray_max_restarts < -1:
    errors.append(f"rollout.ray_max_restarts={r.ray_max_restarts} must be >= 0 (restarts per "
                  "worker actor) or -1 (no limit)")
  problem = group.check_address(str(r.ray_address))
  if problem:
    errors.append(problem)
  return errors


def buffer_errors(b, r, log=None, mu: float = 6.84) -> list[str]:
  """buffer.*: N against B and against one request (`r`: the rollout section), the reuse controller
  (`log`: the log section, whose diagnostics the adaptive controller reads; `mu`: scheduler.mu,
  which it reads too)."""
  from jaxreplay.data import batch_reuse  # pylint: disable=g-import-not-at-top
  from jaxreplay.data import reuse  # pylint: disable=g-import-not-at-top
  from jaxreplay.data import samplers  # pylint: disable=g-import-not-at-top
  errors = []
  try:
    settings = reuse.ReuseSettings.from_config(b, mu)
  except ValueError as e:
    errors.append(str(e))
  else:
    if settings.control in reuse.PACING_CONTROLS and b.on_policy:
      errors.append(f"buffer.reuse_control={settings.control!r} paces a replay buffer; the on-policy "
                    "queue (buffer.on_policy=True) uses each rollout once: set one of them off")
    if settings.control == batch_reuse.GATE_CONTROL:
      if not b.on_policy:
        errors.append("buffer.reuse_control='gradient_gate' reuses each fresh batch of the "
                      "on-policy queue: set buffer.on_policy=True")
      try:
        batch_reuse.GateSettings.from_config(b)
      except ValueError as e:
        errors.append(str(e))
    if settings.control == "adaptive" and log is not None and log.diagnostics_every < 1:
      errors.append("buffer.reuse_control='adaptive' decides from the regime diagnostics: set "
                    "log.diagnostics_every >= 1 (e.g. 5)")
  if b.batch_size > b.size:
    errors.append(f"buffer.batch_size (B={b.batch_size}) > buffer.size (N={b.size}): "
                  "a batch can never be sampled; lower B or raise N (N >= B)")
  request = r.prompts_per_request * r.group_size
  if b.on_policy and request > b.size:
    errors.append(f"buffer.on_policy: one request ({request} rollouts) does not fit the queue "
                  f"(buffer.size={b.size}); raise buffer.size to >= {request}")
  if b.on_policy and b.positive_fraction:
    errors.append("buffer.on_policy=True cannot use buffer.positive_fraction; set it to 0")
  if b.on_policy_order not in samplers.QUEUES:
    errors.append(choice_error("buffer.on_policy_order", b.on_policy_order,
                               tuple(samplers.QUEUES)))
  if b.priority not in samplers.SAMPLERS:
    errors.append(choice_error("buffer.priority", b.priority, tuple(samplers.SAMPLERS)))
  if not b.fresh_tau > 0:
    errors.append(f"buffer.fresh_tau={b.fresh_tau} must be > 0 [updates]")
  else:
    options = samplers.sampler_options(b)
    try:
      samplers.check_options(options["priority"], options["fresh_tau"], 0, False, False,
                             options["fresh_base"], options["fresh_alpha"], options["fresh_eps"])
    except ValueError as e:
      if b.priority in samplers.SAMPLERS:
        errors.append(f"buffer.{e}")
  if b.max_uses < 0:
    errors.append(f"buffer.max_uses={b.max_uses} must be >= 0 (0 = no cap)")
  max_staleness = b.get("max_staleness", 0)
  if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
    errors.append(f"buffer.max_staleness={max_staleness!r} must be an integer >= 0 (policy "
                  "versions a completion token may lag the trainer; 0 = no limit)")
  if b.on_policy and (b.priority != "uniform" or b.max_uses or b.replace_zero_variance):
    errors.append("buffer.on_policy=True uses each rollout once: buffer.priority, max_uses and "
                  "replace_zero_variance do not apply; leave them at 'uniform', 0, False")
  return errors


def trainer_errors(t, c) -> list[str]:
  """trainer.*: the loss and its options (their dataclass), the schedule, the step's options."""
  from jaxreplay.learner import algorithms  # pylint: disable=g-import-not-at-top
  from jaxreplay.learner import corrections  # pylint: disable=g-import-not-at-top
  from jaxreplay.learner import loss_fn as loss_fn_lib  # pylint: disable=g-import-not-at-top
  from jaxreplay.learner import optim  # pylint: disable=g-import-not-at-top
  from jaxreplay.learner import trainer  # pylint: disable=g-import-not-at-top
  from jaxreplay.models import logprobs  # pylint: disable=g-import-not-at-top
  errors = []
  if t.get("logprob_remat", "auto") not in logprobs.REMAT_MODES:
    errors.append(choice_error("trainer.logprob_remat", t.logprob_remat, logprobs.REMAT_MODES))
  if t.sampling_logprobs not in trainer.SAMPLING_LOGPROBS:
    errors.append(choice_error("trainer.sampling_logprobs", t.sampling_logprobs,
                               trainer.SAMPLING_LOGPROBS))
  elif t.sampling_logprobs == "processed":
    try:
      trainer.logprob_processing(c)
    except ValueError as e:
      errors.append(f"trainer.sampling_logprobs='processed' with rollout.temperature="
                    f"{c.rollout.temperature}: {e}; sample at a temperature >= 1e-5 or set "
                    "trainer.sampling_logprobs='raw'")
  if t.get("nonfinite_check", "grads") not in trainer.NONFINITE_CHECKS:
    errors.append(choice_error("trainer.nonfinite_check", t.nonfinite_check,
                               trainer.NONFINITE_CHECKS))
  if t.loss not in algorithms.ALGORITHMS:
    errors.append(choice_error("trainer.loss", t.loss, tuple(algorithms.ALGORITHMS)))
  elif t.get("off_policy", "none") not in corrections.CORRECTIONS:
    errors.append(choice_error("trainer.off_policy", t.off_policy,
                               tuple(corrections.CORRECTIONS)))
  else:
    try:  # the algorithm's options, the off-policy correction and their combination
      loss_fn_lib.loss_fn_from_config(t)
    except (ValueError, TypeError) as e:
      errors.append(str(e))
    if c.rollout.group_size < algorithms.get(t.loss).min_group_size:
      errors.append(f"rollout.group_size={c.rollout.group_size} gives trainer.loss={t.loss!r} zero "
                    f"advantages; use group_size >= {algorithms.get(t.loss).min_group_size} or "
                    "trainer.loss='asymre'")
  if t.schedule not in optim.SCHEDULES:
    errors.append(choice_error("trainer.schedule", t.schedule, optim.SCHEDULES))
  if t.schedule == "cosine" and c.total_steps <= t.warmup_steps:
    errors.append(f"trainer.schedule='cosine' needs total_steps={c.total_steps} > "
                  f"trainer.warmup_steps={t.warmup_steps}; lower warmup_steps or use "
                  "trainer.schedule='constant'")
  cache = str(t.get("compilation_cache", "auto"))
  if not cache.strip():
    errors.append("trainer.compilation_cache='' : expected 'auto' (WORKDIR/xla_cache on GPU, off "
                  "on CPU), 'off' or a directory")
  elif cache not in ("auto", "off") and os.path.exists(cache) and not os.path.isdir(cache):
    errors.append(f"trainer.compilation_cache={cache!r} is a file; give a directory (made when "
                  "missing), 'auto' or 'off'")
  if t.max_nonfinite_skips < 1:
    errors.append(f"trainer.max_nonfinite_skips={t.max_nonfinite_skips} must be >= 1 "
                  "(consecutive non-finite updates skipped before the run stops)")
  return errors + batch_reuse_errors(c)


def batch_reuse_errors(c) -> list[str]:
  """trainer.ppo_epochs / ppo_minibatches and buffer.reuse_control="gradient_gate": several
  updates on each fresh batch of the on-policy queue (`data.batch_reuse`)."""
  from jaxreplay.data import batch_reuse  # pylint: disable=g-import-not-at-top
  try:
    plan = batch_reuse.BatchReuse.from_config(c)
  except ValueError as e:
    return [str(e)]
  if not plan.active:
    return []
  errors = []
  what = ("buffer.reuse_control='gradient_gate'" if plan.gate is not None else
          f"trainer.ppo_epochs={plan.epochs} with trainer.ppo_minibatches={plan.minibatches}")
  if not c.buffer.on_policy:
    errors.append(f"{what} reuses each fresh batch of the on-policy queue: set "
                  "buffer.on_policy=True")
  if c.scheduler.kind == "sync":
    errors.append(f"{what} trains several updates on one fresh batch; the sync schedule generates "
                  "scheduler.rollouts_per_step rollouts before every update: use "
                  "scheduler.kind='simulated' or 'async'")
  if plan.gate is not None and c.model.get("lora_rank", 0) > 0:
    errors.append("buffer.reuse_control='gradient_gate' monitors the LM head's gradient, which "
                  "LoRA freezes: use it with model.lora_rank=0")
  return errors


def scheduler_errors(s, c) -> list[str]:
  """scheduler.*: the schedule's kind (`schedule_table.SCHEDULES`) and its simulated costs; R of a
  schedule that generates rollouts_per_step per step (the sync loop)."""
  errors = []
  record = schedule_table.SCHEDULES.get(s.kind)
  if record is None:
    errors.append(choice_error("scheduler.kind", s.kind, tuple(schedule_table.SCHEDULES)))
  if not 0.0 <= s.prefill_fraction < 1.0:
    errors.append(f"scheduler.prefill_fraction={s.prefill_fraction} must be in [0, 1)")
  if s.reference_tokens < 0:
    errors.append(f"scheduler.reference_tokens={s.reference_tokens} must be >= 0 "
                  "(0 = calibrate on the first request)")
  k = s.get("generation_batch", 1)
  if isinstance(k, bool) or not isinstance(k, int) or k < 0:
    errors.append(f"scheduler.generation_batch={k!r} must be an integer >= 0 (requests per sampler "
                  "call; 0 = auto, 1 = one request per call)")
  elif k > 1 and multiturn(c):
    errors.append(f"scheduler.generation_batch={k} generates requests ahead in one sampler call, "
                  "which a multi-turn task (an environment) does not: set "
                  "scheduler.generation_batch=1 (or 0: auto, one for a multi-turn task)")
  elif k != 1 and not multiturn(c):
    placement = c.rollout.get("placement", "local")
    in_process = placement == "local" and all(
        b.on_trainer_devices for b in backend_table.candidates(c.rollout.backend))
    if record is None or not record.batched_generation or not in_process:
      errors.append(f"scheduler.generation_batch={k} batches the requests of a schedule that "
                    "generates in virtual time on the in-process JAX sampler; this run has "
                    f"scheduler.kind={s.kind!r}, rollout.backend={c.rollout.backend!r}, "
                    f"rollout.placement={placement!r}: set scheduler.generation_batch=1")
  if record is not None and record.rollouts_per_step:
    request = c.rollout.prompts_per_request * c.rollout.group_size
    r = s.rollouts_per_step
    if r < request or r % request:
      errors.append(f"scheduler.rollouts_per_step={r} must be a positive multiple of one request "
                    f"(rollout.prompts_per_request * rollout.group_size = {request}); e.g. "
                    f"{max(request, r - r % request)}")
    if c.buffer.on_policy and r > c.buffer.size:
      errors.append(f"scheduler.kind={s.kind!r} with buffer.on_policy: a step's rollouts_per_step={r} "
                    f"must fit the queue (buffer.size={c.buffer.size}); on-policy is N = B = R")
  return errors


def eval_errors(e) -> list[str]:
  """eval.*: where it runs (`backend_table.EVAL_BACKENDS`) and its compute grid (its elements
  >= 0: `key_rules.ELEMENTS`)."""
  errors = []
  if e.passk_grid and not set(e.passk_grid) <= set(e.compute_grid):
    errors.append(f"eval.passk_grid={tuple(e.passk_grid)} must be a subset of "
                  f"eval.compute_grid={tuple(e.compute_grid)}")
  if e.refine_levels and not e.compute_grid:
    errors.append(f"eval.refine_levels={tuple(e.refine_levels)} refines eval.compute_grid, which is "
                  "empty: set eval.compute_grid (device-seconds) or drop eval.refine_levels")
  if e.refine_levels and not all(0 < x <= 1 for x in e.refine_levels):
    errors.append(f"eval.refine_levels={tuple(e.refine_levels)} must be pass@1 values in (0, 1]")
  if not e.refine_band > 0:
    errors.append(f"eval.refine_band={e.refine_band} must be > 0 (pass@1 below a level at which "
                  "refinement starts; e.g. 0.05)")
  if not e.refine_lookahead >= 0:
    errors.append(f"eval.refine_lookahead={e.refine_lookahead} must be >= 0 (the multiple of the "
                  "last pass@1 pace extrapolated over the grid interval ahead; 0 = off, e.g. 4)")
  if e.refine_splits < 2:
    errors.append(f"eval.refine_splits={e.refine_splits} must be >= 2 (the parts of a refined "
                  "grid interval; e.g. 4)")
  if e.backend not in backend_table.EVAL_BACKENDS:
    errors.append(choice_error("eval.backend", e.backend, backend_table.EVAL_BACKENDS,
                               "auto: the rollout engines when rollout.backend='vllm', else the "
                               "trainer"))
  if e.batch_size < 0:
    errors.append(f"eval.batch_size={e.batch_size} must be >= 0 (0 = rollout.sampler_batch_size)")
  ks = [k for k in e.ks if isinstance(k, int)]
  if e.n_samples and ks and (min(ks) < 1 or max(ks) > e.n_samples):
    errors.append(f"eval.ks={tuple(e.ks)} must lie in [1, eval.n_samples={e.n_samples}] (pass@k "
                  f"draws k of the n_samples); e.g. --config.eval.ks="
                  f"{tuple(k for k in (1, 2, 4, 8, 16, 32, 64) if k <= e.n_samples)}")
  if not 0 <= e.pass1_problems <= e.num_problems:
    errors.append(f"eval.pass1_problems={e.pass1_problems} must be in [0, eval.num_problems="
                  f"{e.num_problems}] (0 = all held-out problems at every evaluation)")
  return errors


def devices_errors(d) -> list[str]:
  """devices.*: the GPU split of one node."""
  errors = []
  if not 0.0 < d.memory_fraction <= 1.0:
    errors.append(f"devices.memory_fraction={d.memory_fraction} must be in (0, 1]")
  if d.memory_gib < 0:
    errors.append(f"devices.memory_gib={d.memory_gib} must be >= 0 [GiB] (0 = the GPU's own)")
  for key in ("trainer", "workers"):
    try:
      devices_lib.parse_ids(d[key], f"devices.{key}")
    except ValueError as e:
      errors.append(str(e))
  return errors


def log_errors(c) -> list[str]:
  """log.*: the regime diagnostics and the optional W&B settings."""
  from jaxreplay.infra import metric_writers  # pylint: disable=g-import-not-at-top
  errors, g = [], c.log
  if g.diagnostics_every < 0:
    errors.append(f"log.diagnostics_every={g.diagnostics_every} must be >= 0 (steps; 0 = off)")
  if g.diagnostics_splits < 2:
    errors.append(f"log.diagnostics_splits={g.diagnostics_splits} must be >= 2 (the noise scale "
                  "compares micro-batch and whole-batch gradients)")
  if g.diagnostics_probe < 0:
    errors.append(f"log.diagnostics_probe={g.diagnostics_probe} must be >= 0 (rollouts; 0 = none)")
  if not 0.0 <= g.noise_scale_decay < 1.0:
    errors.append(f"log.noise_scale_decay={g.noise_scale_decay} must be in [0, 1)")
  if g.get("charge_diagnostics", "auto") not in CHARGE_DIAGNOSTICS:
    errors.append(f"log.charge_diagnostics={g.charge_diagnostics!r}: expected one of "
                  f"{CHARGE_DIAGNOSTICS} (auto: charged when buffer.reuse_control reads them)")
  return errors + list(metric_writers.wandb_config_errors(c.log))
