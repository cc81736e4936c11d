"""The first and the last lines of a run."""
import json

from jaxreplay.config import defaults
from jaxreplay.run import console
from tests.helpers.tiny_runs import SFT


def test_banner_names_config_model_devices_and_backends():
  c = defaults.base_config()
  c.model.path = SFT
  c.rollout.backend = "jax"
  c.rollout.num_workers = 4
  text = console.banner(c, "configs/tiny.py", "/tmp/run", "1 CPU device", None, "/tmp/run/run.log")
  lines = text.splitlines()
  assert lines[0] == "jaxreplay: configs/tiny.py -> /tmp/run (a new run)"
  assert lines[1] == "  model    tiny-arith-sft (qwen3, 397K params, 2 layers, float32)"
  assert "100 steps of grpo, a replay buffer of N=84 rollouts, B=60 per step" in lines[3]
  assert lines[4] == ("  devices  trainer: 1 CPU device; rollout: 4 jax workers; evaluation on "
                      "the trainer")
  assert lines[5] == "  log      /tmp/run/run.log"
  c.buffer.on_policy = True
  assert "(resuming at step 40)" in console.banner(c, "c.py", "/w", "x", 40)


def test_summary_table_and_outputs(tmp_path):
  rows = [{"step": 0, "eval/pass@1": 0.5, "eval/pass@16": 0.9, "eval/entropy": 0.3},
          {"step": 1, "loss": 0.1},
          {"step": 2, "eval/pass@1": 0.75, "eval/pass@16": 0.95, "eval/entropy": 0.25}]
  with open(tmp_path / "metrics.jsonl", "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in rows))
  (tmp_path / "hf").mkdir()
  text = console.summary(str(tmp_path), 125.0, "finished at step 2")
  lines = text.splitlines()
  assert lines[0] == "finished at step 2 in 2m05s"
  assert lines[1].split() == ["step", "0", "step", "2"]
  assert lines[2].split() == ["eval/pass@1", "0.5", "->", "0.75"]
  assert lines[3].split() == ["eval/entropy", "0.3", "->", "0.25"]
  assert lines[4].split() == ["eval/pass@16", "0.9", "->", "0.95"]
  assert lines[5] == f"outputs in {tmp_path}:"
  assert lines[6].startswith("  metrics.jsonl ") and lines[7].startswith("  hf/ ")
  assert f"python -m jaxreplay.chat --model={tmp_path}/hf" in lines[7]
  assert len(lines) == 8  # no tb/, checkpoints/ or run.log here
