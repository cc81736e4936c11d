"""`EvalGrid`: which steps are evaluated, pass@k points, and its checkpointed state."""
import ml_collections
import numpy as np

from jaxreplay.run.eval_grid import EvalGrid


def test_compute_grid_points_are_crossed_once_and_passk_only_at_its_points():
  grid = EvalGrid(compute_grid=(30.0, 10.0, 20.0), passk_grid=(20.0,))
  assert grid.points == [10.0, 20.0, 30.0]
  assert grid.start() and not grid.passk_due  # 0.0 is not a pass@k point
  assert not grid.due(1, False, lambda: 5.0)
  assert grid.due(2, False, lambda: 12.0) and not grid.passk_due and grid.next == 1
  assert not grid.due(3, False, lambda: 15.0)
  assert grid.due(4, False, lambda: 25.0) and grid.passk_due and grid.next == 2
  assert grid.due(5, True, lambda: 26.0) and grid.passk_due  # the last step always


def test_every_without_a_grid_and_compute_read_only_with_a_grid():
  grid = EvalGrid(every=3)

  def no_compute():
    raise AssertionError("the compute axis is read only with a compute grid")

  assert [s for s in range(1, 10) if grid.due(s, False, no_compute)] == [3, 6, 9]
  assert grid.start() and grid.passk_due
  assert not EvalGrid().start()


def test_state_dict_round_trip_and_an_old_host_state_loads():
  grid = EvalGrid.from_config(ml_collections.ConfigDict(
      {"compute_grid": (1.0, 2.0, 3.0), "passk_grid": (), "every": 0}))
  grid.due(1, False, lambda: 2.5)
  grid.compute_at_step_end = 2.5
  state = grid.state_dict()
  assert state == {"next": 2, "compute_at_step_end": 2.5}  # the host-state keys of old checkpoints
  fresh = EvalGrid((1.0, 2.0, 3.0))
  fresh.load_state_dict(state)
  assert (fresh.next, fresh.compute_at_step_end) == (2, 2.5)
  old_host = {"eval_grid": {"next": 1, "compute_at_step_end": 1.5}}  # as Pipeline wrote it before
  fresh.load_state_dict(old_host["eval_grid"])
  assert (fresh.next, fresh.compute_at_step_end) == (1, 1.5)
  fresh.skip_evaluated(2.0)  # a checkpoint from before the key: the points up to now count as done
  assert fresh.next == 2


def test_a_finished_run_resumed_to_a_longer_grid_evaluates_only_the_new_points():
  """The last step of a finished run is evaluated without moving past the points it crossed; its
  state loaded into the grid continued past the budget (`sweeps.extended_grid`) counts them as
  evaluated: the next evaluations are at the new points only."""
  grid = EvalGrid((10.0, 20.0, 40.0), passk_grid=(40.0,))
  assert grid.due(3, False, lambda: 21.0) and grid.next == 2
  assert grid.due(5, True, lambda: 41.0) and grid.passk_due  # finished at the budget, 40
  grid.compute_at_step_end = 41.0
  state = grid.state_dict()
  assert state["next"] == 2  # the finished step did not move past 40
  longer = EvalGrid((10.0, 20.0, 40.0, 50.0, 60.0), passk_grid=(40.0, 60.0))
  longer.load_state_dict(state)
  assert longer.next == 3
  assert not longer.due(6, False, lambda: 45.0)   # 40 is not evaluated a second time
  assert longer.due(7, False, lambda: 52.0) and not longer.passk_due and longer.next == 4
  assert longer.due(9, True, lambda: 61.0) and longer.passk_due


def test_refinement_splits_the_interval_ahead_when_a_level_is_within_reach():
  """Hand-computed: grid 10, 20, 40, 80 with a level at 0.5, band 0.05, 4 splits. At 10 pass@1 0.30
  (no rise yet: reach 0.05) nothing is added; at 20 0.42 (reach 2 x 0.12 = 0.24 covers 0.5) the
  interval 20 -> 40 is split at 20 x 2^(1/4), 20 x 2^(1/2), 20 x 2^(3/4); those points are pass@1
  only, and the parts are not split again."""
  grid = EvalGrid((10.0, 20.0, 40.0, 80.0), passk_grid=(80.0,), refine_levels=(0.5,),
                  refine_band=0.05, refine_splits=4)
  assert grid.start() and grid.observe(0.2) == []  # step 0: no interval behind it
  assert grid.due(1, False, lambda: 10.5) and grid.observe(0.30) == []
  assert grid.due(2, False, lambda: 20.5)
  added = grid.observe(0.42)
  np.testing.assert_allclose(added, [20 * 2 ** 0.25, 20 * 2 ** 0.5, 20 * 2 ** 0.75])
  np.testing.assert_allclose(grid.points, [10, 20, *added, 40, 80])
  assert grid.due(3, False, lambda: 24.0) and not grid.passk_due
  assert grid.observe(0.49) == []  # an added point: its interval is not split again
  assert grid.due(4, False, lambda: 34.0) and grid.next == 5  # crossed 28.3 and 33.6 at once
  assert grid.observe(0.52) == []
  assert grid.due(5, False, lambda: 41.0) and grid.observe(0.55) == []  # 0.5 is behind: no split
  assert grid.due(6, False, lambda: 81.0) and grid.passk_due


