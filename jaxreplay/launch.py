r"""Entry point: `python -m jaxreplay.launch --config=configs/tiny.py --workdir=runs/tiny`.

Config values are overridden on the command line (`--config.buffer.size=84`). Re-running the same
command resumes from the newest checkpoint in --workdir. `--print_config` prints every key of the
config with its value and meaning; docs/reference/configuration.md lists them all.

Before anything is created (the workdir, its lock) or JAX starts, the command line, the config,
the workdir and the devices are checked; a problem is one line, `error: <what>; <the fix>`, and
exit status 2 (`--debug` shows a traceback instead). `--dry_run` checks the same and prints the
per-device memory plan (a CPU machine emulates the config's trainer devices for it).
`--dry_run --compile_for=h100` (any target of `jaxreplay.config.gpu_targets`) also compiles every
program the run runs on its trainer GPUs for that GPU, without one (`run.gpu_compile`; needs
`pip install -e '.[gpu-compile]'`), and judges the fit by XLA's own per-device peak.

The console shows what starts (config, model, devices, backends), each evaluation, progress lines
with an ETA and a summary at the end; WORKDIR/run.log keeps every log record in absl's format.
Ctrl-C (SIGINT) or SIGTERM during start-up (checks, build, compiles, the step-0 evaluation) stops
at once (nothing is trained yet);
afterwards the run stops after the current step with a checkpoint; a second one exits at once.

Exit status: 0 when the run finished; 2 for an invalid command line or config; 128 + the signal's
number (143 for SIGTERM, 130 for Ctrl-C) when a signal stopped it (rerun the command to resume);
3 for a run that cannot go on as configured (busy workdir, repeated non-finite updates, no
restorable checkpoint, a failed checkpoint write, too little /dev/shm for the weight slots, a
--dry_run plan that does not fit), with a one-line message and no traceback; 1 for other errors
(one line; the traceback in WORKDIR/run.log).
"""
from __future__ import annotations

import os
import signal
import sys
import time

# Until the run's own handler is installed (in `main`), Ctrl-C exits quietly (nothing started yet).
signal.signal(signal.SIGINT, lambda signum, frame: os._exit(128 + signum))  # pylint: disable=W0212
# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from jaxreplay.config import command_line
from jaxreplay.config import gpu_targets
from jaxreplay.infra import console_log
from jaxreplay.infra import safety
# pylint: enable=g-import-not-at-top,wrong-import-position

_T0 = time.monotonic()

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
_PRINT_CONFIG = flags.DEFINE_bool(
    "print_config", False, "Print the resolved config (every key, its value and its meaning) and "
    "exit; --workdir is not needed.")
_DEBUG = flags.DEFINE_bool(
    "debug", False, "Show tracebacks instead of one-line errors, and every library's log lines "
    "with absl's prefix.")

_HELP = ("--help", "-help", "-h", "-?", "--helpshort")
_MAIN_FLAGS = ("config", "workdir", "dry_run", "compile_for", "print_config", "debug", "process_id",
               "num_processes", "coordinator_address")
LOG_NAME = "run.log"


def usage() -> str:
  """`--help`: what the launcher does, its flags and where the config keys are explained."""
  lines = [__doc__.strip(), "", "flags:"]
  for name in _MAIN_FLAGS:
    flag = flags.FLAGS[name]
    lines.append(f"  --{name}: {flag.help}")
  lines += ["  --config.<key>=<value>: override one config key, e.g. --config.buffer.size=128",
            "", "config keys: python -m jaxreplay.launch --config=configs/tiny.py --print_config "
            "prints each key's value and meaning; docs/reference/configuration.md lists every key "
            "with its default (python -m jaxreplay.config.reference writes it). --helpfull lists "
            "absl's flags too."]
  return "\n".join(lines)


