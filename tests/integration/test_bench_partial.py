"""`bench/bench_partial.py --real` reads its runs right: a run cut short is not taken as done (it
is rerun afresh), the steady window is the difference of the cumulative counters from its first
update to the last, and the paired differences are continue minus off of the same seed."""
import argparse
import json
import os

import numpy as np
import pytest

from tests.helpers.paths import bench_module


@pytest.fixture(name="bench")
def fixture_bench():
  return bench_module("bench_partial")


def write_run(workdir, steps, wait_per_step, tokens_per_step, gen_per_step, pass1_end,
              last_eval=True):
  """metrics.jsonl of an async run: the step-0 evaluation, then one row per update with the
  cumulative counters growing linearly after a 10 s start (5 s of it waiting)."""
  os.makedirs(workdir)
  rows = [{"step": 0, "policy_version": 0, "eval/pass@1": 0.25, "compute_seconds": 0.0}]
  for s in range(1, steps + 1):
    rows.append({
        "step": s, "loss": 0.1, "time/wall_s": 10.0 + 2.0 * s,
        "time/trainer_wait_s": 5.0 + wait_per_step * s,
        "pool/tokens": 1000.0 + tokens_per_step * s,
        "pool/generate_seconds": 20.0 + gen_per_step * s,
        "buffer/staleness_mean": 1.0, "buffer/token_staleness_mean": 0.5 + 0.1 * (s % 2),
        "buffer/versions_per_rollout_mean": 1.5, "fresh_rollouts": 32.0,
        "compute_seconds": 3.0 * s, "compute/generation_seconds": 2.0 * s,
        "compute/training_seconds": 1.0 * s})
  if last_eval:
    rows[-1]["eval/pass@1"] = pass1_end
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.write("\n".join(json.dumps(r) for r in rows) + "\n")


def test_a_run_cut_short_is_not_finished(bench, tmp_path):
  assert not bench.finished(str(tmp_path / "none"), 8)
  write_run(str(tmp_path / "short"), 5, 0.5, 100.0, 1.0, 0.3)
  assert not bench.finished(str(tmp_path / "short"), 8)  # killed at update 5 of 8
  write_run(str(tmp_path / "noeval"), 8, 0.5, 100.0, 1.0, 0.3, last_eval=False)
  assert not bench.finished(str(tmp_path / "noeval"), 8)  # killed before its last evaluation
  write_run(str(tmp_path / "done"), 8, 0.5, 100.0, 1.0, 0.3)
  assert bench.finished(str(tmp_path / "done"), 8)


def test_summarize_takes_the_steady_window(bench, tmp_path):
  write_run(str(tmp_path / "r"), 8, 0.5, 100.0, 0.25, 0.375)
  r = bench.summarize(str(tmp_path / "r"))
  # whole run: wall 26 s, wait 9 s, 1800 tokens in 22 generate-seconds
  np.testing.assert_allclose([r["wall_s"], r["trainer_idle_fraction"], r["tokens_per_generate_s"],
                              r["tokens_per_wall_s"]], [26.0, 9.0 / 26.0, 1800.0 / 22.0,
                                                        1800.0 / 26.0])
  st = r["steady"]  # updates 2 -> 8: 12 s of wall, 3 s waiting, 600 tokens in 1.5 generate-seconds
  assert st["from_step"] == 2
  np.testing.assert_allclose([st["wall_s"], st["trainer_idle_fraction"],
                              st["tokens_per_generate_s"], st["tokens_per_wall_s"]],
                             [12.0, 0.25, 400.0, 50.0])
  np.testing.assert_allclose([st["wall_per_update_s"], st["trainer_wait_per_update_s"]], [2.0, 0.5])
  np.testing.assert_allclose(r["token_staleness_mean"], 0.55)
  assert (r["pass1_start"], r["pass1_end"], r["compute_seconds"]) == (0.25, 0.375, 24.0)
  write_run(str(tmp_path / "noeval"), 8, 0.5, 100.0, 0.25, 0.375, last_eval=False)
  with pytest.raises(RuntimeError, match="eval/pass@1"):
    bench.summarize(str(tmp_path / "noeval"))


def test_compare_pairs_each_seed(bench, tmp_path):
  runs = {}
  for mode, wait, pass1 in (("off", 0.5, 0.375), ("continue", 1.0, 0.5)):
    for seed in (0, 1):
      path = str(tmp_path / f"jax_{mode}_seed{seed}")
      write_run(path, 8, wait, 100.0, 0.25, pass1 + 0.125 * seed)
      runs[f"jax_{mode}_seed{seed}"] = bench.summarize(path)
  arms, paired = bench.compare(runs, {"jax": [0, 1]})
  assert arms["jax_off"]["per_seed"]["pass1_end"] == {"0": 0.375, "1": 0.5}
  assert arms["jax_continue"]["mean"]["pass1_end"] == 0.5625
  assert paired["jax"]["pass1_end"] == {"0": 0.125, "1": 0.125}
  np.testing.assert_allclose(list(paired["jax"]["trainer_idle_fraction"].values()), [0.25, 0.25])
  summary = paired["jax"]["summary"]["pass1_end"]
  assert (summary["n"], summary["mean"], summary["below_zero"]) == (2, 0.125, 0)
  np.testing.assert_allclose(summary["ci95"], [0.125, 0.125])  # equal differences: no spread


def test_backend_seeds(bench):
  args = argparse.Namespace(backends="jax,vllm", seeds="0,1,2", backend_seeds=["vllm=0,1"])
  assert bench.seeds_of(args) == {"jax": [0, 1, 2], "vllm": [0, 1]}
  with pytest.raises(SystemExit, match="--backend_seeds"):
    bench.seeds_of(argparse.Namespace(backends="jax", seeds="0", backend_seeds=["vllm=0"]))
