"""The task package's factory (`jaxreplay.tasks.make_task`): a task by name, errors that name the
fix."""
import pytest

from jaxreplay import tasks
from jaxreplay.tasks import arithmetic


def test_make_task_errors():
  assert isinstance(tasks.make_task("arithmetic", num_digits=(1, 1)), arithmetic.ArithmeticTask)
  with pytest.raises(ValueError, match="needs path"):
    tasks.make_task("math")
  with pytest.raises(ValueError, match="unknown task"):
    tasks.make_task("lean")
