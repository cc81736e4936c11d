"""Tests of `config.validation`: one test per section function. Each bad value gives an error that
names the key and its value, and the valid values (for a key with a set of values, read from the
table that holds them: the backend, sampler, algorithm, correction and schedule tables) or the
allowed range; `validate_config` reports it too and accepts the defaults."""
import os
import re

import pytest

from jaxreplay.config import command_line
from jaxreplay.config import defaults
from jaxreplay.config import schedule_table
from jaxreplay.config import validation
from jaxreplay.data import reuse
from jaxreplay.data import samplers
from jaxreplay.infra import metric_writers
from jaxreplay.learner import algorithms
from jaxreplay.learner import corrections
from jaxreplay.learner import optim
from jaxreplay.learner import trainer
from jaxreplay.models import logprobs
from jaxreplay.rollout import backend_table
from jaxreplay.tasks import tokenizer
from tests.helpers.paths import REPO


def config(**keys):
  """The defaults with `section__key=value` overrides (`key=value` for top-level keys)."""
  c = defaults.base_config()
  for name, value in keys.items():
    section, _, key = name.rpartition("__")
    (c[section] if section else c)[key] = value
  return c


# The section functions as `validate_config` calls them.
SECTIONS = {
    "run_errors": lambda c: validation.run_errors(c),
    "model_errors": lambda c: validation.model_errors(c.model, c.rollout),
    "lora_errors": lambda c: validation.lora_errors(c.model, c.rollout),
    "task_errors": lambda c: validation.task_errors(c.task),
    "env_errors": lambda c: validation.env_errors(c.task),
    "rollout_errors": lambda c: validation.rollout_errors(c.rollout, c.model.max_len),
    "ray_errors": lambda c: validation.ray_errors(c.rollout),
    "partial_errors": lambda c: validation.partial_errors(c),
    "buffer_errors": lambda c: validation.buffer_errors(c.buffer, c.rollout, c.log),
    "trainer_errors": lambda c: validation.trainer_errors(c.trainer, c),
    "batch_reuse_errors": lambda c: validation.batch_reuse_errors(c),
    "scheduler_errors": lambda c: validation.scheduler_errors(c.scheduler, c),
    "eval_errors": lambda c: validation.eval_errors(c.eval),
    "devices_errors": lambda c: validation.devices_errors(c.devices),
    "log_errors": lambda c: validation.log_errors(c),
}


def check(section: str, cases) -> None:
  """Each (overrides, expected texts): the section reports exactly one error holding every text
  (the key=value, the valid values); `validate_config` raises with it; the defaults pass."""
  assert SECTIONS[section](config()) == []
  for overrides, texts in cases:
    errors = SECTIONS[section](config(**overrides))
    assert len(errors) == 1, (overrides, errors)
    for text in texts:
      assert text in errors[0], (overrides, text, errors[0])
    with pytest.raises(ValueError, match=re.escape(errors[0])):
      validation.validate_config(config(**overrides))


def test_defaults_are_valid():
  validation.validate_config(defaults.base_config())


def test_run_errors():
  check("run_errors", [
      (dict(compute_budget=-1.0), ["compute_budget=-1.0", ">= 0"]),
      (dict(compute_budget=10.0, trainer__schedule="cosine"),
       ["compute_budget", "trainer.schedule='cosine'", "trainer.schedule='constant'"]),
      (dict(export_hf_every=-2), ["export_hf_every=-2", ">= 0"]),
  ])


def test_model_errors(tmp_path):
  check("model_errors", [
      (dict(model__path=str(tmp_path / "absent")), [f"model.path={str(tmp_path / 'absent')!r}",
                                                    "not a directory"]),
      (dict(model__chat_template="sometimes"),
       ["model.chat_template='sometimes'", str(tokenizer.CHAT_TEMPLATE_MODES)]),
      (dict(model__chat_template_kwargs="{nope"), ["model.chat_template_kwargs='{nope'",
                                                   "not valid JSON"]),
      (dict(model__chat_template_kwargs="[1]"), ["model.chat_template_kwargs='[1]'",
                                                 "JSON object"]),
  ])


