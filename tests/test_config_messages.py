"""A mistyped or unknown config field: one plain line, the closest field, exit code 2."""

import os
import subprocess
import sys
from pathlib import Path

import ml_collections
import pytest

from fdg_jax.config_check import unknown_override

ROOT = Path(__file__).resolve().parents[1]


def _cli(*overrides, config="configs/default.py"):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  p = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / config),
                      "--workdir", "/nonexistent/never-written", *overrides],
                     capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=300)
  lines = [l for l in p.stderr.splitlines() if l.strip()]
  assert p.returncode == 2, p.stderr[-2000:]
  assert len(lines) == 1, p.stderr[-2000:]
  assert "Traceback" not in p.stderr and "\\n" not in lines[0] and "KeyError" not in lines[0]
  return lines[0]


def test_mistyped_top_level_field():
  line = _cli("--config.learning_rat=0.1")
  assert line == ("config error: unknown config field 'learning_rat' (in "
                  "--config.learning_rat=0.1); did you mean --config.learning_rate?")


def test_mistyped_nested_field():
  # cifar10's model_kwargs is a group of free parameters, empty by default
  line = _cli("--config.model_kwargs.widht=2", config="configs/cifar10.py")
  assert line.startswith("config error: unknown config field 'model_kwargs.widht' (in "
                         "--config.model_kwargs.widht=2); model_kwargs takes new parameters "
                         "as one JSON value, --config.model_kwargs='{\"widht\": ...}'")
  assert _cli("--config.num_stages.k=2") == (
      "config error: --config.num_stages.k: --config.num_stages is a value, not a group of "
      "fields")


def test_unknown_optimizer_keyword():
  line = _cli("--config.optimizer=muon", "--config.optimizer_kwargs={\"betaa\": 0.9}")
  assert line.startswith("config error: optimizer 'muon' has no parameter betaa; did you "
                         "mean beta instead of betaa?; its parameters: ")


def test_unknown_override_names_the_closest_field_at_its_level():
  c = ml_collections.ConfigDict({"lr": 0.1, "model": {"width": 4, "depth": 2}, "opt_kwargs": {}})
  assert unknown_override(c, ["--config.lr=1", "--config.model.width=8"]) is None
  assert unknown_override(c, ["--config.model.widht=8"]) == (
      "unknown config field 'model.widht' (in --config.model.widht=8); did you mean "
      "--config.model.width?")
  assert unknown_override(c, ["--config.qqqq=1"]).endswith("docs/configs.md lists every field")
  assert "one JSON value" in unknown_override(c, ["--config.opt_kwargs.b1=0.9"])
  assert unknown_override(c, ["--workdir=x", "--config", "f.py"]) is None


def test_unknown_shrink_at_value():
  assert _cli("--config.shrink_at=weights") == (
      "config error: unknown shrink_at 'weights'; use --config.shrink_at=gradient|update")
