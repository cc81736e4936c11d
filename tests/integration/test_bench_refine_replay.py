"""`bench/refine_replay.py` counts right: on a run whose curve accelerates past a target between two
grid points, the rule without the pace lookahead leaves that first crossing unrefined and the
lookahead (3) refines it; a later re-crossing is not counted again."""
import json
import os

import pytest

from tests.helpers.paths import bench_module


@pytest.fixture(name="bench")
def fixture_bench():
  return bench_module("refine_replay")


def write_record(runs, evals):
  d = os.path.join(runs, "pareto_multiplication", "onpolicy_lr3x", "seed0")
  os.makedirs(d)
  record = {"run_config": {"eval": {"compute_grid": [0.0, 784.0, 987.8, 1245.0, 1568.0]}},
            "curve": [{"compute_seconds": c, "eval/pass@1": p} for c, p in evals]}
  with open(os.path.join(d, "record.json"), "w") as f:
    json.dump(record, f)


def test_the_replay_finds_the_accelerating_crossing_and_the_lookahead_catches_it(bench, tmp_path):
  runs = str(tmp_path / "runs")
  # seed 2's case (0.284 -> 0.304 -> 0.437 across 0.414), then a fall and a second rise past 0.414
  write_record(runs, [(0.0, 0.22), (887.0, 0.284), (1000.0, 0.304), (1331.0, 0.437),
                      (1600.0, 0.40), (1700.0, 0.45)])
  old, new = bench.replay_sweep(runs, "pareto_multiplication", [0.0, 3.0])
  assert (old["first_crossings"], old["first_missed"]) == (1, 1)
  assert (new["first_crossings"], new["first_missed"]) == (1, 0)
  assert old["intervals"] == new["intervals"] == 5 and new["refined"] > old["refined"]
  bench.main(["--sweeps", "pareto_multiplication", "--lookaheads", "0", "3", "--runs", runs,
              "--out", str(tmp_path / "out")])
  written = json.load(open(tmp_path / "out" / "refine_replay.json"))
  assert [r["first_missed"] for r in written["rows"]] == [1, 0]