def test_lora_errors():
  ranks = backend_table.load(backend_table.BACKENDS["vllm"].lora_ranks)
  check("lora_errors", [
      (dict(model__lora_rank=ranks[-1] * 2, rollout__backend="vllm"),
       [f"model.lora_rank={ranks[-1] * 2}", f"up to {ranks[-1]}", "rollout.backend='jax'"]),
      (dict(model__lora_rank=ranks[-1] * 2, rollout__backend="auto"),  # auto may pick vLLM
       [f"model.lora_rank={ranks[-1] * 2}", f"up to {ranks[-1]}"]),
      (dict(model__lora_rank=8, rollout__placement="ray"),
       ["model.lora_rank=8 with rollout.placement='ray'", "rollout.placement='local'"]),
  ])
  assert validation.lora_errors(config(model__lora_rank=ranks[-1] * 2).model,
                                config(rollout__backend="jax").rollout) == []


def test_task_errors():
  check("task_errors", [
      (dict(task__name="chess"), ["task.name='chess'", str(validation.TASKS)]),
      (dict(task__max_skip_fraction=1.5), ["task.max_skip_fraction=1.5", "[0, 1]"]),
      (dict(task__reward_memory_gib=0.0), ["task.reward_memory_gib=0.0", "> 0"]),
      (dict(task__name="math"), ["task.name='math' needs task.path"]),
      (dict(task__reward_fn="a:b"), ["task.reward_fn='a:b'", "task.name='math'"]),
      (dict(task__num_reward_workers=0), ["task.num_reward_workers=0", ">= 1"]),
      (dict(task__digit_decay=0.0), ["task.digit_decay=0.0", "> 0"]),
      (dict(task__digit_decay=0.5, task__name="math",
            task__path=os.path.join(REPO, "assets", "math_example.jsonl")),
       ["task.digit_decay=0.5", "procedural"]),
  ])


def test_rollout_errors():
  vllm = backend_table.BACKENDS["vllm"]
  check("rollout_errors", [
      (dict(rollout__backend="sglang"), ["rollout.backend='sglang'", str(backend_table.names())]),
      (dict(rollout__vllm_dtype="int4"), ["rollout.vllm_dtype='int4'", str(vllm.dtypes)]),
      (dict(rollout__weight_transport="nfs"), ["rollout.weight_transport='nfs'",
                                               str(backend_table.weight_transports())]),
      (dict(rollout__max_tokens=256), ["rollout.max_tokens=256", "model.max_len=256"]),
      (dict(rollout__refresh_every=0), ["rollout.refresh_every=0", ">= 1"]),
      (dict(rollout__keep_versions=1), ["rollout.keep_versions=1", ">= 2"]),
      (dict(rollout__vllm_enforce_eager="yes"), ["rollout.vllm_enforce_eager='yes'",
                                                 "'auto', 'true' or 'false'"]),
      (dict(rollout__vllm_startup_timeout_s=-1.0), ["rollout.vllm_startup_timeout_s=-1.0", ">= 0"]),
  ])
  assert backend_table.names() == ("jax", "vllm", "auto")


def test_env_errors():
  check("env_errors", [
      (dict(task__env_fn="my_envs"), ["task.env_fn='my_envs'", "'module:factory'"]),
      (dict(task__env_fn="my_envs:"), ["task.env_fn='my_envs:'", "'module:factory'"]),
      (dict(task__env_fn="my_envs:make", task__name="calculator"),
       ["task.name='calculator' has its own environment", "unset task.env_fn"]),
      (dict(task__env_max_turns=0), ["task.env_max_turns=0", ">= 1"]),
      (dict(task__env_max_tokens=-1), ["task.env_max_tokens=-1", ">= 0"]),
      (dict(task__env_step_timeout_s=0.0), ["task.env_step_timeout_s=0.0", "> 0"]),
  ])
  assert validation.multiturn(config(task__name="calculator"))
  assert validation.multiturn(config(task__env_fn="tests.helpers.env_plugins:countdown"))
  assert not validation.multiturn(config(task__name="scratchpad"))


