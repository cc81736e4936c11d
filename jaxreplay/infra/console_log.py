"""The launcher's console and its log file: plain lines for the user, absl's full records on disk.

`setup(debug)` arranges Python logging for a command-line run:

  console   absl's stderr handler prints jaxreplay's own records as plain lines (`ConsoleFormatter`:
            INFO as it is, "warning: " / "error: " before the others, no `I1206 <time> <thread>
            file.py:N]` prefix) and drops the records of other libraries (JAX's backend probe,
            orbax, ...) below ERROR (`ConsoleFilter`); Python warnings become log records, so
            they follow the same rule
  log file  every record at INFO and up, in absl's format (level, time, thread, file:line), goes
            to a `LogFile` handler: held in memory until `LogFile.open(path)` (the launcher opens
            WORKDIR/run.log once the config is valid and the workdir may be created), appended
            to the file from then on

`debug=True` (the launcher's --debug) leaves absl's console as it is: its prefix, every library.
"""
from __future__ import annotations

import logging as std_logging
import os
import sys
import threading
from typing import Optional

from absl import logging

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # jaxreplay/
_PREFIX = {std_logging.WARNING: "warning: ", std_logging.ERROR: "error: ",
           std_logging.CRITICAL: "error: "}
FILE_ONLY = "file_only"  # `logging.info(..., extra={FILE_ONLY: True})`: the log file only


def is_ours(record: std_logging.LogRecord) -> bool:
  """Whether a record was logged by a module of the jaxreplay package."""
  return os.path.abspath(record.pathname).startswith(PACKAGE_DIR + os.sep)


class ConsoleFormatter(std_logging.Formatter):
  """A record as the user reads it: the message, after "warning: " / "error: " when not INFO;
  a traceback it carries goes to the log file only."""

  def format(self, record: std_logging.LogRecord) -> str:
    saved = record.exc_info, record.exc_text, record.stack_info
    record.exc_info, record.exc_text, record.stack_info = None, None, None
    try:
      text = super().format(record)
    finally:
      record.exc_info, record.exc_text, record.stack_info = saved
    return _PREFIX.get(record.levelno, "") + text


class ConsoleFilter(std_logging.Filter):
  """Lets through jaxreplay's records (but those logged with `extra={FILE_ONLY: True}`) and other
  libraries' errors; the rest goes to the log file only."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    if getattr(record, FILE_ONLY, False):
      return False
    return is_ours(record) or record.levelno >= std_logging.ERROR


class LogFile(std_logging.Handler):
  """Every record at INFO and up in absl's format (orbax's INFO lines aside); kept in memory (up
  to `max_pending` lines) until `open(path)`, then appended to that file, flushed line by line."""

  def __init__(self, max_pending: int = 20000):
    super().__init__(std_logging.INFO)
    self.setFormatter(logging.PythonFormatter())
    self.path: Optional[str] = None
    self._file = None
    self._pending: list[str] = []
    self._max_pending = max_pending
    self._io_lock = threading.Lock()

  def open(self, path: str) -> None:
    """Starts writing to `path` (appending: a resumed run continues its log), the held lines
    first."""
    with self._io_lock:
      if self._file is not None:
        return
      os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
      self._file = open(path, "a", encoding="utf-8")
      self.path = path
      self._file.write("".join(line + "\n" for line in self._pending))
      self._file.flush()
      self._pending = []

  def emit(self, record: std_logging.LogRecord) -> None:
    if record.levelno < std_logging.WARNING and "orbax" in record.pathname:
      return  # dozens of INFO lines per checkpoint
    try:
      line = self.format(record)
    except Exception:  # pylint: disable=broad-except
      self.handleError(record)
      return
    with self._io_lock:
      if self._file is None:
        if len(self._pending) < self._max_pending:
          self._pending.append(line)
        return
      self._file.write(line + "\n")
      self._file.flush()

  def close(self) -> None:
    with self._io_lock:
      if self._file is not None:
        self._file.close()
        self._file = None
    super().close()


_log_file: Optional[LogFile] = None


def setup(debug: bool = False) -> LogFile:
  """Sets up the console and the log file (see the module docstring); returns the `LogFile`
  (one per process: a second call returns the first)."""
  global _log_file
  if _log_file is not None:
    return _log_file
  std_logging.captureWarnings(True)
  handler = logging.get_absl_handler()
  if not debug:
    handler.setFormatter(ConsoleFormatter())
    handler.addFilter(ConsoleFilter())
  _log_file = LogFile()
  std_logging.getLogger().addHandler(_log_file)
  return _log_file


def flush() -> None:
  """Flushes the console (stderr) and absl's handler."""
  logging.flush()
  sys.stderr.flush()