def test_refinement_only_near_a_level_and_its_state_resumes():
  grid = EvalGrid((10.0, 20.0, 40.0), refine_levels=(0.9,), refine_band=0.05)
  grid.start()
  grid.observe(0.1)
  grid.due(1, False, lambda: 10.0)
  assert grid.observe(0.12) == []  # 0.9 is beyond 0.12 + max(0.05, 2 x 0.02); no compute: no pace
  grid.due(2, False, lambda: 20.0)
  assert len(grid.observe(0.86)) == 3  # within the band below 0.9
  grid.due(3, False, lambda: 24.0)
  grid.compute_at_step_end = 24.0
  state = grid.state_dict()
  assert set(state) == {"next", "compute_at_step_end", "added", "last_pass1", "last_compute"}
  resumed = EvalGrid((10.0, 20.0, 40.0), refine_levels=(0.9,), refine_band=0.05)
  resumed.load_state_dict(state)
  assert resumed.points == grid.points and resumed.next == grid.next == 3
  assert resumed.last_pass1 == 0.86
  assert [resumed.due(s, False, lambda x=x: x) for s, x in ((4, 28.0), (5, 34.0), (6, 40.0))] == \
      [False, True, True]


def test_refinement_adds_no_pass_k_draws_without_a_passk_grid():
  """With passk_grid () every configured point draws pass@k; the added ones never do."""
  grid = EvalGrid((10.0, 20.0, 40.0), refine_levels=(0.5,))
  grid.due(1, False, lambda: 20.0)
  assert grid.passk_due
  grid.observe(0.48)
  assert grid.due(2, False, lambda: 24.0) and not grid.passk_due
  assert grid.due(3, False, lambda: 40.0) and grid.passk_due


def test_the_pace_lookahead_catches_a_curve_that_accelerates():
  """Hand-computed from on-policy 3x seed 2 of pareto_multiplication_dense (the case the old rule
  missed): grid 784, 987.8, 1245, level 0.414, band 0.06. Evaluated 0.284 at 887 device-s and 0.304
  at 1000: the band and twice the rise (0.04) reach 0.364 only; the pace, 0.02 / 113 per device-s,
  over the 245 device-s to 1245, times 4 (the default), reaches 0.304 + 0.1735 = 0.477 >= 0.414, so
  987.8 -> 1245 is split. With the lookahead off (0) it is not, nor with 2 (reach 0.0867: 0.391)."""
  def run(lookahead):
    grid = EvalGrid((784.0, 987.8, 1245.0), refine_levels=(0.414,), refine_band=0.06,
                    refine_lookahead=lookahead)
    assert grid.due(7, False, lambda: 887.0) and grid.observe(0.284, 887.0) == []
    assert grid.due(8, False, lambda: 1000.0)
    return grid, grid.observe(0.304, 1000.0)
  grid, added = run(4.0)
  ratio = 1245.0 / 987.8
  np.testing.assert_allclose(added, [987.8 * ratio ** (j / 4) for j in (1, 2, 3)])
  assert grid.last_compute == 1000.0
  assert run(0.0)[1] == [] and run(2.0)[1] == [] and len(run(2.7)[1]) == 3  # 2.7: 0.421
  grid = EvalGrid((784.0, 987.8, 1245.0), refine_levels=(0.414,), refine_band=0.06)
  grid.due(7, False, lambda: 887.0)
  grid.observe(0.284, 887.0)
  assert grid.due(8, False, lambda: 1000.0) and grid.observe(0.27, 1000.0) == []  # a fall: band


def test_the_pace_survives_a_resume_and_an_old_checkpoint_has_none():
  """`last_compute` is saved with the refine state; a checkpoint from before it resumes with the
  pace unknown (the band and twice the last rise only) until the next evaluation."""
  grid = EvalGrid((784.0, 987.8, 1245.0), refine_levels=(0.414,), refine_band=0.06)
  grid.due(7, False, lambda: 887.0)
  grid.observe(0.284, 887.0)
  grid.compute_at_step_end = 887.0
  state = grid.state_dict()
  resumed = EvalGrid((784.0, 987.8, 1245.0), refine_levels=(0.414,), refine_band=0.06)
  resumed.load_state_dict(state)
  assert (resumed.last_pass1, resumed.last_compute) == (0.284, 887.0)
  assert resumed.due(8, False, lambda: 1000.0) and len(resumed.observe(0.304, 1000.0)) == 3
  old = {k: v for k, v in state.items() if k != "last_compute"}
  before = EvalGrid((784.0, 987.8, 1245.0), refine_levels=(0.414,), refine_band=0.06)
  before.load_state_dict(old)
  assert before.last_compute is None
  assert before.due(8, False, lambda: 1000.0) and before.observe(0.304, 1000.0) == []
