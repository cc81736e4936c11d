"""The `devices` section: the GPU split between the trainer and the rollout workers, its environment
(CUDA_VISIBLE_DEVICES, JAXREPLAY_WORKER_GPUS), and errors that name the fix."""
import pytest

from jaxreplay.config import devices
from jaxreplay.config.defaults import base_config


def _gpu_config(**kw):
  c = base_config()
  c.rollout.backend = "vllm"
  for k, v in kw.items():
    section, key = k.split("__")
    c[section][key] = v
  return c


def test_gpu_split_defaults_and_explicit():
  c = _gpu_config(trainer__num_devices=3, rollout__num_workers=5)
  gpus = tuple(str(i) for i in range(8))
  s = devices.split_gpus(c, gpus)
  assert s.trainer == ("0", "1", "2") and s.workers == ("3", "4", "5", "6", "7")
  c = _gpu_config(trainer__num_devices=2, rollout__num_workers=3, devices__trainer="6,7",
                  devices__workers="0,1,2")
  s = devices.split_gpus(c, gpus)
  assert s.trainer == ("6", "7") and [s.worker_gpus(i) for i in range(3)] == [("0",), ("1",), ("2",)]
  env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
  devices.apply_to_environment(c, env)
  assert env["CUDA_VISIBLE_DEVICES"] == "6,7" and env["JAXREPLAY_WORKER_GPUS"] == "0,1,2"
  assert devices.apply_to_environment(c, {"CUDA_VISIBLE_DEVICES": ""}) is None  # no GPU: no change


@pytest.mark.parametrize("kw,match", [
    (dict(trainer__num_devices=3, devices__trainer="0,1"), "trainer.num_devices=2"),
    (dict(trainer__num_devices=3, rollout__num_workers=6), "lower rollout.num_workers to 5"),
    (dict(trainer__num_devices=2, devices__trainer="0,1", devices__workers="1,2"), "both"),
    (dict(trainer__num_devices=2, devices__trainer="0,9"), "not visible"),
    (dict(devices__trainer="0;1"), "comma-separated"),
])
def test_gpu_split_errors_name_the_fix(kw, match):
  with pytest.raises(ValueError, match=match):
    devices.split_gpus(_gpu_config(**kw), tuple(str(i) for i in range(8)))