def test_partial_errors(monkeypatch):
  on_async = dict(scheduler__kind="async", rollout__partial="continue")
  check("partial_errors", [
      (dict(rollout__partial="resume"), ["rollout.partial='resume'",
                                         str(validation.PARTIAL_MODES)]),
      (dict(rollout__partial_chunk_tokens=0), ["rollout.partial_chunk_tokens=0", ">= 1"]),
      (dict(rollout__partial="continue"), ["scheduler.kind='simulated'",
                                           "--config.scheduler.kind=async",
                                           "--config.rollout.partial=off"]),
      (dict(rollout__partial="continue", scheduler__kind="sync"), ["scheduler.kind='sync'"]),
      (dict(rollout__placement="ray", **on_async), ["rollout.placement='ray'",
                                                    "--config.rollout.placement=local"]),
      (dict(task__name="calculator", **on_async), ["task.name='calculator' is multi-turn",
                                                   "--config.rollout.partial=off"]),
  ])
  assert validation.partial_errors(config(**on_async)) == []
  assert validation.partial_errors(config(rollout__backend="auto", **on_async)) == []
  assert [k for k, r in schedule_table.SCHEDULES.items() if r.partial_rollouts] == ["async"]
  # A backend whose workers do not continue a request from its prefix (the toy one): named.
  from tests.helpers import toy_entries  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(backend_table.BACKENDS, "toy", toy_entries.TOY_BACKEND)
  (error,) = validation.partial_errors(config(rollout__backend="toy", **on_async))
  assert "rollout.backend='toy'" in error and "('jax', 'vllm')" in error
  assert "--config.rollout.partial=off" in error


def test_ray_errors():
  check("ray_errors", [
      (dict(rollout__placement="cluster"), ["rollout.placement='cluster'",
                                            str(backend_table.placements())]),
  ])
  assert backend_table.placements() == ("local", "ray")


def test_buffer_errors():
  check("buffer_errors", [
      (dict(buffer__priority="lru"), ["buffer.priority='lru'", str(tuple(samplers.SAMPLERS))]),
      (dict(buffer__on_policy=True, buffer__on_policy_order="random"),
       ["buffer.on_policy_order='random'", str(tuple(samplers.QUEUES))]),
      (dict(buffer__reuse_control="sometimes"), ["buffer.reuse_control='sometimes'",
                                                 str(reuse.REUSE_CONTROLS)]),
      (dict(buffer__batch_size=512, buffer__size=256), ["buffer.batch_size (B=512)",
                                                        "N >= B"]),
      (dict(buffer__fresh_tau=0.0), ["buffer.fresh_tau=0.0", "> 0"]),
      (dict(buffer__max_uses=-1), ["buffer.max_uses=-1", ">= 0"]),
      (dict(buffer__max_staleness=-2), ["buffer.max_staleness=-2", ">= 0"]),
      (dict(buffer__on_policy=True, buffer__priority="fresh"),
       ["buffer.on_policy=True", "'uniform', 0, False"]),
      (dict(buffer__priority="fresh", buffer__fresh_base="rank"),
       ["buffer.fresh_base='rank'", str(tuple(samplers.FRESH_BASES))]),
      (dict(buffer__fresh_alpha=0.6), ["fresh_alpha=0.6", "priority 'fresh' only"]),
      (dict(buffer__on_policy=True, buffer__reuse_control="adaptive"),
       ["buffer.reuse_control='adaptive' paces a replay buffer"]),
      (dict(buffer__reuse_control="gradient_gate"),
       ["buffer.reuse_control='gradient_gate'", "buffer.on_policy=True"]),
      (dict(buffer__on_policy=True, buffer__reuse_control="gradient_gate",
            buffer__gate_window=1), ["buffer.gate_window=1", ">= 2"]),
  ])


