"""`EvalGrid`: which steps are evaluated, pass@k points, and its checkpointed state."""
import ml_collections

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
