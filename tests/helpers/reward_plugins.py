"""Reward plug-ins for the tests (`task.reward_fn="tests.helpers.reward_plugins:NAME"`): importable
by name in the reward child processes (the repository root is on the parent's sys.path, from
pyproject.toml's pytest pythonpath, which a child inherits; a launched run gets it on PYTHONPATH)."""
import os
import time

WARMUP = "\\boxed{1}"  # math_data.WARMUP_ARGS[0]: answered at once by every plug-in here


def digits(completion: str, answer: str) -> float:
  """1.0 when the completion's digits spell the answer; also records the scoring pid (as 1000 +
  pid % 1000 for completion "pid")."""
  if completion == "pid":
    return 1000.0 + os.getpid() % 1000
  if completion == "sleep":
    time.sleep(60)
  return float("".join(ch for ch in completion if ch.isdigit()) == answer)


def one_argument(completion):
  return float(bool(completion))


def returns_text(completion: str, answer: str):
  return "one"


def raises(completion: str, answer: str) -> float:
  raise KeyError("no such problem")


def rendezvous(completion: str, answer: str) -> float:
  """The first two calls (after warm-ups) each take a ticket and wait, up to 20 s, for the other:
  1.0 when both met (the two calls ran at the same time, in two processes), 0.0 when the wait
  ran out (they were serialised). Later calls answer 0.5 at once. The ticket files (in
  $JAXREPLAY_TEST_RENDEZVOUS) hold the pid of their call."""
  if completion == WARMUP:
    return 1.0
  root = os.environ["JAXREPLAY_TEST_RENDEZVOUS"]
  tickets = [os.path.join(root, f"ticket{i}") for i in range(2)]
  for ticket in tickets:
    try:
      fd = os.open(ticket, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
      continue
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    break
  else:
    return 0.5
  deadline = time.monotonic() + 20.0
  while time.monotonic() < deadline:
    if all(os.path.exists(t) for t in tickets):
      return 1.0
    time.sleep(0.01)
  return 0.0
