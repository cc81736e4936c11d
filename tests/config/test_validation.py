"""`config.validation`: bad values are refused with one line that names the key and the fix."""
import re

import pytest

from jaxreplay.config import validation
from jaxreplay.config.defaults import base_config


def _errors(**scheduler_and_rollout):
  c = base_config()
  c.rollout.backend = "jax"
  for key, value in scheduler_and_rollout.items():
    section, name = key.split("__")
    setattr(c[section], name, value)
  with pytest.raises(ValueError) as e:
    validation.validate_config(c)
  return str(e.value).splitlines()[1:]


@pytest.mark.parametrize("k", [1, 0, 4, 64])
def test_generation_batch_accepts_auto_one_and_more(k):
  c = base_config()
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
    ({"scheduler__generation_batch": 2, "rollout__placement": "ray"}, "rollout.placement='ray'"),
])
def test_generation_batch_rejects_bad_values_in_one_line(overrides, match):
  errors = [e for e in _errors(**overrides) if "generation_batch" in e]
  assert len(errors) == 1, errors
  assert re.search(match, errors[0]), errors[0]
