r"""Entry point: `python -m jaxreplay.launch --config=configs/tiny.py --workdir=runs/tiny`.

Config values are overridden on the command line (`--config.buffer.size=84`); the config is locked, so a
misspelled key is an error that names it. Re-running the same command resumes from the newest
checkpoint in --workdir.

`--dry_run` prints the per-device memory plan and exits (3 when it does not fit).

Exit status: 0 when the run finished; 128 + the signal's number (143 for SIGTERM, 130 for Ctrl-C)
when a signal stopped it after a checkpoint (rerun the command to resume); 3 for a run that cannot
go on as configured (busy workdir, repeated non-finite updates, no restorable checkpoint, a failed
checkpoint write, too little /dev/shm for the weight slots), with a one-line message and no
traceback; 1 for other errors.
"""
from __future__ import annotations

import os
import signal
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Python config file whose get_config() returns the run's ConfigDict.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory: metrics.jsonl, TensorBoard events, checkpoints, hf/ export.")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "Multi-host: this process's index (jax.distributed).")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Multi-host: number of trainer processes (jax.distributed).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "Multi-host: host:port of process 0 (jax.distributed).")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Build the run abstractly (no weights read, no engines started), print the "
    "per-device memory plan and the device split, write WORKDIR/plan.json; exit 3 when it does not "
    "fit the device memory (devices.memory_gib on machines without a GPU).")
flags.mark_flags_as_required(["config", "workdir"])


class _QuietLibraries:
  """Drops INFO lines of orbax (dozens per checkpoint); warnings and errors still show."""

  def filter(self, record):
    return record.levelno >= 30 or "orbax" not in record.pathname


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.get_absl_handler().addFilter(_QuietLibraries())
  from jaxreplay.config import devices  # pylint: disable=g-import-not-at-top
  split = devices.apply_to_environment(_CONFIG.value)  # before JAX picks its devices
  if split is not None:
    logging.info("GPUs: trainer %s, rollout workers %s", ",".join(split.trainer),
                 ",".join(split.workers) or "none")
  if _DRY_RUN.value:
    from jaxreplay.config import memory_plan  # pylint: disable=g-import-not-at-top
    from jaxreplay.config import resolve  # pylint: disable=g-import-not-at-top
    from jaxreplay.config import validation  # pylint: disable=g-import-not-at-top
    validation.validate_config(_CONFIG.value)
    config = resolve.resolve(_CONFIG.value)
    try:
      memory_plan.dry_run(config, os.path.abspath(os.path.expanduser(_WORKDIR.value)), split)
    except memory_plan.DoesNotFit as e:
      logging.error("DoesNotFit: %s", e)
      logging.flush()
      sys.exit(3)
    return
  if _COORDINATOR.value or _NUM_PROCESSES.value:
    import jax  # pylint: disable=g-import-not-at-top
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":  # CPU collectives across processes need gloo
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                               num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value)
    logging.info("trainer process %d/%d: %d local, %d global devices", jax.process_index(),
                 jax.process_count(), jax.local_device_count(), jax.device_count())
  from jaxreplay.infra import checkpoint  # pylint: disable=g-import-not-at-top
  from jaxreplay.run import pipeline  # pylint: disable=g-import-not-at-top
  from jaxreplay.infra import safety  # pylint: disable=g-import-not-at-top
  from jaxreplay.rollout.weights import shm_publisher  # pylint: disable=g-import-not-at-top
  stop_errors = (safety.WorkdirBusy, safety.NonFiniteUpdates,
                 checkpoint.NoRestorableCheckpoint, checkpoint.CheckpointSaveError,
                 shm_publisher.ShmSpaceError)
  workdir = os.path.abspath(os.path.expanduser(_WORKDIR.value))
  logging.info("workdir: %s", workdir)
  try:
    summary = pipeline.run(_CONFIG.value, workdir)
  except stop_errors as e:
    logging.error("%s: %s", type(e).__name__, e)
    logging.flush()
    sys.exit(3)
  if "stopped_by" in summary:
    logging.info("stopped by %s at step %d after saving a checkpoint; rerun the same command to "
                 "resume", summary["stopped_by"], summary["step"])
    logging.flush()
    by = summary["stopped_by"]  # a signal's name, or a stop decided on another trainer process
    sys.exit(128 + (signal.Signals[by].value if by in signal.Signals.__members__
                    else signal.SIGTERM.value))
  logging.info("finished: %s", summary)


if __name__ == "__main__":
  app.run(main)