def test_batch_reuse_errors():
  check("batch_reuse_errors", [
      (dict(trainer__ppo_epochs=0), ["trainer.ppo_epochs=0", ">= 1"]),
      (dict(trainer__ppo_epochs=2), ["trainer.ppo_epochs=2", "set buffer.on_policy=True"]),
      (dict(buffer__on_policy=True, trainer__ppo_minibatches=7),
       ["trainer.ppo_minibatches=7", "divide buffer.batch_size=60"]),
      (dict(buffer__on_policy=True, trainer__ppo_epochs=2, scheduler__kind="sync"),
       ["sync schedule", "'simulated' or 'async'"]),
      (dict(buffer__on_policy=True, buffer__reuse_control="gradient_gate",
            trainer__ppo_minibatches=2), ["leave trainer.ppo_epochs"]),
      (dict(buffer__on_policy=True, buffer__reuse_control="gradient_gate", model__lora_rank=8),
       ["gradient_gate", "model.lora_rank=0"]),
  ])


def test_trainer_errors():
  check("trainer_errors", [
      (dict(trainer__loss="ppo"), ["trainer.loss='ppo'", str(tuple(algorithms.ALGORITHMS))]),
      (dict(trainer__off_policy="vtrace"), ["trainer.off_policy='vtrace'",
                                            str(tuple(corrections.CORRECTIONS))]),
      (dict(trainer__schedule="linear"), ["trainer.schedule='linear'", str(optim.SCHEDULES)]),
      (dict(trainer__logprob_remat="sometimes"), ["trainer.logprob_remat='sometimes'",
                                                  str(logprobs.REMAT_MODES)]),
      (dict(trainer__sampling_logprobs="cooked"), ["trainer.sampling_logprobs='cooked'",
                                                   str(trainer.SAMPLING_LOGPROBS)]),
      (dict(trainer__nonfinite_check="never"), ["trainer.nonfinite_check='never'",
                                                str(trainer.NONFINITE_CHECKS)]),
      (dict(trainer__compilation_cache=" "), ["trainer.compilation_cache", "'auto'", "'off'"]),
      (dict(trainer__max_nonfinite_skips=0), ["trainer.max_nonfinite_skips=0", ">= 1"]),
  ])


def test_scheduler_errors():
  check("scheduler_errors", [
      (dict(scheduler__kind="round_robin"), ["scheduler.kind='round_robin'",
                                             str(tuple(schedule_table.SCHEDULES))]),
      (dict(scheduler__prefill_fraction=1.0), ["scheduler.prefill_fraction=1.0", "[0, 1)"]),
      (dict(scheduler__reference_tokens=-1), ["scheduler.reference_tokens=-1", ">= 0"]),
      # a schedule whose record generates rollouts_per_step per step (sync): whole requests
      (dict(scheduler__kind="sync", scheduler__rollouts_per_step=100),
       ["scheduler.rollouts_per_step=100", "positive multiple of one request", "e.g. 64"]),
  ])
  assert [k for k, r in schedule_table.SCHEDULES.items() if r.rollouts_per_step] == ["sync"]


def test_eval_errors():
  check("eval_errors", [
      (dict(eval__backend="gpu"), ["eval.backend='gpu'", str(backend_table.EVAL_BACKENDS)]),
      (dict(eval__compute_grid=(1.0, 2.0), eval__passk_grid=(3.0,)),
       ["eval.passk_grid=(3.0,)", "subset of eval.compute_grid=(1.0, 2.0)"]),
      (dict(eval__batch_size=-1), ["eval.batch_size=-1", ">= 0"]),
      (dict(eval__pass1_problems=10 ** 6), [f"eval.pass1_problems={10 ** 6}", "[0, eval.num_problems="]),
      (dict(eval__refine_levels=(0.5,)), ["eval.refine_levels=(0.5,)", "eval.compute_grid, which is empty"]),
      (dict(eval__compute_grid=(1.0,), eval__refine_levels=(1.5,)), ["eval.refine_levels=(1.5,)", "(0, 1]"]),
      (dict(eval__refine_band=0.0), ["eval.refine_band=0.0", "> 0"]),
      (dict(eval__refine_splits=1), ["eval.refine_splits=1", ">= 2"]),
      (dict(eval__refine_lookahead=-1.0), ["eval.refine_lookahead=-1.0", ">= 0"]),
  ])


