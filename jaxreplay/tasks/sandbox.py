"""Running untrusted Python (a policy's tool call) in a subprocess with resource limits.

`run_python(code, timeout_s, memory_mib)` runs `code` in a fresh interpreter (`python -I -S`: no
user site, no environment variables read, an empty environment, the working directory a new empty
temporary directory removed afterwards) and returns a `Result` (status, output):

  limits      RLIMIT_AS = memory_mib (an allocation over it is a MemoryError), RLIMIT_CPU =
              ceil(timeout_s) + 1 s, RLIMIT_FSIZE = 0 (no file can be written), RLIMIT_NOFILE =
              32, RLIMIT_CORE = 0; the wall-clock `timeout_s` kills the whole process group.
  no files,   before the code runs, the child preloads `PRELOADED` (the standard library's math
  no network  modules) and installs an audit hook (PEP 578) that refuses every later `open`,
              `import` of a module not loaded yet, socket, subprocess / exec / fork / spawn,
              os.system, and the os calls that touch the file system; what is refused raises
              PermissionError inside the code (its output says so).
  output      stdout and stderr together, at most `max_output` characters (the rest cut, marked);
              an exception ends the output with its last line ("ZeroDivisionError: ...").

Statuses: "ok", "error" (the code raised, or was refused), "timeout", "killed" (a signal, e.g. the
CPU limit). The audit hook is a guard against a policy's accidents, not a security boundary
against an adversary (CPython code can reach around audit hooks through ctypes-like means, which
are refused here too, but a determined escape is out of scope): run untrusted code from outside
the training loop in a container.
"""
from __future__ import annotations

import dataclasses
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile

PRELOADED = ("math", "cmath", "fractions", "decimal", "itertools", "functools", "statistics",
             "collections", "random", "re", "string", "operator", "heapq", "bisect")
STATUSES = ("ok", "error", "timeout", "killed")

_REFUSED = ("open", "import", "socket.", "subprocess.", "os.system", "os.exec", "os.fork",
            "os.forkpty", "os.posix_spawn", "os.spawn", "os.kill", "os.remove", "os.rename",
            "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.chdir", "os.listdir",
            "os.scandir", "os.link", "os.symlink", "os.truncate", "os.utime", "shutil.",
            "ctypes.", "sys._getframe", "code.__new__", "marshal.loads", "pty.")

# The child: preload, install the hook, run stdin's code; an exception prints its last line.
_BOOTSTRAP = f"""
import sys
for _m in {PRELOADED!r}:
  __import__(_m)
_code = sys.stdin.read()
_REFUSED = {_REFUSED!r}
def _hook(event, args):
  if event.startswith(_REFUSED):
    raise PermissionError(f"the sandbox refuses {{event}}")
_program = compile(_code, "<tool>", "exec")
sys.addaudithook(_hook)
try:
  exec(_program, {{"__name__": "__main__"}})
except BaseException as _e:
  sys.stdout.flush()
  print(f"{{type(_e).__name__}}: {{_e}}")
  sys.stdout.flush()
  sys.exit(1)
"""


@dataclasses.dataclass(frozen=True)
class Result:
  status: str   # one of STATUSES
  output: str


def _limits(memory_mib: int, cpu_s: int):
  def apply():
    os.setsid()
    for limit, value in ((resource.RLIMIT_AS, memory_mib << 20), (resource.RLIMIT_CPU, cpu_s),
                         (resource.RLIMIT_FSIZE, 0), (resource.RLIMIT_NOFILE, 32),
                         (resource.RLIMIT_CORE, 0)):
      resource.setrlimit(limit, (value, value))
  return apply


def run_python(code: str, timeout_s: float = 5.0, memory_mib: int = 512,
               max_output: int = 2000) -> Result:
  """Runs `code` under the module docstring's limits; never raises for what the code does."""
  if not timeout_s > 0 or memory_mib < 64 or max_output < 1:
    raise ValueError(f"run_python: timeout_s={timeout_s} must be > 0, memory_mib={memory_mib} "
                     f">= 64 (the interpreter's own start-up), max_output={max_output} >= 1")
  workdir = tempfile.mkdtemp(prefix="jaxreplay-sandbox-")
  try:
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _BOOTSTRAP], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=workdir, env={},
                            preexec_fn=_limits(int(memory_mib), math.ceil(timeout_s) + 1))
    try:
      out, _ = proc.communicate(code.encode("utf-8", "replace"), timeout=timeout_s)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.communicate()
      return Result("timeout", f"TimeoutError: the code ran past {timeout_s:g} s")
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  text = out.decode("utf-8", "replace")
  if len(text) > max_output:
    text = text[:max_output] + f"\n[... {len(text) - max_output} characters cut]"
  if proc.returncode < 0:
    return Result("killed", text + f"Killed: signal {signal.Signals(-proc.returncode).name}")
  return Result("ok" if proc.returncode == 0 else "error", text.rstrip("\n"))
