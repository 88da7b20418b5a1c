"""The offline byte corpus (`fdg_jax.data.text`): determinism, splits, windows, resume, sharding."""

import hashlib
import json

import numpy as np
import pytest

from fdg_jax.data import text

MAX = 1 << 20  # 1 MiB of train text
T = 64


@pytest.fixture(scope="module")
def train():
  return text.load_text("train", seq_len=T, max_bytes=MAX)


@pytest.fixture(scope="module")
def val():
  return text.load_text("validation", seq_len=T, max_bytes=MAX // 4)


def test_deterministic_and_recorded(train):
  again = text.load_text("train", seq_len=T, max_bytes=MAX)
  assert again.sha256 == train.sha256 and again.files == train.files
  np.testing.assert_array_equal(again.tokens, train.tokens)
  assert train.tokens.dtype == np.uint8 and train.num_bytes == MAX == sum(train.file_bytes)
  assert train.sha256 == hashlib.sha256(train.tokens.tobytes()).hexdigest()
  assert train.vocab_size == 256 and train.num_windows == (MAX - 1) // T
  assert list(train.files) == sorted(train.files)
  assert not any(p in text.EXCLUDED_DIRS for f in train.files for p in f.split("/")[:-1])
  info = json.loads(json.dumps(train.info()))
  assert info["sha256"] == train.sha256 and info["num_files"] == len(train.files)
  # A prefix of a longer load: max_bytes cuts, it does not reselect.
  small = text.load_text("train", seq_len=T, max_bytes=1000)
  np.testing.assert_array_equal(small.tokens, train.tokens[:1000])
  assert text.load_text("train", max_bytes=1000, expected_sha256=small.sha256).num_bytes == 1000
  with pytest.raises(ValueError, match="sha256"):
    text.load_text("train", max_bytes=1000, expected_sha256="0" * 64)


def test_splits_disjoint_by_file(train, val):
  assert set(train.files).isdisjoint(val.files)
  files = text.corpus_files()
  tr, va = text.split_files(files, "train"), text.split_files(files, "validation")
  assert set(tr).isdisjoint(va) and sorted(tr + va) == files
  assert len(va) == len(files) // text.VALIDATION_EVERY
  assert list(val.files) == va[:len(val.files)] and list(train.files) == tr[:len(train.files)]
  assert text.load_text("test", max_bytes=100).sha256 == text.load_text(
      "validation", max_bytes=100).sha256
  with pytest.raises(ValueError, match="split"):
    text.load_text("dev")


def test_targets_are_shifted_tokens(train):
  it = text.TextIterator(train, 8, train=True, seed=3)
  b = next(it)
  assert b["tokens"].dtype == b["targets"].dtype == np.int32
  assert b["tokens"].shape == b["targets"].shape == (8, T)
  np.testing.assert_array_equal(b["tokens"][:, 1:], b["targets"][:, :-1])
  # Each row is a window of the corpus: inputs tokens[i*T:(i+1)*T], targets one further.
  i = int(it.order(0)[0])
  np.testing.assert_array_equal(b["tokens"][0], train.tokens[i * T:(i + 1) * T])
  np.testing.assert_array_equal(b["targets"][0], train.tokens[i * T + 1:(i + 1) * T + 1])


def test_epoch_order_is_a_permutation_from_seed_and_epoch(train):
  a = text.TextIterator(train, 16, train=True, seed=1)
  b = text.TextIterator(train, 16, train=True, seed=1)
  assert sorted(a.order(0)) == list(range(train.num_windows))
  np.testing.assert_array_equal(a.order(1), b.order(1))
  assert not np.array_equal(a.order(0), a.order(1))
  assert not np.array_equal(a.order(0), text.TextIterator(train, 16, train=True, seed=2).order(0))


def test_resume_equals_uninterrupted(train):
  small = text.load_text("train", seq_len=T, max_bytes=64 * 40 + 1)  # 40 windows
  mk = lambda: text.TextIterator(small, 8, train=True, seed=5)
  ref = mk()
  assert ref.steps_per_epoch == 5
  uninterrupted = [next(ref) for _ in range(12)]  # crosses two epoch boundaries
  it = mk()
  for _ in range(7):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  resumed = mk()
  resumed.set_state(state)
  assert (resumed.epoch, resumed.step) == (1, 2)
  for want in uninterrupted[7:]:
    got = next(resumed)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])
  with pytest.raises(ValueError, match="seed"):
    text.TextIterator(small, 8, train=True, seed=6).set_state(state)
  with pytest.raises(ValueError, match="sha256"):
    other = text.load_text("validation", seq_len=T, max_bytes=64 * 40 + 1)
    text.TextIterator(other, 8, train=True, seed=5).set_state(state)


def test_process_sharding_partitions_global_batch(train):
  glob = text.TextIterator(train, 12, train=True, seed=7)
  shards = [text.TextIterator(train, 12, train=True, seed=7, process_index=p, process_count=3)
            for p in range(3)]
  for _ in range(3):
    g = next(glob)
    parts = [next(s) for s in shards]
    assert all(p["tokens"].shape == (4, T) for p in parts)
    for k in ("tokens", "targets"):
      np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), g[k])
    rows = {r.tobytes() for p in parts for r in p["tokens"]}
    assert len(rows) == 12  # disjoint rows
  with pytest.raises(ValueError, match="divisible"):
    text.TextIterator(train, 10, train=True, process_index=0, process_count=3)


def test_eval_visits_every_window_once_in_order(val):
  it = text.TextIterator(val, 32, train=False)
  assert not it.drop_remainder and len(it) == it.steps_per_epoch == -(-val.num_windows // 32)
  batches = list(it)
  mask = np.concatenate([b["mask"] for b in batches]).astype(bool)
  toks = np.concatenate([b["tokens"] for b in batches])[mask]
  assert mask.sum() == val.num_windows
  n = val.num_windows * T
  np.testing.assert_array_equal(toks.reshape(-1), val.tokens[:n])
  with pytest.raises(StopIteration):
    next(it)


def test_the_held_out_split_spans_the_corpus_and_is_disjoint_from_the_others():
  import collections
  import os
  import subprocess
  import sys
  root = text.stdlib_dir()
  files = text.corpus_files(root)
  split = {s: text.split_files(files, s, root) for s in text.SPLITS}
  held, rest, train = set(split["held_out"]), set(split["train_rest"]), set(split["train"])
  assert held and not held & rest and held | rest == train
  assert not (held | rest) & set(split["validation"])
  size = {f: os.path.getsize(os.path.join(root, f)) for f in held}
  total = sum(size.values())
  assert 0.9 * text.HELD_OUT_BYTES <= total <= text.HELD_OUT_BYTES
  by_top = collections.Counter()
  for f, n in size.items():
    by_top[text.top_level(f)] += n
  assert len(by_top) >= 12, by_top  # many packages and modules, not one directory's files
  assert max(by_top.values()) <= total / 4, by_top.most_common(3)
  # What the trainer reads is those files' bytes, in corpus order.
  ds = text.load_text("held_out", seq_len=64)
  assert ds.files == tuple(split["held_out"]) and ds.num_bytes == total
  # The command line lists them.
  out = subprocess.run([sys.executable, "-m", "fdg_jax.data", "--dataset", "stdlib_text",
                        "--split", "held_out", "--files"], capture_output=True, text=True,
                       timeout=120, check=True).stdout.split()
  assert out == split["held_out"]