def fail(message: str, status: int = 2) -> None:
  """Prints `error: <message>` as one line (the lines of `message` joined) and exits."""
  console_log.flush()
  text = " | ".join(line.strip() for line in str(message).strip().splitlines() if line.strip())
  print(f"error: {text}", file=sys.stderr, flush=True)
  sys.exit(status)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing behind the launcher's own checks: --help exits 0, a bad command line
  exits 2 with one line (`config.command_line`)."""
  if any(a in _HELP for a in argv[1:]):
    print(usage())
    sys.exit(0)
  if "--helpfull" in argv[1:]:
    print(flags.FLAGS.get_help())
    sys.exit(0)
  debug = "--debug" in argv[1:]
  try:
    command_line.check(argv)
    return flags.FLAGS(argv)
  except command_line.CommandLineError as e:
    if debug:
      raise
    fail(str(e))
  except Exception as e:  # pylint: disable=broad-except  (absl's and ml_collections' parse errors)
    if debug:
      raise
    fail(command_line.describe(e, argv))
  return []


def check(config, workdir, dry_run: bool, compile_for=None):
  """Every check before a side effect, in the order that lets each one trust the ones before:
  the workdir, the counts the device split reads, --compile_for's plugin, the devices (this
  process's environment set for JAX, which is not started), the config's validation, the mesh and
  batch rules on the planned mesh, a resume's compatibility. Returns the
  `config.platform.Platform`; raises `validation.ConfigError` or `platform.PlatformError`."""
  from jaxreplay.config import host_devices  # pylint: disable=g-import-not-at-top
  from jaxreplay.config import key_rules  # pylint: disable=g-import-not-at-top
  from jaxreplay.config import platform  # pylint: disable=g-import-not-at-top
  from jaxreplay.config import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  errors = workdir_lib.workdir_errors(workdir) if workdir else []
  errors = errors or key_rules.count_errors(config)
  if compile_for and not host_devices.cuda_plugin_installed():
    errors.append(f"--compile_for={compile_for} needs JAX's CUDA plugin (no GPU needed); "
                  "pip install -e '.[gpu-compile]'")
  if errors:
    raise platform.PlatformError("\n".join(errors))
  plat = platform.prepare(config, dry_run=dry_run, compile_for=compile_for)
  from jaxreplay.config import memory_plan  # pylint: disable=g-import-not-at-top  (imports JAX)
  from jaxreplay.config import validation  # pylint: disable=g-import-not-at-top
  validation.validate_config(config)
  errors = memory_plan.batch_rule_errors(config, platform.planned_mesh(config, plat, dry_run))
  if errors:
    raise validation.ConfigError(errors)
  if workdir:
    validation.check_resume(config, workdir)
  return plat


def latest_checkpoint(workdir: str):
  """The newest committed checkpoint step in `workdir`, or None."""
  ckpt_dir = os.path.join(workdir, "checkpoints")
  steps = [int(n) for n in os.listdir(ckpt_dir) if n.isdigit()] if os.path.isdir(ckpt_dir) else []
  return max(steps) if steps else None


def start_hint(workdir: str) -> str:
  step = latest_checkpoint(workdir) if workdir and os.path.isdir(workdir) else None
  return ("rerun the same command to start the run" if step is None else
          f"rerun the same command to resume from step {step}")


def main(argv):
  if len(argv) > 1:
    fail(f"unexpected arguments {argv[1:]}; flags take the form --name=value")
  log_file = console_log.setup(debug=_DEBUG.value)
  config, dry_run = _CONFIG.value, _DRY_RUN.value or _COMPILE_FOR.value is not None
  workdir = os.path.abspath(os.path.expanduser(_WORKDIR.value)) if _WORKDIR.value else None
  if workdir is None and not _PRINT_CONFIG.value:
    fail("--workdir is missing; give the run directory, e.g. --workdir=runs/tiny (a rerun "
         "resumes it)")
  with safety.StopSignals(startup=True, hint=start_hint(workdir)) as stop:
    try:
      run(config, workdir, dry_run, stop, log_file)
    except safety.StartupInterrupted as e:
      logging.warning("%s during start-up: stopped before the run started (nothing to "
                      "save); %s", e.signame, start_hint(workdir))
      console_log.flush()
      # The run's `with` blocks have closed what it started (workers, engines, writers). Exit
      # without the interpreter's shutdown: it would join threads still inside a JAX compile or a
      # generate call, and XLA's own threads can crash its finalisation (seen: a segfault 17 s
      # after a SIGTERM during the first step's compile).
      os._exit(128 + signal.Signals[e.signame].value)  # pylint: disable=protected-access


def run(config, workdir, dry_run: bool, stop: safety.StopSignals, log_file) -> None:
  """Checks, then prints the config (--print_config), plans (--dry_run) or runs."""
  try:
    plat = check(config, workdir, dry_run, _COMPILE_FOR.value)
  except ValueError as e:  # validation.ConfigError, platform.PlatformError: the config's problems
    if _DEBUG.value:
      raise
    fail("\n".join(getattr(e, "errors", [str(e)])))
  from jaxreplay.config import resolve  # pylint: disable=g-import-not-at-top
  if _PRINT_CONFIG.value:
    from jaxreplay.config import reference  # pylint: disable=g-import-not-at-top
    print(reference.format_config(resolve.resolve(config)), flush=True)
    return
  from jaxreplay.run import console  # pylint: disable=g-import-not-at-top
  process = _PROCESS_ID.value or 0
  log_path = os.path.join(workdir, LOG_NAME if not process else f"run.process{process}.log")
  logging.info("%s", console.banner(config, _config_file(), workdir, plat.describe(),
                                    latest_checkpoint(workdir), log_path))
  log_file.open(log_path)  # the workdir exists from here on
  if dry_run:
    from jaxreplay.config import memory_plan  # pylint: disable=g-import-not-at-top
    try:
      if _COMPILE_FOR.value:
        from jaxreplay.run import gpu_compile  # pylint: disable=g-import-not-at-top
        gpu_compile.dry_run(resolve.resolve(config), workdir, _COMPILE_FOR.value, plat.split)
      else:
        memory_plan.dry_run(resolve.resolve(config), workdir, plat.split)
    except memory_plan.DoesNotFit as e:
      logging.error("DoesNotFit: %s", e)
      console_log.flush()
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
  from jaxreplay.rollout.weights import shm_publisher  # pylint: disable=g-import-not-at-top
  stop_errors = (safety.WorkdirBusy, safety.NonFiniteUpdates,
                 checkpoint.NoRestorableCheckpoint, checkpoint.CheckpointSaveError,
                 shm_publisher.ShmSpaceError)
  try:
    summary = pipeline.run(config, workdir, stop=stop)
  except stop_errors as e:
    logging.error("%s: %s", type(e).__name__, e)
    console_log.flush()
    sys.exit(3)
  except Exception as e:  # pylint: disable=broad-except  (one line here, the traceback in run.log)
    if _DEBUG.value:
      raise
    logging.error("%s: %s (traceback in %s; --debug shows it here)", type(e).__name__,
                  " | ".join(line.strip() for line in str(e).splitlines() if line.strip()),
                  log_path, exc_info=True)
    console_log.flush()
    sys.exit(1)
  logging.info("finished: %s", summary, extra={console_log.FILE_ONLY: True})
  wall = time.monotonic() - _T0
  if "stopped_by" in summary:
    by = summary["stopped_by"]  # a signal's name, or a stop decided on another trainer process
    logging.info("%s", console.summary(
        workdir, wall, f"stopped by {by} at step {summary['step']} after saving a checkpoint "
        "(rerun the same command to resume)"))
    console_log.flush()
    sys.exit(128 + (signal.Signals[by].value if by in signal.Signals.__members__
                    else signal.SIGTERM.value))
  logging.info("%s", console.summary(workdir, wall, f"finished at step {summary['step']}"))


def _config_file() -> str:
  return command_line.config_arg(sys.argv) or "?"


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
