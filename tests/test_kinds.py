"""Datasets as registered specs: a user's images and a user's token stream train through the
trainer by name with no library change; the built-ins go through the same seam."""

import pathlib
import sys

import numpy as np
import pytest

from fdg_jax import data, trainer
from fdg_jax.data import kinds, text

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from test_trainer import load_config, read_metrics, tiny_config  # noqa: E402


def _bright(split, config):
  """8x8 images whose label says whether they are bright (pixels 0..16 like the digits,
whose normalisation they borrow): learnable in a few steps."""
  rng = np.random.default_rng(0 if split == "train" else 1)
  n = 512 if split == "train" else 128
  labels = rng.integers(0, 2, n).astype(np.int32)
  images = (rng.integers(0, 8, (n, 8, 8, 1)) + 8 * labels[:, None, None, None])  # digits: 0..16
  return data.from_arrays(images.astype(np.uint8), labels, like="digits", split=split)


@pytest.fixture
def registered():
  names = []

  def add(spec):
    data.register(spec)
    names.append(spec.name)
    return spec
  yield add
  for name in names:
    data.unregister(name)


def test_a_users_image_dataset_trains_by_name(registered, tmp_path):
  registered(data.image_dataset("bright", _bright, num_classes=2, shape=(8, 8, 1)))
  c = tiny_config(dataset="bright", num_epochs=3, learning_rate=0.05)
  result = trainer.train_and_evaluate(c, str(tmp_path))
  assert result["params"]  # trained
  rows = read_metrics(tmp_path)
  assert [r["epoch"] for r in rows] == [1, 2, 3]
  assert rows[-1]["test_accuracy"] > 0.9  # the task is easy: the data reached the model
  # The model's head has the dataset's classes.
  head = [v for k, v in _leaves(result["params"][-1]) if k.endswith("kernel")][-1]
  assert head.shape[-1] == 2


def _leaves(tree, prefix=""):
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from _leaves(v, f"{prefix}/{k}")
  else:
    yield prefix, tree


def test_a_users_token_stream_trains_by_name(registered, tmp_path):
  period = np.tile(np.arange(7, dtype=np.int32), 600)  # a sequence a GPT learns quickly

  def load(split, config):
    return text.from_tokens(period if split == "train" else period[:700],
                            seq_len=config.seq_len, split=split, vocab_size=7)
  registered(data.token_dataset("periodic", load, vocab_size=7))
  c = load_config("lm.py")
  c.dataset, c.num_epochs, c.batch_size, c.seq_len = "periodic", 2, 16, 32
  c.model_kwargs = {"seq_len": 32, "dim": 32, "depth": 2, "num_heads": 2}
  c.num_stages, c.progress_bar, c.eval_every_epochs = 2, False, 1
  result = trainer.train_and_evaluate(c, str(tmp_path))
  rows = read_metrics(tmp_path)
  assert len(rows) == 2 and rows[-1]["test_loss"] < rows[0]["test_loss"] < np.log(7) + 0.5
  assert np.isfinite(result["test_loss"])


def test_unknown_names_point_to_register_and_names_are_not_shadowed():
  c = tiny_config(dataset="nope")
  with pytest.raises(trainer.ConfigError, match="unknown dataset 'nope'.*fdg_jax.data.register"):
    trainer.train_and_evaluate(c, "/tmp/unused_kinds")
  with pytest.raises(ValueError, match="registered already"):
    data.register(data.image_dataset("digits", _bright, num_classes=2, shape=(8, 8, 1)))
  assert "stdlib_text" in kinds.names() and "fashion_mnist" in kinds.names()
  assert kinds.lookup("stdlib_text").kind == "tokens"


def test_from_tokens_checks_its_range():
  with pytest.raises(ValueError, match=r"tokens must lie in \[0, 4\)"):
    text.from_tokens(np.array([0, 1, 5]), seq_len=2, vocab_size=4)
  ds = text.from_tokens(np.arange(10) % 4, seq_len=3, vocab_size=4)
  x, y = ds.windows([0, 1])
  assert x.tolist() == [[0, 1, 2], [3, 0, 1]] and y.tolist() == [[1, 2, 3], [0, 1, 2]]


def test_the_custom_data_config_registers_and_trains_from_the_command_line(tmp_path):
  import os
  import subprocess
  root = pathlib.Path(__file__).resolve().parents[1]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  p = subprocess.run([sys.executable, str(root / "train.py"), "--config",
                      str(root / "configs/custom_data.py"), "--workdir", str(tmp_path),
                      "--config.progress_bar=False"], capture_output=True, text=True,
                     timeout=300, env=env, cwd=root)
  assert p.returncode == 0, p.stderr[-2000:]
  last = p.stdout.strip().splitlines()[-1]
  assert "on bright_squares" in last and "final test accuracy" in last
  assert float(last.split("final test accuracy ")[1].split()[0]) > 0.9
