"""The launcher's command line checked before absl parses it: one line per problem, with the fix."""
import pytest

from jaxreplay.config import command_line
from jaxreplay.config import defaults


def test_nearest_keys():
  known = command_line.keys(defaults.base_config())
  assert "trainer" in known and "trainer.learning_rate" in known  # sections too
  assert command_line.nearest_keys("trainer.learnin_rate", known) == ["trainer.learning_rate"]
  assert command_line.nearest_keys("trainr.learning_rate", known) == ["trainer.learning_rate"]
  assert command_line.nearest_keys("buffer.learning_rate", known) == ["sft.learning_rate",
                                                                      "trainer.learning_rate"]
  assert command_line.nearest_keys("rollout.grup_size", known) == ["rollout.group_size"]
  assert command_line.nearest_keys("zzzz.qqqq", known) == []


def test_overrides_of_an_argv():
  argv = ["launch", "--config=configs/tiny.py", "--config.buffer.size=3", "--noconfig.model.remat",
          "--config.seed", "4", "--workdir=x"]
  assert command_line.config_arg(argv) == "configs/tiny.py"
  assert command_line.config_arg(["launch", "--config", "a.py"]) == "a.py"
  assert command_line.overrides(argv) == [("--config.buffer.size=3", "buffer.size", "3"),
                                          ("--noconfig.model.remat", "model.remat", None),
                                          ("--config.seed", "seed", "4")]


def test_check_names_each_problem(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "tiny.py").write_text(
      "from jaxreplay.config.defaults import base_config\ndef get_config():\n  return base_config()\n")
  (tmp_path / "configs" / "none.py").write_text("def get_config():\n  return 3\n")
  cases = {
      (): "--config is missing",
      ("--config=configs/tiyn.py",): "does not exist; did you mean --config=configs/tiny.py?",
      ("--config=nodir/tiny.py",): "no directory 'nodir'",
      ("--config=configs/none.py", "--config.seed=1"): "get_config() returned int, not a ConfigDict",
      ("--config=configs/tiny.py", "--config.buffer.sizee=1"):
          "--config.buffer.sizee: configs/tiny.py has no such key; did you mean --config.buffer.size?",
      ("--config=configs/tiny.py", "--config.buffer=1"): "--config.buffer is a section, not a key",
  }
  for args, expected in cases.items():
    with pytest.raises(command_line.CommandLineError) as e:
      command_line.check(["launch", *args])
    assert expected in str(e.value), (args, str(e.value))
  command_line.check(["launch", "--config=configs/tiny.py", "--config.buffer.size=3"])  # fine


def test_describe_words_absl_errors(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "c.py").write_text(
      "from jaxreplay.config.defaults import base_config\ndef get_config():\n  return base_config()\n")
  argv = ["launch", "--config=c.py"]
  cases = {
      "flag --config.buffer.size=x: invalid literal for int() with base 10: 'x'":
          "--config.buffer.size=x: expected an integer; e.g. --config.buffer.size=84",
      "flag --config.model.remat=maybe: ('Non-boolean argument to boolean flag', 'maybe')":
          "--config.model.remat=maybe: expected true or false; e.g. --config.model.remat=False",
      "Unknown command line flag 'workdri'. Did you mean: workdir ?":
          "--workdri: no such flag; did you mean --workdir?",
      "Unknown command line flag 'zzz'": "--zzz: no such flag; see python -m jaxreplay.launch --help",
  }
  for message, expected in cases.items():
    assert command_line.describe(ValueError(message), argv).startswith(expected), message
