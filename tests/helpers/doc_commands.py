"""The commands shown in README.md and docs/*.md, read the way tests/test_docs.py runs them.

A command is a line of a ```bash block (continuation lines joined). The comment line right before a
block says how the block is checked (`MARKER`):
  (none)                                 run as written, `SHORTEN`'s overrides appended
  <!-- cpu-check: skip (WHY) -->         not run (needs a GPU or a cluster, a server, hours); its
                                         repository paths must exist, and an experiments sweep is
                                         planned with --dry_run (`DRY`)
  <!-- cpu-check: covered (TEST ...) --> run by the test module TEST, which must name the command's
                                         script and flags
  <!-- cpu-check: pending (WHY "OUT") --> fails today until another branch lands: run, and it must
                                         fail printing OUT; once it passes, the test says to drop
                                         the marker
  <!-- cpu-check: ci -->                 the README's test command: the steps of .ci/run
Install steps at the start of a block (`INSTALL_STEPS`) are not rerun: the test runs in the
environment .ci/run built with exactly those installs (their extras are checked instead).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Optional

MARKER = re.compile(r"^<!-- cpu-check: (skip|covered|pending) \((.+)\) -->$|^<!-- cpu-check: (ci) -->$")
FENCE = re.compile(r"^```(\S*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
# Fence languages that would hide a command from the test: commands go in ```bash blocks.
SHELL_LANGUAGES = ("sh", "shell", "console", "shell-session", "bash-session", "zsh")
# Appended to a command matching the pattern, so a command that takes minutes runs in seconds; the
# rest of the command runs as written (the last value of a repeated flag wins in absl, argparse and
# ml_collections alike).
SHORTEN = (
    (r"python -m jaxreplay\.launch\b(?!.*--dry_run)",
     "--config.total_steps=6 --config.eval.num_problems=16"),
    (r"python -m jaxreplay\.sft\b", "--sft_steps=25"),  # > its 20 warm-up steps
    (r"python bench/bench_weight_sync\.py\b", "--quick --transports shm"),
    (r"python bench/bench_pool_fill\.py\b", "--quick"),
    (r"python bench/bench_buffer\.py\b", "--quick"),
    (r"python bench/profile_train_step\.py\b", "--steps 1 --shapes small"),
    (r"python bench/bench_dots\.py\b", "--rounds 1 --repeats 1 --libraries default,eigen"),
    (r"python bench/bench_train_step\.py\b", "--rounds 1 --steps 1 --shapes small,tiny_default"),
    (r"python bench/bench_console\.py\b", "--reps 1"),
)
# Appended to a command that is not run (skipped, or cited in prose) to check it without running it.
DRY = ((r"python -m jaxreplay\.experiments\b", "--dry_run"),)
# Leading steps that make the environment the test already runs in.
INSTALL_STEPS = (
    r"python3 -m venv \.venv",
    r"\. \.venv/bin/activate",
    r"pip install -e (?:\.|'\.\[(?P<extras>[a-z0-9,\-]+)\]')",
    r"bash install\.sh(?: (?P<extras>[a-z0-9,\-]+))?",
)
# Programs whose code spans in prose count as commands once they take arguments.
PROGRAMS = ("python ", "python3 ", "pip ", "bash ", "mkdocs ", "launch/", "tensorboard ", "CI=")


@dataclasses.dataclass
class Block:
  page: str
  line: int
  text: str
  kind: str               # "run", "skip", "covered", "pending", "ci"
  reason: Optional[str]   # the marker's parenthesis

  @property
  def where(self) -> str:
    return f"{self.page}:{self.line}"


def blocks(page: str, markdown: str) -> list[Block]:
  """The ```bash blocks of a page with their markers."""
  found = []
  for fence in FENCE.finditer(markdown):
    if fence.group(1) != "bash":
      continue
    before = markdown[:fence.start()].rstrip("\n").rsplit("\n", 1)[-1]
    marker = MARKER.match(before.strip())
    kind, reason = ("run", None)
    if marker:
      kind, reason = (marker.group(3), None) if marker.group(3) else marker.group(1, 2)
    line = markdown.count("\n", 0, fence.start()) + 1
    found.append(Block(page, line, fence.group(2), kind, reason))
  return found


def fence_languages(markdown: str) -> list[str]:
  return [fence.group(1) for fence in FENCE.finditer(markdown)]


def commands(text: str) -> list[str]:
  """The command lines of a block: continuations joined, comment lines and comments dropped."""
  joined = re.sub(r"\\\n\s*", " ", text)
  lines = [strip_comment(line).strip() for line in joined.split("\n")]
  return [line for line in lines if line]


def strip_comment(line: str) -> str:
  """The line without a trailing `# ...` comment (a # inside quotes or a word is kept)."""
  quote = None
  for i, ch in enumerate(line):
    if quote:
      quote = None if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch == "#" and (i == 0 or line[i - 1].isspace()):
      return line[:i].rstrip()
  return line


def segments(command: str) -> list[str]:
  """A command line cut at its top-level `&&` and `;`."""
  return [s.strip() for s in re.split(r"\s*(?:&&|;)\s*", command) if s.strip()]


def split_install(command: str) -> tuple[list[str], str]:
  """(the extras the leading install steps name, the rest of the command line)."""
  extras, rest = [], segments(command)
  while rest:
    match = next((m for m in (re.fullmatch(step, rest[0]) for step in INSTALL_STEPS) if m), None)
    if match is None:
      break
    if "extras" in match.re.groupindex and match.group("extras"):
      extras += match.group("extras").split(",")
    rest = rest[1:]
  return extras, " && ".join(rest)


def with_table(command: str, table) -> str:
  """Each segment of the command with the first matching entry's arguments appended."""
  out = []
  for segment in segments(command):
    for pattern, extra in table:
      if re.search(pattern, segment):
        segment = f"{segment} {extra}"
        break
    out.append(segment)
  return " && ".join(out)


def inline_commands(markdown: str) -> list[str]:
  """Code spans in prose (outside fences) that are commands with arguments; a synopsis (a word in
  capitals, `[optional]`: `launch/gpu_check.sh OUT [flags]`) is not a command."""
  prose = FENCE.sub("", markdown)
  found = []
  for span in re.findall(r"`([^`\n]+)`", prose):
    if not span.startswith(PROGRAMS):
      continue
    words = span.split()
    program_words = 3 if words[:2] in (["python", "-m"], ["python3", "-m"]) else 1
    synopsis = any(re.fullmatch(r"[A-Z_]+|\[.*\]", word) for word in words)
    if len(words) > program_words and not synopsis:
      found.append(span)
  return found


def ci_steps(ci_script: str) -> list[str]:
  """The steps of .ci/run that a user runs too: no shell set-up, no pip `-q`, no `|| true`, no pip
  self-upgrade."""
  steps = []
  for line in ci_script.split("\n"):
    line = strip_comment(line).strip()
    if not line or re.match(r"^(set |cd |export |pip install -q --upgrade pip$)", line):
      continue
    line = re.sub(r"\s*\|\|\s*true$", "", line)
    if line.startswith("pip "):
      line = " ".join(word for word in line.split() if word != "-q")
    steps.append(line)
  return steps


def expected_output(reason: str) -> Optional[str]:
  """The quoted failure text of a pending marker's reason."""
  match = re.search(r'"([^"]+)"', reason)
  return match.group(1) if match else None
