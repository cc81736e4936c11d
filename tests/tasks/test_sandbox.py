"""The sandbox for a policy's Python (`tasks.sandbox.run_python`): output, errors, the time and
memory limits, and what it refuses (files, network, processes, new imports)."""
import pytest

from jaxreplay.tasks import sandbox


@pytest.mark.parametrize("code,output", [
    ("print(2**10)", "1024"),
    ("import math\nprint(math.comb(10, 3))", "120"),
    ("from fractions import Fraction\nprint(Fraction(1, 3) + Fraction(1, 6))", "1/2"),
    ("x = 3\ny = x * x\nprint(y, end='')", "9"),
    ("", ""),
])
def test_runs_and_prints(code, output):
  assert sandbox.run_python(code, timeout_s=5.0) == sandbox.Result("ok", output)


@pytest.mark.parametrize("code,last_line", [
    ("print(1 / 0)", "ZeroDivisionError: division by zero"),
    ("print('a')\nraise ValueError('bad')", "ValueError: bad"),
    ("def f(:\n  pass", "SyntaxError"),
    ("x = bytearray(4 * 1024**3)", "MemoryError"),
    ("open('/etc/hostname').read()", "PermissionError: the sandbox refuses open"),
    ("open('out.txt', 'w').write('x')", "PermissionError: the sandbox refuses open"),
    ("import socket", "PermissionError: the sandbox refuses import"),
    ("import subprocess", "PermissionError: the sandbox refuses import"),
    ("__import__('ctypes')", "PermissionError: the sandbox refuses import"),
    ("import os\nos.system('echo hi')", "PermissionError: the sandbox refuses os.system"),
    ("import os\nos.fork()", "PermissionError: the sandbox refuses os.fork"),
    ("import os\nprint(os.listdir('/'))", "PermissionError: the sandbox refuses os.listdir"),
    ("import os\nos.remove('/tmp/x')", "PermissionError: the sandbox refuses os.remove"),
])
def test_errors_and_refusals_are_output(code, last_line):
  result = sandbox.run_python(code, timeout_s=5.0, memory_mib=512)
  assert result.status == "error"
  assert result.output.splitlines()[-1].startswith(last_line), result.output


def test_refused_code_leaves_no_file_and_sees_no_environment(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXREPLAY_SECRET", "s3cret")
  target = tmp_path / "written.txt"
  result = sandbox.run_python(f"open({str(target)!r}, 'w').write('x')")
  assert result.status == "error" and not target.exists()
  seen = sandbox.run_python("import os\nprint(sorted(os.environ))")
  assert seen.status == "ok" and "JAXREPLAY_SECRET" not in seen.output  # an empty environment


def test_time_limit_and_output_cap():
  result = sandbox.run_python("while True:\n  pass", timeout_s=1.0)
  assert result.status == "timeout" and "1 s" in result.output
  long = sandbox.run_python("print('a' * 5000)", max_output=100)
  assert long.status == "ok" and long.output.startswith("a" * 100)
  assert long.output.endswith("characters cut]")


def test_bad_limits():
  with pytest.raises(ValueError, match="timeout_s=0"):
    sandbox.run_python("print(1)", timeout_s=0)
  with pytest.raises(ValueError, match="memory_mib=8"):
    sandbox.run_python("print(1)", memory_mib=8)
