"""The single-key rules: counts, tuple elements, keys another key switches off."""
from jaxreplay.config import defaults
from jaxreplay.config import key_rules


def test_defaults_pass_every_rule():
  c = defaults.base_config()
  assert key_rules.count_errors(c) == []
  assert key_rules.element_errors(c) == []
  assert key_rules.no_effect_errors(c) == []
  for key in [*key_rules.AT_LEAST, *key_rules.POSITIVE, *key_rules.ELEMENTS, *key_rules.NO_EFFECT]:
    key_rules.get(c, key)  # every rule names a real key


def test_counts_and_positives():
  c = defaults.base_config()
  c.buffer.batch_size = 0
  c.rollout.prompts_per_request = 0
  c.scheduler.mu = 0.0
  c.total_steps = 0
  errors = key_rules.count_errors(c)
  assert errors == [
      "total_steps=0 must be an integer >= 1 (gradient steps); set --config.total_steps=100",
      "rollout.prompts_per_request=0 must be an integer >= 1 (prompts per request); set "
      "--config.rollout.prompts_per_request=4",
      "buffer.batch_size=0 must be an integer >= 1 (rollouts per gradient step); set "
      "--config.buffer.batch_size=60",
      "scheduler.mu=0.0 must be > 0 (generation / training cost per update); e.g. "
      "--config.scheduler.mu=6.84"]


def test_tuple_elements():
  c = defaults.base_config()
  c.trainer.buckets = ("abc",)
  c.eval.ks = (1, 0)
  c.eval.compute_grid = (1.0, "x")
  errors = key_rules.element_errors(c)
  assert len(errors) == 3
  c.eval.compute_grid = (-1.0, 5.0)
  assert key_rules.element_errors(c)[2].startswith(
      "eval.compute_grid=(-1.0, 5.0): expected a tuple of numbers >= 0.0 (bad: -1.0)")
  assert errors[0].startswith("trainer.buckets=('abc',): expected a tuple of integers >= 1 (bad: "
                              "'abc')")
  assert "eval.ks=(1, 0): expected a tuple of integers >= 1 (bad: 0)" in errors[1]
  assert "eval.compute_grid=(1.0, 'x'): expected a tuple of numbers >= 0.0" in errors[2]


def test_keys_without_effect():
  c = defaults.base_config()
  c.model.lora_targets = ("q_proj",)
  c.buffer.fresh_tau = 2.0
  c.rollout.ray_num_cpus_per_worker = 2.0
  c.trainer.tau = -0.5  # an AsymRE option with GRPO: the algorithm table's rule, not reported here
  errors = key_rules.no_effect_errors(c)
  assert errors[0] == ("model.lora_targets=('q_proj',) has no effect: model.lora_rank=0 (LoRA "
                       "off: every weight is trained); set model.lora_rank > 0 (e.g. 16) to train "
                       "adapters, or leave it at its default")
  assert errors[1].startswith("buffer.fresh_tau=2.0 has no effect: buffer.priority is not 'fresh'")
  assert errors[2].startswith("rollout.ray_num_cpus_per_worker=2.0 has no effect")
  assert len(errors) == 3  # trainer.tau once, by validation.trainer_errors (tests/test_launch.py)
  c.model.lora_rank, c.buffer.priority, c.rollout.placement, c.trainer.loss = 8, "fresh", "ray", \
      "asymre"
  assert key_rules.no_effect_errors(c) == []
