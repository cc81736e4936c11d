"""The `devices` section: the GPU split between the trainer and the rollout workers, its environment
(CUDA_VISIBLE_DEVICES, JAXREPLAY_WORKER_GPUS), errors that name the fix, and
`check_one_cuda_major` on what the `gpu` extra installs: the committed resolve
(tests/config/fixtures/gpu_extra_resolved.txt) and a live one (`pip install --dry-run --report`)."""
import json
import os
import subprocess
import sys

import pytest

from jaxreplay.config import devices
from jaxreplay.config.defaults import base_config
from tests.helpers.paths import REPO as ROOT


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

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "gpu_extra_resolved.txt")


def _fixture() -> list[tuple[str, str]]:
  with open(FIXTURE) as f:
    return [tuple(line.strip().split("==")) for line in f if line.strip() and line[0] != "#"]


def environment_errors(distributions: list[tuple[str, str]]) -> list[str]:
  """The launch's environment checks on a list of (name, version): one CUDA major among the
  colliding libraries, and the vLLM / JAX versions the code is pinned to."""
  from jaxreplay.rollout.vllm import api_surface  # pylint: disable=g-import-not-at-top
  errors = []
  try:
    devices.check_one_cuda_major(distributions, environ={})
  except RuntimeError as e:
    errors.append(str(e))
  versions = {name.lower().replace("_", "-"): version for name, version in distributions}
  if versions.get("vllm") != api_surface.SUPPORTED_VLLM:
    errors.append(f"vllm {versions.get('vllm')} but the engines' surface is checked against "
                  f"{api_surface.SUPPORTED_VLLM}")
  jax_versions = {versions.get(k) for k in ("jax", "jaxlib", "jax-cuda13-plugin",
                                             "jax-cuda13-pjrt")}
  if len(jax_versions) != 1:
    errors.append(f"jax, jaxlib and the CUDA plugin differ: {sorted(map(str, jax_versions))}")
  return errors


def test_the_resolved_gpu_extra_is_one_cuda_major():
  resolved = _fixture()
  names = {n for n, _ in resolved}
  assert {"vllm", "torch", "jax-cuda13-plugin", "nvidia-cudnn-cu13"} <= names
  assert "nvidia-cutlass-dsl-libs-cu12" in names  # vLLM's kernel DSL: a -cu12 name, no collision
  majors = devices.cuda_majors(resolved)
  assert set(majors) == {13}, majors
  assert "nvidia-cutlass-dsl-libs-cu12==4.8.0" not in majors[13]
  assert {"nvidia-cudnn-cu13==9.28.1.4", "nvidia-nccl-cu13==2.32.6",
          "nvidia-cublas==13.10.0.20", "jax-cuda13-plugin==0.10.2"} <= set(majors[13])
  assert environment_errors(resolved) == []


def test_each_colliding_family_counts_and_others_do_not():
  for family, pattern, source in devices.LIBRARY_PACKAGES:
    name = pattern.replace(r"(?:-cu(\d+))?", "-cu12").replace(r"(\d+)", "12").replace(
        "(?:plugin|pjrt)", "plugin")
    assert devices.library_major(name, "1.0") == (family, 12), (family, name)
  assert devices.library_major("nvidia-cublas", "13.10.0.20") == ("cuBLAS", 13)
  assert devices.library_major("nvidia_cudnn_cu13", "9.28.1.4") == ("cuDNN", 13)
  for other in ("nvidia-cutlass-dsl-libs-cu12", "nvidia-cusparse", "nvidia-cufft",
                "nvidia-ml-py", "torch", "cuda-bindings", "nvidia-cudnn-frontend"):
    assert devices.library_major(other, "12.9.4.2") is None, other
  mixed = _fixture() + [("nvidia-cudnn-cu12", "9.10.2.21")]
  with pytest.raises(RuntimeError, match=r"CUDA majors \[12, 13\].*nvidia-cudnn-cu12"):
    devices.check_one_cuda_major(mixed, environ={})


def _index_error(stderr: str) -> bool:
  return any(s in stderr for s in ("Could not find a version", "No matching distribution",
                                   "Failed to establish a new connection", "Network is unreachable",
                                   "Temporary failure in name resolution", "ConnectionError"))


@pytest.mark.slow
def test_gpu_extra_resolved_live_passes_the_launch_checks(tmp_path):
  """Resolves `.[gpu]` against the package index now (pip --dry-run --report: nothing installed)
  and runs the environment checks on it: a pin that resolves to an environment the launcher
  would refuse fails here. Without an index it skips, except under CI=true."""
  report = tmp_path / "report.json"
  out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
                        "--quiet", "--report", str(report), ".[gpu]"], cwd=ROOT,
                       capture_output=True, text=True, timeout=3000)
  if out.returncode != 0:
    if _index_error(out.stderr) and os.environ.get("CI", "").lower() != "true":
      pytest.skip(f"no package index: {out.stderr.strip().splitlines()[-1]}")
    pytest.fail(f"pip could not resolve .[gpu]:\n{out.stderr[-3000:]}")
  resolved = [(i["metadata"]["name"], i["metadata"]["version"])
              for i in json.loads(report.read_text())["install"]]
  assert environment_errors(resolved) == []
  assert set(devices.cuda_majors(resolved)) == {13}
