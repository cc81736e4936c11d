"""Tests of `config.schedule_table`: every record names its `Schedule` class (by import path, read
by `run.schedules.schedule_class`), validation reads the names and the records' facts from it, and
a toy schedule added as one record is accepted and looked up (a whole run with it:
tests/integration/test_table_entries.py)."""
import pytest

from jaxreplay.config import defaults
from jaxreplay.config import schedule_table
from jaxreplay.config import validation
from jaxreplay.run import schedules


def test_every_record_names_its_schedule_class():
  for kind, record in schedule_table.SCHEDULES.items():
    cls = schedules.schedule_class(kind)
    assert issubclass(cls, schedules.Schedule) and cls.kind == kind
    assert isinstance(record.cls, str)  # the config layer names run/ classes, never imports them


class ToySchedule(schedules.SimulatedScheduler):
  """A toy schedule: the simulated one under its own kind."""
  kind = "toy"


def test_a_new_schedule_is_one_record(monkeypatch):
  c = defaults.base_config()
  c.scheduler.kind = "toy"
  with pytest.raises(ValueError, match=r"scheduler.kind='toy': expected one of \('simulated', "
                                       r"'sync', 'async'\)"):
    validation.validate_config(c)
  with pytest.raises(ValueError, match="scheduler.kind='toy': expected one of"):
    schedules.schedule_class("toy")
  monkeypatch.setitem(schedule_table.SCHEDULES, "toy", schedule_table.ScheduleRecord(ToySchedule))
  validation.validate_config(c)
  assert schedules.schedule_class("toy") is ToySchedule
  # by import path, as the table's own rows
  monkeypatch.setitem(schedule_table.SCHEDULES, "toy",
                      schedule_table.ScheduleRecord(f"{__name__}:ToySchedule"))
  assert schedules.schedule_class("toy") is ToySchedule
  # a record's facts drive validation: one that generates rollouts_per_step gets the sync checks
  monkeypatch.setitem(schedule_table.SCHEDULES, "toy",
                      schedule_table.ScheduleRecord(ToySchedule, rollouts_per_step=True))
  c.scheduler.rollouts_per_step = 100
  with pytest.raises(ValueError, match=r"scheduler.rollouts_per_step=100 must be a positive multiple"):
    validation.validate_config(c)


def test_a_record_whose_class_is_another_kind_is_refused(monkeypatch):
  monkeypatch.setitem(schedule_table.SCHEDULES, "toy",
                      schedule_table.ScheduleRecord(schedules.SyncScheduler))
  with pytest.raises(TypeError, match="expected a Schedule subclass whose kind is 'toy'"):
    schedules.schedule_class("toy")