def test_devices_errors():
  check("devices_errors", [
      (dict(devices__memory_fraction=0.0), ["devices.memory_fraction=0.0", "(0, 1]"]),
      (dict(devices__memory_gib=-1.0), ["devices.memory_gib=-1.0", ">= 0"]),
      (dict(devices__trainer="0;1"), ["devices.trainer='0;1'", "comma-separated"]),
  ])


def test_log_errors():
  check("log_errors", [
      (dict(log__diagnostics_every=-1), ["log.diagnostics_every=-1", ">= 0"]),
      (dict(log__diagnostics_splits=1), ["log.diagnostics_splits=1", ">= 2"]),
      (dict(log__diagnostics_probe=-1), ["log.diagnostics_probe=-1", ">= 0"]),
      (dict(log__noise_scale_decay=1.0), ["log.noise_scale_decay=1.0", "[0, 1)"]),
      (dict(log__charge_diagnostics="maybe"), ["log.charge_diagnostics='maybe'",
                                               str(validation.CHARGE_DIAGNOSTICS)]),
      (dict(log__wandb_project="p", log__wandb_mode="cloud"),
       ["log.wandb_mode='cloud'", str(metric_writers.WANDB_MODES)]),
  ])


def test_every_section_function_has_its_test():
  """`validate_config` is the sum of the section functions tested here (a new section gets one)."""
  section_fns = {name for name in dir(validation)
                 if name.endswith("_errors") and callable(getattr(validation, name))}
  assert section_fns == set(SECTIONS)
  tested = {name[len("test_"):] for name in globals() if name.startswith("test_")}
  assert set(SECTIONS) <= tested


def _errors(**scheduler_and_rollout):
  c = defaults.base_config()
  c.rollout.backend = "jax"
  for key, value in scheduler_and_rollout.items():
    section, name = key.split("__")
    setattr(c[section], name, value)
  with pytest.raises(ValueError) as e:
    validation.validate_config(c)
  return str(e.value).splitlines()[1:]


@pytest.mark.parametrize("k", [1, 0, 4, 64])
def test_generation_batch_accepts_auto_one_and_more(k):
  c = defaults.base_config()
  c.rollout.backend = "jax"
  c.scheduler.generation_batch = k
  validation.validate_config(c)


@pytest.mark.parametrize("overrides,match", [
    ({"scheduler__generation_batch": -1}, "scheduler.generation_batch=-1 must be an integer >= 0"),
    ({"scheduler__generation_batch": True}, "scheduler.generation_batch=True must be an integer"),
    ({"scheduler__generation_batch": 4, "scheduler__kind": "async"},
     "scheduler.generation_batch=4 batches .* scheduler.kind='async'.*: set "
     "scheduler.generation_batch=1"),
    ({"scheduler__generation_batch": 0, "scheduler__kind": "sync"}, "scheduler.kind='sync'"),
    ({"scheduler__generation_batch": 2, "rollout__backend": "vllm"}, "rollout.backend='vllm'"),
    ({"scheduler__generation_batch": 2, "task__name": "calculator"},
     "a multi-turn task .* set scheduler.generation_batch=1"),
    ({"scheduler__generation_batch": 2, "rollout__backend": "auto"}, "rollout.backend='auto'"),
    ({"scheduler__generation_batch": 2, "rollout__placement": "ray"}, "rollout.placement='ray'"),
])
def test_generation_batch_rejects_bad_values_in_one_line(overrides, match):
  errors = [e for e in _errors(**overrides) if "generation_batch" in e]
  assert len(errors) == 1, errors
  assert re.search(match, errors[0]), errors[0]


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(os.path.join(REPO, "configs"))
                                        if n.endswith(".py")))
def test_every_shipped_config_validates(name):
  """Each configs/*.py passes validation as shipped (a GPU config with the docs' example dataset as
  its task.path, the one key its docstring asks for): a config that cannot run is caught here, not
  by its first user (configs/scratchpad_longtail.py asked for pass@16 of 4 samples)."""
  config = command_line.load(os.path.join(REPO, "configs", name))
  if config.task.name == "math" and not config.task.path:
    with config.unlocked():
      config.task.path = os.path.join(REPO, "assets", "math_example.jsonl")
  validation.validate_config(config)
