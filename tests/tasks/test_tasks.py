"""The task package's factory (`jaxreplay.tasks.make_task`): a task by name, errors that name the
fix."""
import pytest

from jaxreplay import tasks
from jaxreplay.tasks import arithmetic
from jaxreplay.tasks import calculator
from jaxreplay.tasks import scratchpad


def test_make_task_errors():
  assert isinstance(tasks.make_task("arithmetic", num_digits=(1, 1)), arithmetic.ArithmeticTask)
  with pytest.raises(ValueError, match="needs path"):
    tasks.make_task("math")
  assert isinstance(tasks.make_task("scratchpad", num_digits=(2, 3)),
                    scratchpad.ScratchpadAdditionTask)
  calc = tasks.make_task("calculator", num_digits=(2, 3))
  assert isinstance(calc, calculator.CalculatorTask) and hasattr(calc, "make_env")
  assert not hasattr(tasks.make_task("scratchpad"), "make_env")  # single-turn
  with pytest.raises(ValueError, match="unknown task 'lean'.*'calculator'"):
    tasks.make_task("lean")
