"""Tests of `config.resolve`: the "auto" choices made once, the result frozen in every section,
the caller's config untouched, a resolved config kept as it is."""
import json

import pytest

from jaxreplay.config import defaults
from jaxreplay.config import resolve
from jaxreplay.rollout import backend_table


def test_auto_choices_are_made_and_the_caller_config_is_untouched():
  c = defaults.base_config()
  c.rollout.backend, c.eval.backend = "auto", "auto"
  r = resolve.resolve(c)
  expect = backend_table.resolve("auto")
  assert r.rollout.backend == expect
  assert r.eval.backend == backend_table.resolve_eval("auto", expect)
  assert (c.rollout.backend, c.eval.backend) == ("auto", "auto")
  assert resolve.is_resolved(r) and not resolve.is_resolved(c)
  assert resolve.resolve(r) is r
  # explicit choices stay; the rest of the config is the same values (run_config.json's JSON)
  c.rollout.backend, c.eval.backend = "jax", "engines"
  r = resolve.resolve(c)
  assert (r.rollout.backend, r.eval.backend) == ("jax", "engines")
  assert json.dumps(r.to_dict(), default=str) == json.dumps(c.to_dict(), default=str)


@pytest.mark.parametrize("section", sorted(defaults.base_config().keys()))
def test_the_resolved_config_is_frozen_in_every_section(section):
  r = resolve.resolve(defaults.base_config())
  value = r[section]
  if hasattr(value, "keys"):  # a section: none of its keys can be set, nor a new one added
    key = sorted(value.keys())[0]
    with pytest.raises(AttributeError, match="immutable"):
      setattr(value, key, value[key])
    with pytest.raises(AttributeError, match="immutable"):
      setattr(value, "new_key", 1)
  else:
    with pytest.raises(AttributeError, match="immutable"):
      setattr(r, section, value)
