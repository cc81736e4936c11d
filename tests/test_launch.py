"""`python -m jaxreplay.launch` as a user meets it: bad input as one line before any side effect,
--help, --print_config, the console of a run, Ctrl-C during start-up."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import tiny_runs
from tests.helpers.paths import REPO

TINY = "--config=configs/tiny.py"
ABSL_PREFIX = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]")

# (arguments after the config and workdir, a piece of the one line, extra environment). Each is a
# mistake a user makes; the line must name it and its fix.
BAD_INPUTS = [
    (["--config.trainer.learnin_rate=1e-3"], "did you mean --config.trainer.learning_rate?", {}),
    (["--config.trainr.learning_rate=3"], "did you mean --config.trainer.learning_rate?", {}),
    (["--config.buffer.learning_rate=3"],
     "did you mean --config.sft.learning_rate or --config.trainer.learning_rate?", {}),
    (["--config.buffer.batch_size=foo"], "--config.buffer.batch_size=foo: expected an integer", {}),
    (["--config.model.remat=maybe"], "--config.model.remat=maybe: expected true or false", {}),
    (["--config.trainer=3"], "--config.trainer is a section, not a key", {}),
    (["--workdri=/tmp/x"], "--workdri: no such flag; did you mean --workdir?", {}),
    (["--config.trainer.off_policy=foo"], "trainer.off_policy='foo': expected one of ('none'", {}),
    (["--config.trainer.off_policy=mis_tokn"], "did you mean 'mis_token'?", {}),
    (["--config.model.lora_targets=nonsense"],
     "model.lora_targets=('nonsense',) has no effect: model.lora_rank=0", {}),
    (["--config.model.lora_rank=8", "--config.model.lora_targets=nonsense"],
     "model.lora_targets=('nonsense',): unknown ['nonsense']", {}),
    (["--config.buffer.fresh_tau=2"], "buffer.fresh_tau=2.0 has no effect: buffer.priority", {}),
    (["--config.trainer.tau=-0.5"], "trainer.tau=-0.5 is an option of loss 'asymre', not of "
     "'grpo'; set trainer.tau=-0.1 (or trainer.loss='asymre')", {}),
    (["--config.buffer.batch_size=0"], "buffer.batch_size=0 must be an integer >= 1", {}),
    (["--config.rollout.prompts_per_request=0"], "rollout.prompts_per_request=0 must be", {}),
    (["--config.buffer.batch_size=512"], "buffer.batch_size (B=512) > buffer.size (N=256)", {}),
    (["--config.trainer.buckets=abc"], "trainer.buckets=('abc',): expected a tuple of integers", {}),
    (["--config.eval.ks=(1,32)"], "eval.ks=(1, 32) must lie in [1, eval.n_samples=16]", {}),
    (["--config.total_steps=3"], "needs total_steps=3 > trainer.warmup_steps=5", {}),
    (["--config.task.name=math", "--config.task.path=/nonexistent.jsonl"],
     "task.path='/nonexistent.jsonl' does not exist", {}),
    (["--dry_run", "--config.task.name=math", "--config.task.path=/nonexistent.jsonl"],
     "task.path='/nonexistent.jsonl' does not exist", {}),
    (["--config.model.path=/nonexistent"], "model.path='/nonexistent' is not a directory", {}),
    (["--config.trainer.mesh_shape=(2,-1,1)"],
     "XLA_FLAGS=--xla_force_host_platform_device_count=2", {}),
    (["--config.buffer.batch_size=60"], "buffer.batch_size=60 must be a multiple of "
     "data*fsdp*num_microbatches = 8*1", {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}),
    (["stray"], "unexpected arguments ['stray']", {}),
]


def _launch(args, cwd=REPO, env_extra=None, timeout=300):
  env = dict(tiny_runs.ENV, **(env_extra or {}))
  return subprocess.run([sys.executable, "-m", "jaxreplay.launch", *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=timeout)


def _one_error_line(proc) -> str:
  lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
  assert len(lines) == 1, proc.stdout + proc.stderr
  assert lines[0].startswith("error: ") and "Traceback" not in lines[0], lines[0]
  assert proc.returncode == 2, (proc.returncode, lines[0])
  return lines[0]


@pytest.mark.parametrize("args,expected,env", BAD_INPUTS,
                         ids=[" ".join(a)[:60] for a, _, _ in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_and_creates_nothing(tmp_path, args, expected, env):
  workdir = tmp_path / "run"
  proc = _launch([TINY, f"--workdir={workdir}", *args], env_extra=env)
  line = _one_error_line(proc)
  assert expected in line, line
  assert os.listdir(tmp_path) == []  # no workdir, no lock, nothing


def test_command_line_mistakes_without_a_config(tmp_path):
  line = _one_error_line(_launch(["--config=configs/tiyn.py", f"--workdir={tmp_path}/run"]))
  assert line == ("error: --config=configs/tiyn.py does not exist; did you mean "
                  "--config=configs/tiny.py?")
  line = _one_error_line(_launch([f"--workdir={tmp_path}/run"]))
  assert "--config is missing; give a config file, e.g. --config=configs/tiny.py" in line
  line = _one_error_line(_launch([TINY]))
  assert "--workdir is missing; give the run directory" in line
  bad_file = tmp_path / "bad.py"
  bad_file.write_text("def get_config():\n  raise RuntimeError('oops')\n")
  line = _one_error_line(_launch([f"--config={bad_file}", f"--workdir={tmp_path}/run"]))
  assert "loading it failed (RuntimeError: oops)" in line
  assert sorted(os.listdir(tmp_path)) == ["bad.py"]


def test_a_workdir_that_is_a_file(tmp_path):
  path = tmp_path / "taken"
  path.write_text("not a run")
  line = _one_error_line(_launch([TINY, f"--workdir={path}"]))
  assert f"--workdir={path} is a file, not a directory; choose another --workdir" in line
  line = _one_error_line(_launch([TINY, f"--workdir={path}/run"]))
  assert f"lies under {path}, which is a file" in line
  assert sorted(os.listdir(tmp_path)) == ["taken"] and path.read_text() == "not a run"


def test_debug_shows_the_traceback(tmp_path):
  proc = _launch([TINY, f"--workdir={tmp_path}/run", "--config.buffer.batch_size=0", "--debug"])
  assert proc.returncode != 0 and "Traceback" in proc.stderr
  assert "buffer.batch_size=0 must be an integer >= 1" in proc.stderr


def test_help_exits_0_and_says_where_the_keys_are():
  proc = _launch(["--help"])
  assert proc.returncode == 0, proc.stderr
  for text in ("--config:", "--workdir:", "--dry_run:", "--print_config:", "--debug:",
               "--config.<key>=<value>", "docs/reference/configuration.md"):
    assert text in proc.stdout, text
  assert _launch(["--helpfull"]).returncode == 0


def test_print_config_prints_every_key_with_its_value_and_meaning():
  from jaxreplay.config import defaults  # pylint: disable=g-import-not-at-top
  from jaxreplay.config import reference  # pylint: disable=g-import-not-at-top
  proc = _launch([TINY, "--print_config", "--config.buffer.size=300"])
  assert proc.returncode == 0, proc.stderr
  lines = {line.split(" = ")[0]: line for line in proc.stdout.splitlines() if " = " in line}
  keys = [k for k, _ in reference.flat_items(defaults.base_config())]
  assert sorted(lines) == sorted(keys)
  assert lines["buffer.size"].startswith("buffer.size = 300 ") and "# N, in rollouts" in \
      lines["buffer.size"]
  assert "rollout.backend = 'jax'" in proc.stdout or "rollout.backend = 'vllm'" in proc.stdout
  assert "'auto'" not in lines["rollout.backend"]  # resolved


def test_dry_run_of_a_gpu_config_on_cpu_emulates_its_devices(tmp_path):
  """configs/qwen3_8b.py wants 3 trainer devices; on a CPU machine without XLA_FLAGS the dry run
  emulates them itself."""
  data = tmp_path / "train.jsonl"
  data.write_text('{"problem": "1+1", "answer": "2"}\n')
  proc = _launch(["--config=configs/qwen3_8b.py", f"--workdir={tmp_path}/plan", "--dry_run",
                  f"--config.task.path={data}", "--config.devices.memory_gib=141"],
                 env_extra={"XLA_FLAGS": ""})
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "trainer: 3 CPU devices (emulated for the dry run)" in proc.stderr
  assert "fits: True" in proc.stdout and os.path.isfile(tmp_path / "plan" / "plan.json")


def test_console_of_a_run(tiny_reference_run):
  """The shortened tiny run's console (tests/conftest.py keeps it): the banner first, no absl
  prefix, no warning and no library line, the step-0 evaluation, progress with an ETA, the
  summary; run.log keeps absl's format."""
  with open(os.path.join(os.path.dirname(tiny_reference_run), "tiny_reference.console")) as f:
    lines = f.read().splitlines()
  assert lines[0].startswith("jaxreplay: ") and f"-> {tiny_reference_run} (a new run)" in lines[0]
  assert lines[1].startswith("  model    tiny-arith-sft (qwen3, 397K params")
  assert not [line for line in lines if ABSL_PREFIX.match(line)]
  assert not [line for line in lines if line.startswith(("warning", "error"))
              or "libtpu" in line or "WARNING" in line], lines
  assert any(line.startswith("eval at step 0: pass@1 ") for line in lines)
  progress = [line for line in lines if line.startswith("step ")]
  assert progress and "ETA ?" not in progress[0] and "ETA " in progress[0]
  summary = "\n".join(lines[[i for i, l in enumerate(lines) if l.startswith("finished at")][0]:])
  assert re.search(r"eval/pass@1 +[0-9.]+ -> [0-9.]+", summary), summary
  for name in ("metrics.jsonl", "hf/", "tb/", "checkpoints/", "run.log"):
    assert f"  {name}" in summary, name
  with open(os.path.join(tiny_reference_run, "run.log")) as f:
    log = f.read().splitlines()
  assert ABSL_PREFIX.match(log[0]) and "jaxreplay: " in log[0]
  assert any("finished: {'step': 6" in line for line in log)


