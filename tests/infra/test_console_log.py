"""The launcher's console (plain lines, jaxreplay's own) and its log file (absl's format)."""
import logging as std_logging
import os

from jaxreplay.infra import console_log


def _record(pathname, level=std_logging.INFO, msg="hello world", args=(), **extra):
  record = std_logging.LogRecord("absl", level, pathname, 12, msg, args, None)
  record.__dict__.update(extra)
  return record


OURS = os.path.join(console_log.PACKAGE_DIR, "run", "pipeline.py")
THEIRS = "/usr/lib/python3/site-packages/jax/_src/xla_bridge.py"


def test_console_format_and_filter():
  fmt, keep = console_log.ConsoleFormatter(), console_log.ConsoleFilter()
  assert fmt.format(_record(OURS)) == "hello world"
  assert fmt.format(_record(OURS, std_logging.WARNING)) == "warning: hello world"
  assert fmt.format(_record(OURS, std_logging.ERROR)) == "error: hello world"
  try:
    raise ValueError("boom")
  except ValueError:
    import sys  # pylint: disable=g-import-not-at-top
    with_tb = _record(OURS, std_logging.ERROR)
    with_tb.exc_info = sys.exc_info()
  assert fmt.format(with_tb) == "error: hello world"  # the traceback goes to the log file only
  assert keep.filter(_record(OURS)) and not keep.filter(_record(THEIRS))
  assert not keep.filter(_record(THEIRS, std_logging.WARNING))
  assert keep.filter(_record(THEIRS, std_logging.ERROR))
  assert not keep.filter(_record(OURS, **{console_log.FILE_ONLY: True}))


def test_log_file_holds_lines_until_opened(tmp_path):
  log = console_log.LogFile()
  log.handle(_record(OURS, msg="before"))
  log.handle(_record(THEIRS, msg="library info"))
  log.handle(_record("/x/orbax/checkpoint.py", msg="orbax chatter"))
  path = tmp_path / "run" / "run.log"
  log.open(str(path))
  log.handle(_record(OURS, std_logging.WARNING, msg="after"))
  log.close()
  lines = path.read_text().splitlines()
  assert len(lines) == 3 and lines[0].startswith("I") and lines[0].endswith("pipeline.py:12] before")
  assert lines[1].endswith("library info") and lines[2].startswith("W")
