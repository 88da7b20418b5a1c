"""JAX's persistent compilation cache under train.py: a repeated run compiles nothing new.

Two runs of the same short training in fresh processes share a cache directory (every
program written, whatever its compile time): the second adds no entry, since it loads every
program the first wrote, and trains to the same numbers.
"""

import json
import os
import pathlib
import subprocess
import sys

from fdg_jax.runtime import compile_cache

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _train(workdir, cache):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["FDG_JAX_CACHE_MIN_COMPILE_S"] = "0"
  cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/default.py"),
         "--workdir", str(workdir), "--config.progress_bar=False", "--config.max_steps=12",
         "--config.num_stages=2", "--config.model_kwargs.widths=(16,16)",
         f"--config.compilation_cache={cache}"]
  p = subprocess.run(cmd, capture_output=True, text=True, cwd=str(ROOT), env=env, timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [r for r in map(json.loads, f) if r.get("kind") != "train"][-1]


def test_a_repeated_run_loads_every_program_from_the_cache(tmp_path):
  cache = tmp_path / "cache"
  first = _train(tmp_path / "a", cache)
  written = set(os.listdir(cache))
  assert len(written) >= 3, written
  second = _train(tmp_path / "b", cache)
  assert set(os.listdir(cache)) == written
  for key in ("test_loss", "test_accuracy", "train_loss"):
    assert first[key] == second[key]


def test_off_is_no_cache_and_auto_a_user_directory(tmp_path, monkeypatch):
  assert compile_cache.resolve("off") is None and compile_cache.resolve("") is None
  monkeypatch.setenv("FDG_JAX_CACHE_DIR", str(tmp_path / "mine"))
  assert compile_cache.resolve("auto") == str(tmp_path / "mine")
  monkeypatch.delenv("FDG_JAX_CACHE_DIR")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert compile_cache.resolve("auto") == str(tmp_path / "xdg" / "fdg_jax" / "xla")
