"""Tests of the run's rollout settings (`jaxreplay.rollout.backends`, the rollout checks of
validation): vLLM engine settings per platform, request sizing that fills an engine, worker GPU groups for tensor
parallelism, Ray resources (placement ray). Pure functions of the config: no engine starts."""
import pytest

from jaxreplay.config import validation
from jaxreplay.run import build
from jaxreplay.config import defaults
from jaxreplay.rollout import backends


def config(**rollout):
  c = defaults.base_config()
  c.rollout.backend = "vllm"
  for k, v in rollout.items():
    c.rollout[k] = v
  return c


def test_vllm_settings_cpu_keeps_the_test_setup_and_gpu_runs_as_vllm_is_meant():
  c = config(vllm_kv_cache_gib=2, vllm_max_num_seqs=128)
  cpu = backends.vllm_engine_settings(c, on_cpu=True)
  assert cpu == dict(max_model_len=256, max_num_seqs=128, dtype="float32", enforce_eager=True,
                     disable_torch_compile=True,
                     env={"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                          "VLLM_ENGINE_READY_TIMEOUT_S": "300"})
  c = config(vllm_gpu_memory_utilization=0.35, vllm_tensor_parallel_size=2, vllm_max_model_len=4096)
  gpu = backends.vllm_engine_settings(c, on_cpu=False)
  assert gpu["dtype"] == "bfloat16" and gpu["max_model_len"] == 4096
  assert gpu["enforce_eager"] is False and gpu["disable_torch_compile"] is False  # CUDA graphs
  assert gpu["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"  # vLLM's own engine-core process
  assert gpu["engine_kwargs"] == dict(gpu_memory_utilization=0.35, tensor_parallel_size=2)
  # Explicit choices win over "auto" on either platform.
  c = config(vllm_enforce_eager="true", vllm_engine_process="False")
  gpu = backends.vllm_engine_settings(c, on_cpu=False)
  assert gpu["enforce_eager"] is True and gpu["disable_torch_compile"] is True
  assert gpu["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
  with pytest.raises(ValueError, match="vllm_enforce_eager='sometimes'"):
    backends.vllm_engine_settings(config(vllm_enforce_eager="sometimes"), on_cpu=True)


@pytest.mark.parametrize("backend,rollout,expected", [
    ("vllm", dict(), 256 // (4 * 16)),                              # auto: fill 256 sequences
    ("vllm", dict(buffer_size=84), 1),                              # auto: never more than N
    ("vllm", dict(vllm_max_num_seqs=512, group_size=8, prompts_per_request=1), 64),
    ("vllm", dict(vllm_max_num_seqs=32), 1),                        # one request over-fills: 1
    ("vllm", dict(prompts_in_flight=8), 2),                         # explicit: 8 prompts = 2 requests
    ("jax", dict(), 1),                                             # auto: the JAX sampler as before
    ("jax", dict(prompts_in_flight=12), 3),
])
def test_requests_per_call_fills_the_engine(backend, rollout, expected):
  buffer_size = rollout.pop("buffer_size", 1024)
  c = config(**rollout)
  c.buffer.size = buffer_size
  c.rollout.backend = backend
  assert backends.requests_per_call(c) == expected


def test_worker_gpu_groups_split_by_tensor_parallel_size():
  assert backends.worker_gpu_groups([4, 5, 6, 7], 1) == [("4",), ("5",), ("6",), ("7",)]
  assert backends.worker_gpu_groups(["2", "3", "4", "5", "6", "7"], 2) == [
      ("2", "3"), ("4", "5"), ("6", "7")]
  assert backends.worker_gpu_groups(range(8), 8) == [tuple(str(i) for i in range(8))]
  with pytest.raises(ValueError, match=r"5 worker GPUs .* do not split into engines of "
                                       r"rollout.vllm_tensor_parallel_size=2 .*e.g. 4"):
    backends.worker_gpu_groups([3, 4, 5, 6, 7], 2)
  with pytest.raises(ValueError, match="twice"):
    backends.worker_gpu_groups([1, 1], 1)
  with pytest.raises(ValueError, match="no worker GPUs"):
    backends.worker_gpu_groups([], 1)
  with pytest.raises(ValueError, match="must be >= 1"):
    backends.worker_gpu_groups([0], 0)


@pytest.mark.parametrize("key,value,message", [
    ("prompts_in_flight", 6, r"prompts_in_flight=6 must be 0 \(auto\) or a positive multiple of "
                             r"rollout.prompts_per_request=4 .* e.g. 4"),
    ("prompts_in_flight", -4, "prompts_in_flight=-4"),
    ("vllm_gpu_memory_utilization", 1.5, r"must be in \(0, 1\]"),
    ("vllm_gpu_memory_utilization", 0.0, r"must be in \(0, 1\]"),
    ("vllm_max_num_seqs", 0, "vllm_max_num_seqs=0 must be >= 1"),
    ("vllm_tensor_parallel_size", 0, "vllm_tensor_parallel_size=0 must be >= 1"),
    ("vllm_max_model_len", 128, r"vllm_max_model_len=128 must be 0 \(= model.max_len\) or >= "
                                "model.max_len=256"),
    ("vllm_enforce_eager", "yes", "vllm_enforce_eager='yes': expected 'auto', 'true' or 'false'"),
    ("vllm_engine_process", "no", "vllm_engine_process='no'"),
    ("placement", "cluster", r"rollout.placement='cluster': expected one of \('local', 'ray'\)"),
])
def test_validate_config_names_bad_rollout_keys(key, value, message):
  c = config()
  c.rollout[key] = value
  with pytest.raises(ValueError, match=message):
    validation.validate_config(c)


def test_validate_config_accepts_the_defaults_and_good_vllm_settings():
  """Both configs validate (no ValueError), and the good settings are the engines' settings."""
  validation.validate_config(config())
  c = config(prompts_in_flight=16, vllm_gpu_memory_utilization=0.3, vllm_max_model_len=512,
             vllm_enforce_eager="false", vllm_tensor_parallel_size=2)
  validation.validate_config(c)
  gpu = backends.vllm_engine_settings(c, on_cpu=False)
  assert gpu["max_model_len"] == 512 and gpu["enforce_eager"] is False
  assert gpu["engine_kwargs"] == dict(gpu_memory_utilization=0.3, tensor_parallel_size=2)
  assert backends.requests_per_call(c) == 16 // c.rollout.prompts_per_request


def test_ray_gpus_per_worker_auto_is_the_tensor_parallel_size_of_vllm_on_gpu():
  c = config(vllm_tensor_parallel_size=2)
  assert c.rollout.ray_num_gpus_per_worker == -1 and c.rollout.placement == "local"
  assert backends.ray_gpus_per_worker(c, on_cpu=False) == 2.0
  assert backends.ray_gpus_per_worker(c, on_cpu=True) == 0.0
  c.rollout.backend = "jax"
  assert backends.ray_gpus_per_worker(c, on_cpu=False) == 0.0
  c.rollout.ray_num_gpus_per_worker = 0.5
  assert backends.ray_gpus_per_worker(c, on_cpu=False) == 0.5


def test_vllm_config_files_are_the_config_only_model_dir():
  from jaxreplay.models import presets  # pylint: disable=g-import-not-at-top
  files = backends.vllm_config_files(presets.tiny(), "bfloat16")
  assert sorted(files) == ["config.json", "generation_config.json"]
  assert b"bfloat16" in files["config.json"]
