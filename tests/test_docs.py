"""The docs: `mkdocs build --strict` passes (no broken link, missing page or stale repository path;
docs/hooks.py maps the repository onto the site), README.md names no stale path, and every command
shown in README.md and docs/*.md runs as written on CPU (tests/helpers/doc_commands.py: how blocks
are marked, shortened, skipped)."""
import glob
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib

import pytest

from tests.helpers import doc_commands as dc
from tests.helpers.deps import require
from tests.helpers.paths import REPO

PAGES = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(f"{REPO}/docs/*.md"))
# What a command may read, copied into its scratch directory (it writes there, never into the repo).
INPUTS = ("configs", "assets", "bench", "launch")
TIMEOUT_S = 900


def load_hooks():
  spec = importlib.util.spec_from_file_location("docs_hooks", os.path.join(REPO, "docs", "hooks.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def read(page):
  with open(os.path.join(REPO, page), encoding="utf-8") as f:
    return f.read()


def user_env():
  """The environment of a user's shell: the suite's emulated devices and platform removed."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  env["NO_MKDOCS_2_WARNING"] = "1"
  return env


def mkdocs_build(config_file, site_dir):
  require("mkdocs")
  require("material")
  return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", config_file,
                         "-d", str(site_dir)], capture_output=True, text=True, timeout=300,
                        env=user_env())


def test_mkdocs_build_strict(tmp_path):
  out = mkdocs_build(os.path.join(REPO, "mkdocs.yml"), tmp_path / "site")
  assert out.returncode == 0, out.stderr[-4000:]
  assert "WARNING" not in out.stderr, out.stderr[-4000:]
  index = (tmp_path / "site" / "index.html").read_text()
  assert "Two commands" in index  # the README is the home page
  experiments = (tmp_path / "site" / "experiments" / "index.html").read_text()
  assert "Issue 26" in experiments  # EXPERIMENTS.md included
  assert (tmp_path / "site" / "experiments" / "figures" / "fig1_accuracy.png").exists()


def repo_copy_with_docs(tmp_path):
  """A repository whose top-level entries link to this one, with docs/ copied (to be damaged)."""
  root = tmp_path / "repo"
  root.mkdir()
  for name in os.listdir(REPO):
    if name not in ("docs", "site", ".git"):
      os.symlink(os.path.join(REPO, name), root / name)
  shutil.copytree(os.path.join(REPO, "docs"), root / "docs",
                  ignore=shutil.ignore_patterns("__pycache__"))
  return root


@pytest.mark.parametrize("damage, message", [
    ("`jaxreplay/config_defaults.py`", "names no file or module of the repository"),
    ("`jaxreplay.sweeps`", "names no file or module of the repository"),
    ("[a page](nosuch.md)", "is not found among documentation files"),
    ("[a section](gpu.md#nosuch-section)", "does not contain an anchor"),
])
def test_mkdocs_build_fails_on_a_broken_link_or_stale_path(tmp_path, damage, message):
  root = repo_copy_with_docs(tmp_path)
  with open(root / "docs" / "data.md", "a", encoding="utf-8") as f:
    f.write(f"\n{damage}\n")
  out = mkdocs_build(str(root / "mkdocs.yml"), tmp_path / "site")
  assert out.returncode != 0 and message in out.stderr, out.stderr[-3000:]


def test_hooks_map_links_and_reserved_pages():
  hooks = load_hooks()
  assert hooks.site_path("docs/gpu.md") == "gpu.md"
  assert hooks.site_path("EXPERIMENTS.md") == "experiments.md"
  assert hooks.site_path("experiments/figures/fig1_accuracy.png") == "experiments/figures/fig1_accuracy.png"
  assert hooks.site_path("jaxreplay/launch.py") is None
  text = "[g](docs/gpu.md#install) [e](EXPERIMENTS.md) ![f](experiments/figures/a.png) `[x](docs/y.md)`"
  assert hooks.rewrite_links(text, "README.md", "index.md") == (
      "[g](gpu.md#install) [e](experiments.md) ![f](experiments/figures/a.png) `[x](docs/y.md)`")
  assert hooks.rewrite_links("[r](../README.md)", "docs/lora.md", "lora.md") == "[r](index.md)"
  assert hooks.rewrite_links("[g](../gpu.md)", "docs/reference/x.md", "reference/x.md") == (
      "[g](../gpu.md)")
  nav = [{"Home": "index.md"}, {"Guides": [{"LoRA": "lora.md"}, {"Later": "nosuch-reserved.md"}]}]
  hooks.RESERVED["nosuch-reserved.md"] = "a test"
  try:
    assert hooks.drop_reserved(nav) == [{"Home": "index.md"}, {"Guides": [{"LoRA": "lora.md"}]}]
    assert hooks.rewrite_links("[later](nosuch-reserved.md)", "docs/a.md", "a.md") == "later"
  finally:
    del hooks.RESERVED["nosuch-reserved.md"]
  assert hooks.missing_paths("`run_metrics.py` `rollout/vllm_direct_load.py` `sweeps.py` "
                             "`jaxreplay.run.pipeline.run` `tests/test_docs.py::test_x`") == [
                                 "run_metrics.py", "rollout/vllm_direct_load.py"]


@pytest.mark.parametrize("page", ["README.md", "launch/README.md", "WORKSPACE.md", "EXPERIMENTS.md"])
def test_root_pages_name_no_stale_path(page):
  """The pages outside docs/ (the site checks docs/ and what it includes)."""
  assert load_hooks().missing_paths(read(page)) == []


def test_readme_is_a_front_door():
  readme = read("README.md")
  assert len(readme.split("\n")) <= 150
  links = re.findall(r"\]\((docs/[^)#]+)", readme)
  hooks = load_hooks()
  for link in links:
    assert os.path.exists(os.path.join(REPO, link)) or link[len("docs/"):] in hooks.RESERVED, link
  pages = {os.path.relpath(p, REPO) for p in glob.glob(f"{REPO}/docs/*.md")} - {"docs/index.md"}
  assert pages <= set(links), f"pages the README does not link: {sorted(pages - set(links))}"


def test_readme_test_command_is_what_ci_runs():
  (ci,) = [b for b in dc.blocks("README.md", read("README.md")) if b.kind == "ci"]
  (command,) = dc.commands(ci.text)
  with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as f:
    assert dc.segments(command) == dc.ci_steps(f.read())


def test_extras_named_by_install_commands_exist():
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    extras = set(tomllib.load(f)["project"]["optional-dependencies"])
  with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as f:
    ci_extras, _ = dc.split_install(" && ".join(dc.ci_steps(f.read())))
  for page in PAGES:
    for block in dc.blocks(page, read(page)):
      for command in dc.commands(block.text):
        named, _ = dc.split_install(command)
        assert set(named) <= extras, (block.where, named)
        if block.kind == "run":  # run here: the environment must hold what it installs
          assert set(named) <= set(ci_extras), (block.where, named)


@pytest.mark.parametrize("page", PAGES)
def test_commands_are_in_marked_bash_blocks(page):
  text = read(page)
  assert not set(dc.fence_languages(text)) & set(dc.SHELL_LANGUAGES), (
      f"{page}: put commands in ```bash blocks")
  for line in text.split("\n"):
    if "cpu-check" in line:
      assert dc.MARKER.match(line.strip()), f"{page}: malformed marker {line!r}"
  for block in dc.blocks(page, text):
    if block.kind == "pending":
      assert dc.expected_output(block.reason), f"{block.where}: quote the failure it expects"
  loose = [c for c in dc.inline_commands(text) if not re.search(dc.DRY[0][0], c)]
  assert not loose, f"{page}: commands in prose: {loose}; show them in a ```bash block"


def scratch_repo(tmp_path, texts):
  root = tmp_path / "repo"
  root.mkdir()
  for name in INPUTS + (("experiments",) if any(re.search(r"[= ]experiments\b", t) for t in texts)
                        else ()):
    shutil.copytree(os.path.join(REPO, name), root / name, symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
  return root


def run(command, cwd):
  return subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=cwd, env=user_env(),
                        capture_output=True, text=True, timeout=TIMEOUT_S)


def check_not_run(block, cwd):
  """A skipped block: its repository paths exist, its sweeps plan (--dry_run)."""
  hooks = load_hooks()
  for command in dc.commands(block.text):
    for token in re.split(r"[\s=]+", command):
      path = hooks.repo_path(token.strip("'\""))
      assert path is None or os.path.exists(os.path.join(REPO, path)), (block.where, token)
    _, rest = dc.split_install(re.sub(r"^\S+\$ ", "", command))
    for segment in dc.segments(rest):
      if any(re.search(pattern, segment) for pattern, _ in dc.DRY):
        out = run(dc.with_table(segment, dc.DRY), cwd)
        assert out.returncode == 0, (block.where, segment, out.stderr[-3000:])


def check_covered(block):
  test_file, _, _ = block.reason.partition(" ")
  path = os.path.join(REPO, test_file)
  assert os.path.exists(path), (block.where, test_file)
  source = read(test_file)
  for command in dc.commands(block.text):
    words = shlex.split(command)
    script = os.path.basename(words[1] if words[0] == "python" else words[0])
    for name in [script] + [w.split("=")[0] for w in words if w.startswith("--")]:
      assert name.lstrip("-") in source, f"{block.where}: {test_file} does not run {name}"


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_page_commands_run_as_written(page, tmp_path):
  """Every block of the page, in order, in one scratch directory (later blocks use what earlier
  ones made: the plot reads the runs above it)."""
  text = read(page)
  page_blocks = dc.blocks(page, text)
  cwd = scratch_repo(tmp_path, [b.text for b in page_blocks] + dc.inline_commands(text))
  for block in page_blocks:
    if block.kind == "ci":
      continue  # test_readme_test_command_is_what_ci_runs
    if block.kind == "skip":
      check_not_run(block, cwd)
      continue
    if block.kind == "covered":
      check_covered(block)
      continue
    for command in dc.commands(block.text):
      _, rest = dc.split_install(command)
      if not rest:
        continue
      out = run(dc.with_table(rest, dc.SHORTEN), cwd)
      log = f"{block.where}: {rest}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
      if block.kind == "pending":
        assert out.returncode != 0, (
            f"{block.where} now runs: turn its `pending` marker into a plain block\n{log}")
        assert dc.expected_output(block.reason) in out.stdout + out.stderr, log
        break  # the rest of a pending block depends on the fix
      assert out.returncode == 0, log
  for command in dc.inline_commands(text):  # the sweeps cited in prose: planned, not run
    out = run(dc.with_table(command, dc.DRY), cwd)
    assert out.returncode == 0, (page, command, out.stderr[-3000:])
