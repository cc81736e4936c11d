r"""Entry point: `python -m jaxreplay.launch --config=configs/tiny.py --workdir=runs/tiny`.

Config values are overridden on the command line (`--config.buffer.size=84`); the config is locked, so a
misspelled key is an error that names it. Re-running the same command resumes from the newest
checkpoint in --workdir.

`--dry_run` prints the per-device memory plan and exits (3 when it does not fit).
`--dry_run --compile_for=h100` (any target of `jaxreplay.config.gpu_targets`) also compiles every
program the run runs on its trainer GPUs for that GPU, without one (`run.gpu_compile`; needs
`pip install -e '.[gpu-compile]'`), and judges the fit by XLA's own per-device peak.

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

from jaxreplay.config import gpu_targets

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
_COMPILE_FOR = flags.DEFINE_enum(
    "compile_for", None, gpu_targets.names(), "With --dry_run (implied): compile every program "
    "the run runs on its trainer GPUs for this GPU, deviceless (JAX's CUDA plugin: pip install -e "
    "'.[gpu-compile]'); plan.json gains XLA's per-program memory, the collectives and the step "
    "time, and the fit check uses XLA's largest peak against devices.memory_fraction x the GPU's "
    "memory.")
flags.mark_flags_as_required(["config", "workdir"])


def _dry_run(split) -> None:
  """--dry_run (and --compile_for): the plan, plan.json, exit 3 when it does not fit."""
  from jaxreplay.config import memory_plan  # pylint: disable=g-import-not-at-top
  from jaxreplay.config import resolve  # pylint: disable=g-import-not-at-top
  from jaxreplay.config import validation  # pylint: disable=g-import-not-at-top
  validation.validate_config(_CONFIG.value)
  config = resolve.resolve(_CONFIG.value)  # "auto" made, frozen: what the run would read
  workdir = os.path.abspath(os.path.expanduser(_WORKDIR.value))
  try:
    if _COMPILE_FOR.value:
      from jaxreplay.run import gpu_compile  # pylint: disable=g-import-not-at-top
      gpu_compile.dry_run(config, workdir, _COMPILE_FOR.value, split)
    else:
      memory_plan.dry_run(config, workdir, split)
  except memory_plan.DoesNotFit as e:
    logging.error("DoesNotFit: %s", e)
    logging.flush()
    sys.exit(3)


class _QuietLibraries:
  """Drops INFO lines of orbax (dozens per checkpoint); warnings and errors still show."""

  def filter(self, record):
    return record.levelno >= 30 or "orbax" not in record.pathname


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.get_absl_handler().addFilter(_QuietLibraries())
  from jaxreplay.config import devices  # pylint: disable=g-import-not-at-top
  from jaxreplay.config import host_devices  # pylint: disable=g-import-not-at-top
  dry_run = _DRY_RUN.value or _COMPILE_FOR.value is not None
  if _COMPILE_FOR.value and not host_devices.cuda_plugin_installed():
    sys.exit(f"--compile_for={_COMPILE_FOR.value} needs JAX's CUDA plugin (no GPU needed): "
             "pip install -e '.[gpu-compile]'")
  split = devices.apply_to_environment(_CONFIG.value)  # before JAX picks its devices
  if split is not None:
    logging.info("GPUs: trainer %s, rollout workers %s", ",".join(split.trainer),
                 ",".join(split.workers) or "none")
  if not host_devices.jax_started():  # no GPU here: JAX_PLATFORMS, the dry run's host devices
    host_devices.cpu_environment(
        gpus_visible=split is not None,
        dry_run_devices=int(_CONFIG.value.trainer.num_devices)
        if dry_run and not _COMPILE_FOR.value else 0)
  if dry_run:
    _dry_run(split)
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