# When SIGINT is sent: (a line the console shows first, seconds after it). The banner's last line
# + 2 s lands in start-up (task, tokenizer, model, compiles, the step-0 evaluation): the run stops
# at once. The rollout worker's start comes after step 0 is recorded: the run has started, and it
# stops after the step in progress with a checkpoint.
CTRL_C_MOMENTS = [("  log ", 2.0), ("started the rollout worker", 0.0)]


@pytest.mark.slow
@pytest.mark.parametrize("after_line,delay", CTRL_C_MOMENTS, ids=["start_up", "first_step"])
def test_ctrl_c_stops_with_the_resume_hint(tmp_path, after_line, delay):
  """SIGINT during start-up exits with 130 and the hint to rerun, without a traceback or a crash;
  once the run started, it says so at once, stops after its step with a checkpoint and exits 130.
  (The latency is measured by bench/bench_console.py; the bound here only tells "at once" from the
  79 s start-up stop of before.)"""
  workdir = tmp_path / "run"
  log = tmp_path / "console.txt"
  proc = tiny_runs.start(str(workdir), log_path=str(log))
  try:
    deadline = time.monotonic() + 300
    while not (log.exists() and after_line in log.read_text()):
      assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
      time.sleep(0.1)
    time.sleep(delay)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=240)
    latency = time.monotonic() - sent
  finally:
    if proc.poll() is None:
      proc.kill()
  text = log.read_text()
  assert proc.returncode == 130, text[-3000:]
  assert "Traceback" not in text and "Fatal Python error" not in text, text[-3000:]
  if after_line == "  log ":
    assert "SIGINT during start-up" in text and "rerun the same command to start the run" in text
    assert latency < 30.0, latency
  else:
    assert "SIGINT received: stopping after the current step" in text, text[-3000:]
    assert "rerun the same command to resume" in text, text[-3000:]
    assert os.listdir(workdir / "checkpoints"), text[-3000:]
