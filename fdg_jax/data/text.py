"""An offline byte-level language-modelling corpus: the Python standard library's own source.

Every machine with Python has it, so nothing is downloaded:

    ds = fdg_jax.data.text.load_text("train", seq_len=128, max_bytes=4 << 20)
    it = fdg_jax.data.text.TextIterator(ds, 64, train=True, seed=0)
    batch = next(it)   # {"tokens": int32 [64, 128], "targets": int32 [64, 128]}
    ds.sha256, ds.files, ds.num_bytes   # what exactly was read

Corpus: the ``*.py`` files under the standard library directory
(``sysconfig.get_paths()["stdlib"]``), found without following links, minus the directories
that are third-party or that distributions ship as separate packages (``EXCLUDED_DIRS``: test
suites, site-/dist-packages, idlelib, tkinter, lib2to3, distutils, ensurepip, ...), sorted by
relative POSIX path. File i of that list belongs to the validation split when
``i % VALIDATION_EVERY == VALIDATION_EVERY - 1`` and to train otherwise: the splits are
disjoint by file. For choosing on data that is neither trained on nor the test split,
"held_out" is about 262 kB of whole training files picked by a seeded hash across the
packages (at most an eighth of it from one top-level package or module, `held_out_files`),
and "train_rest" the training files without them; ``python -m fdg_jax.data --dataset
stdlib_text --split held_out --files`` lists a split's files. A split's text is the raw
bytes of its files concatenated in order (no separator, no decoding), cut at ``max_bytes``.
Tokens are the bytes (vocabulary 256).

Reproducibility: the corpus is a pure function of the stdlib directory's contents, so two runs
on the same Python build see the same bytes; another Python patch version (or a distribution's
patched stdlib) generally differs. ``TextDataset.sha256`` (of the split's token bytes),
``files``, ``file_bytes`` and ``python_version`` record what was read; pass
``expected_sha256=`` to ``load_text`` to refuse a different corpus, and the iterator's state
carries the hash so a resume on a different corpus fails.

Examples are non-overlapping windows: window i has inputs ``tokens[i*T : i*T + T]`` and
targets ``tokens[i*T + 1 : i*T + T + 1]`` (the inputs shifted by one), so
``num_windows = (num_bytes - 1) // T`` and the ragged tail is dropped.

``TextIterator`` follows ``BatchIterator``'s conventions: every batch is a pure function of
``(seed, epoch, step)``; the training order of epoch e is ``epoch_permutation(seed, e, n)``;
the state is the position ``(epoch, step)`` plus fields checked on restore; process p of P
yields rows ``[p*b, (p+1)*b)`` of every global batch of B = P*b rows; evaluation visits every
window once, in order, the last batch padded and ``"mask"`` marking real rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import sysconfig
from typing import Any, Sequence

import numpy as np

from fdg_jax.data.iterator import PositionedIterator

VOCAB_SIZE = 256
VALIDATION_EVERY = 10
SPLITS = ("train", "validation", "held_out", "train_rest")
# A held-out split drawn from across the training files ("held_out"), and the training files
# without it ("train_rest"): disjoint by file, and neither shares a file with "validation"
# (the test split). The training files in the order of a seeded hash of their paths, each
# taken while the split stays within HELD_OUT_BYTES and its top-level package (or module)
# within a HELD_OUT_SHARE of that; files over the share are never taken.
HELD_OUT_BYTES = 262_144
HELD_OUT_SHARE = 1 / 8
HELD_OUT_SEED = 0
# Directory names skipped anywhere in the tree: third-party code, test suites and the parts of
# the stdlib that distributions (Debian/Ubuntu, Fedora) ship as separate packages, so that the
# corpus is the same on more installations of one Python version.
EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "idlelib",
    "tkinter", "turtledemo", "lib2to3", "distutils", "ensurepip", "venv",
})
_STATE_VERSION = 1


def stdlib_dir() -> str:
  """The standard library directory of this interpreter."""
  return sysconfig.get_paths().get("stdlib") or os.path.dirname(os.__file__)


def corpus_files(root: str | None = None) -> list[str]:
  """All corpus files under `root` (default `stdlib_dir()`): relative POSIX paths of the
  ``*.py`` regular files outside `EXCLUDED_DIRS`, sorted; links are not followed."""
  root = stdlib_dir() if root is None else root
  if not os.path.isdir(root):
    raise FileNotFoundError(f"text corpus directory {root!r} does not exist")
  out = []
  for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
    dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
    for f in filenames:
      path = os.path.join(dirpath, f)
      if f.endswith(".py") and os.path.isfile(path) and not os.path.islink(path):
        out.append(os.path.relpath(path, root).replace(os.sep, "/"))
  return sorted(out)


def top_level(path: str) -> str:
  """The top-level package of a corpus path ("email/mime/text.py" -> "email"), or the
  module itself for a file at the top ("os.py")."""
  return path.split("/", 1)[0]


def held_out_files(train: Sequence[str], sizes: Sequence[int], *, seed: int = HELD_OUT_SEED,
                   total: int = HELD_OUT_BYTES, share: float = HELD_OUT_SHARE) -> list[str]:
  """The held-out files among the training files `train` (of `sizes` bytes), in corpus
  order: see HELD_OUT_BYTES."""
  order = sorted(range(len(train)), key=lambda i: hashlib.sha256(
      f"{seed}:{train[i]}".encode()).digest())
  cap = share * total
  taken, used, per_top = set(), 0, {}
  for i in order:
    top = top_level(train[i])
    if sizes[i] == 0 or used + sizes[i] > total or per_top.get(top, 0) + sizes[i] > cap:
      continue
    taken.add(i)
    used += sizes[i]
    per_top[top] = per_top.get(top, 0) + sizes[i]
  return [train[i] for i in sorted(taken)]


def split_files(files: Sequence[str], split: str, root: str | None = None) -> list[str]:
  """The files of `split`: every VALIDATION_EVERY-th file (1-based) is validation, the rest
  train; "held_out" is `held_out_files` of train (sized under `root`, default the
  stdlib's), "train_rest" train without them."""
  split = _check_split(split)
  val = [i % VALIDATION_EVERY == VALIDATION_EVERY - 1 for i in range(len(files))]
  if split == "validation":
    return [f for f, v in zip(files, val) if v]
  train = [f for f, v in zip(files, val) if not v]
  if split in ("held_out", "train_rest"):
    root = stdlib_dir() if root is None else root
    held = set(held_out_files(train, [os.path.getsize(os.path.join(root, f)) for f in train]))
    return [f for f in train if (f in held) == (split == "held_out")]
  return train


def _check_split(split: str) -> str:
  if split == "test":  # the trainer's name for the held-out split
    split = "validation"
  if split not in SPLITS:
    raise ValueError(f"unknown text split {split!r}; expected one of {', '.join(SPLITS)} "
                     "('test' is an alias of 'validation')")
  return split


@dataclasses.dataclass(frozen=True, eq=False)
class TextDataset:
  """One split of the byte corpus, in memory.

  Attributes:
    name: "python_stdlib".
    split: "train" or "validation".
    tokens: uint8 [num_bytes], the split's bytes.
    seq_len: the default window length T (the iterator may use another).
    files: relative paths read, in order: a prefix of the split's file list (empty files
      included; the last one possibly cut by max_bytes).
    file_bytes: bytes taken from each file.
    sha256: hex sha256 of `tokens`.
    root: the directory read; python_version: the interpreter's version.
  """

  name: str
  split: str
  tokens: np.ndarray
  seq_len: int
  files: tuple
  file_bytes: tuple
  sha256: str
  root: str
  python_version: str
  vocab_size: int = VOCAB_SIZE

  @property
  def num_bytes(self) -> int:
    return int(self.tokens.shape[0])

  def windows_for(self, seq_len: int) -> int:
    """Number of windows of length `seq_len`: ``(num_bytes - 1) // seq_len``."""
    if seq_len < 1:
      raise ValueError(f"seq_len must be positive, got {seq_len}")
    return max(0, (self.num_bytes - 1) // int(seq_len))

  @property
  def num_windows(self) -> int:
    return self.windows_for(self.seq_len)

  def windows(self, idx, seq_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, targets), int32 [len(idx), T] each, of the windows `idx`."""
    T = self.seq_len if seq_len is None else int(seq_len)
    idx = np.asarray(idx, np.int64)
    n = self.windows_for(T)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
      raise IndexError(f"window index out of range [0, {n})")
    rows = self.tokens[idx[:, None] * T + np.arange(T + 1)].astype(np.int32)
    return rows[:, :-1], rows[:, 1:]

  def info(self) -> dict[str, Any]:
    """JSON-able description (to log next to a run, and to compare between runs)."""
    return {"name": self.name, "split": self.split, "num_bytes": self.num_bytes,
            "sha256": self.sha256, "num_files": len(self.files), "files": list(self.files),
            "file_bytes": list(self.file_bytes), "seq_len": self.seq_len,
            "num_windows": self.num_windows, "vocab_size": self.vocab_size,
            "python_version": self.python_version, "root": self.root}


def from_tokens(tokens, *, seq_len: int, split: str = "train", name: str = "tokens",
                vocab_size: int = VOCAB_SIZE) -> TextDataset:
  """A user's token stream (integers in [0, vocab_size)) as a `TextDataset` of windows of
  `seq_len` tokens (for `fdg_jax.data.token_dataset`)."""
  tokens = np.asarray(tokens)
  if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer) or tokens.size < 2:
    raise ValueError(f"tokens must be a 1-D integer array of at least 2, got {tokens.dtype} "
                     f"{tokens.shape}")
  if tokens.min() < 0 or tokens.max() >= vocab_size:
    raise ValueError(f"tokens must lie in [0, {vocab_size}), got [{tokens.min()}, "
                     f"{tokens.max()}]")
  tokens = np.array(tokens, copy=True)
  tokens.flags.writeable = False
  return TextDataset(name=name, split=split, tokens=tokens, seq_len=int(seq_len), files=(),
                     file_bytes=(), sha256=hashlib.sha256(tokens.tobytes()).hexdigest(),
                     root="", python_version=platform.python_version(),
                     vocab_size=int(vocab_size))


def load_text(split: str = "train", *, seq_len: int = 128, max_bytes: int | None = None,
              root: str | None = None, expected_sha256: str | None = None) -> TextDataset:
  """Reads one split of the stdlib byte corpus (see the module docstring).

  Args:
    split: "train" or "validation" ("test" is accepted as "validation").
    seq_len: window length T of `num_windows` (and the iterator's default).
    max_bytes: keep the first `max_bytes` bytes of the split (files in order, the last one
      cut); None: the whole split (9.2 MB train / 0.8 MB validation on CPython 3.11.7).
    root: the directory to read instead of the stdlib (same selection rules).
    expected_sha256: if given, ValueError unless the split's bytes have this hash.

  Raises:
    ValueError: bad split / seq_len / max_bytes, an empty corpus, or a hash mismatch.
  """
  split = _check_split(split)
  if seq_len < 1:
    raise ValueError(f"seq_len must be positive, got {seq_len}")
  if max_bytes is not None and max_bytes < 2:
    raise ValueError(f"max_bytes must be >= 2 (one input and one target), got {max_bytes}")
  root = os.path.abspath(stdlib_dir() if root is None else root)
  chunks, files, sizes, total = [], [], [], 0
  for rel in split_files(corpus_files(root), split, root):
    if max_bytes is not None and total >= max_bytes:
      break
    with open(os.path.join(root, rel), "rb") as f:
      data = f.read()
    if max_bytes is not None:
      data = data[:max_bytes - total]
    chunks.append(data)
    files.append(rel)
    sizes.append(len(data))
    total += len(data)
  blob = b"".join(chunks)
  if len(blob) < 2:
    raise ValueError(f"the {split} split of the text corpus under {root!r} is empty")
  sha = hashlib.sha256(blob).hexdigest()
  if expected_sha256 is not None and sha != expected_sha256:
    raise ValueError(f"text corpus {split} split has sha256 {sha}, expected {expected_sha256}"
                     f" (Python {platform.python_version()} stdlib at {root}; another Python "
                     "version or build has other source files)")
  tokens = np.frombuffer(blob, np.uint8).copy()
  tokens.flags.writeable = False
  return TextDataset(name="python_stdlib", split=split, tokens=tokens, seq_len=int(seq_len),
                     files=tuple(files), file_bytes=tuple(sizes), sha256=sha, root=root,
                     python_version=platform.python_version())


class TextIterator(PositionedIterator):
  """Yields ``{"tokens": int32 [b, T], "targets": int32 [b, T]}`` (+ ``"mask"``) batches.

  Args:
    dataset: a `TextDataset`.
    batch_size: the GLOBAL batch size B (windows); each process yields b = B / process_count.
    train: training mode: shuffle the windows every epoch, drop the last partial batch.
    seed: seed of the shuffle (the order of epoch e depends on (seed, e) only).
    seq_len: window length T; None: the dataset's.
    drop_remainder: True: floor(n / B) batches per epoch. False: ceil(n / B), the last padded
      with zero rows, and every batch carries ``"mask"`` (float32 [b], 1 = real window).
      None: True when `train`, else False (evaluation sees every window exactly once).
    shuffle: None = `train`; False iterates the windows in corpus order.
    num_epochs: stop after this many epochs; None = never when `train`, one epoch otherwise.
    process_index, process_count: this process yields rows
      ``[process_index * b, (process_index + 1) * b)`` of every global batch.

  ``epoch``/``step`` are the position of the next batch; ``get_state()``/``set_state()``
  save and restore it (``process_count`` may differ on restore).
  """

  def __init__(self, dataset: TextDataset, batch_size: int, *, train: bool, seed: int = 0,
               seq_len: int | None = None, drop_remainder: bool | None = None,
               shuffle: bool | None = None, num_epochs: int | None = None,
               process_index: int = 0, process_count: int = 1):
    self.dataset = dataset
    self.seq_len = dataset.seq_len if seq_len is None else int(seq_len)
    self.num_windows = dataset.windows_for(self.seq_len)
    self._init_position(self.num_windows, batch_size, train=train, seed=seed,
                        drop_remainder=drop_remainder, shuffle=shuffle,
                        num_epochs=num_epochs, process_index=process_index,
                        process_count=process_count)
    if self.steps_per_epoch == 0:
      raise ValueError(f"{dataset.name}/{dataset.split} has {self.num_windows} windows of "
                       f"{self.seq_len} tokens: not one full batch of {self.batch_size} (use "
                       "drop_remainder=False, or more max_bytes)")

  @property
  def vocab_size(self) -> int:
    return self.dataset.vocab_size

  # ---- position / state ---------------------------------------------------------------

  def get_state(self) -> dict[str, Any]:
    """JSON-able state: the position of the next batch plus fields checked on restore."""
    return {"version": _STATE_VERSION, "epoch": self.epoch, "step": self.step,
            "seed": self.seed, "batch_size": self.batch_size, "seq_len": self.seq_len,
            "num_windows": self.num_windows, "drop_remainder": int(self.drop_remainder),
            "shuffle": int(self.shuffle), "sha256": self.dataset.sha256}

  def set_state(self, state: dict[str, Any]) -> None:
    """Restores a `get_state()` position; the next batch is the one an uninterrupted iterator
    would yield there. ValueError if the corpus (sha256), seed, global batch size, seq_len,
    window count, drop_remainder or shuffle differ."""
    epoch, step = self._checked_position(state, (
        "version", "seed", "batch_size", "seq_len", "num_windows", "drop_remainder",
        "shuffle", "sha256"))
    self.epoch, self.step = epoch, step

  # ---- batches ------------------------------------------------------------------------

  def batch_at(self, epoch: int, step: int) -> dict[str, np.ndarray]:
    """This process's batch at position (epoch, step); a pure function of it."""
    gb, lb = self.batch_size, self.local_batch_size
    global_idx = self.order(epoch)[step * gb:(step + 1) * gb]
    lo = self.process_index * lb
    local_idx = global_idx[lo:lo + lb]
    n_real = local_idx.shape[0]
    tokens = np.zeros((lb, self.seq_len), np.int32)
    targets = np.zeros((lb, self.seq_len), np.int32)
    tokens[:n_real], targets[:n_real] = self.dataset.windows(local_idx, self.seq_len)
    batch = {"tokens": tokens, "targets": targets}
    if not self.drop_remainder:
      mask = np.zeros((lb,), np.float32)
      mask[:n_real] = 1.0
      batch["mask"] = mask
    return batch

  # ---- iteration ----------------------------------------------------------------------

  def __next__(self) -> dict[str, np.ndarray]:
    if self._finished(self.epoch):
      raise StopIteration
    batch = self.batch_at(self.epoch, self.step)
    self._advance()
    return batch
