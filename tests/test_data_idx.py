"""Fashion-MNIST from its original gzip'd IDX files: the parser on small files written here,
the resolution order of ``data.load`` (IDX in data_dir, TFDS, the system package), the
one-line errors, and the real files of Debian's ``dataset-fashion-mnist`` read and trained
on (skipped where the package is not installed)."""

import dataclasses
import gzip
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from fdg_jax import data, trainer
from fdg_jax.data import idx, registry
from test_data_tfds import mock_tfds
from test_trainer import read_metrics, tiny_config

SPEC = registry.get_spec("fashion_mnist")
TRAIN_IMAGES, TRAIN_LABELS = SPEC.idx.files["train"]
TEST_IMAGES, TEST_LABELS = SPEC.idx.files["test"]
SYSTEM_DIR = SPEC.idx.system_dir
HAVE_DEBIAN = all(os.path.isfile(os.path.join(SYSTEM_DIR, n)) for n in SPEC.idx.names())
needs_debian = pytest.mark.skipif(
    not HAVE_DEBIAN, reason=f"Debian's Fashion-MNIST is not installed in {SYSTEM_DIR} "
    "(`apt-get install dataset-fashion-mnist`; .ci/run installs it)")


def idx_bytes(array, type_code=0x08):
  """The IDX encoding of ``array`` (big-endian elements), written independently of fdg_jax."""
  dtype = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
  array = np.asarray(array)
  header = struct.pack(">HBB", 0, type_code, array.ndim)
  header += struct.pack(f">{array.ndim}I", *array.shape)
  return header + array.astype(dtype[type_code]).tobytes()


def write_gz(path, payload):
  with open(path, "wb") as f:
    f.write(gzip.compress(payload))
  return str(path)


def small_split(n, seed, hw=(28, 28)):
  rng = np.random.default_rng(seed)
  return (rng.integers(0, 256, (n,) + hw, dtype=np.uint8),
          rng.integers(0, 10, n).astype(np.uint8))


def write_split(folder, split, images, labels):
  os.makedirs(folder, exist_ok=True)
  names = SPEC.idx.files[split]
  write_gz(os.path.join(folder, names[0]), idx_bytes(images))
  write_gz(os.path.join(folder, names[1]), idx_bytes(labels))


@pytest.fixture
def unchecked(monkeypatch, tmp_path):
  """fashion_mnist's registry entry without checksums (so that the small files written
  here pass) and with its system folder moved to ``tmp_path / "system"`` (empty)."""
  system = tmp_path / "system"
  system.mkdir()
  spec = dataclasses.replace(SPEC, idx=dataclasses.replace(SPEC.idx, sha256={},
                                                           system_dir=str(system)))
  monkeypatch.setitem(registry.REGISTRY, "fashion_mnist", spec)
  return system


def assert_one_line(err, *parts):
  msg = str(err)
  assert "\n" not in msg, msg
  for part in parts:
    assert part in msg, (part, msg)
  return msg


# ------------------------------------------------------------------------------ the parser
def test_read_idx_values_shapes_and_types(tmp_path):
  images, labels = small_split(5, seed=1)
  got_images = idx.read_idx(write_gz(tmp_path / "im.gz", idx_bytes(images)))
  got_labels = idx.read_idx(write_gz(tmp_path / "lb.gz", idx_bytes(labels)))
  assert got_images.dtype == np.uint8 and got_images.shape == (5, 28, 28)
  assert got_labels.dtype == np.uint8 and got_labels.shape == (5,)
  assert np.array_equal(got_images, images) and np.array_equal(got_labels, labels)
  # Multi-byte types are big-endian on disk, native in memory.
  shorts = np.array([[-3, 1000, 32767], [0, -32768, 7]], np.int16)
  got = idx.read_idx(write_gz(tmp_path / "s.gz", idx_bytes(shorts, 0x0B)))
  assert got.dtype == np.int16 and got.dtype.isnative and got.tolist() == shorts.tolist()
  floats = np.array([1.5, -2.25, 1e-3], np.float32)
  got = idx.read_idx(write_gz(tmp_path / "f.gz", idx_bytes(floats, 0x0D)))
  assert got.dtype == np.float32 and got.tolist() == floats.tolist()
  # The header's bytes are what the IDX format says: 0x00000803, then 5, 28, 28.
  assert idx_bytes(images)[:16].hex() == "00000803" "00000005" "0000001c" "0000001c"


@pytest.mark.parametrize("magic", [b"\x12\x34\x08\x03", b"\x00\x00\x07\x03",
                                   b"\x00\x00\x08\x00"])
def test_bad_magic_number_is_one_line(tmp_path, magic):
  payload = magic + idx_bytes(np.zeros((2, 3, 3), np.uint8))[4:]
  path = write_gz(tmp_path / "bad.gz", payload)
  with pytest.raises(idx.IdxError) as info:
    idx.read_idx(path)
  assert_one_line(info.value, path, "not an IDX file", f"magic number 0x{magic.hex()}")


def test_truncated_and_corrupt_files_are_one_line(tmp_path):
  good = idx_bytes(np.arange(2 * 4 * 4, dtype=np.uint8).reshape(2, 4, 4))
  cases = {
      "short_data.gz": (gzip.compress(good[:-5]), "truncated IDX file (27 bytes of data, "
                                                  "dims (2, 4, 4) of uint8 need 32)"),
      "short_header.gz": (gzip.compress(good[:9]), "truncated IDX file (9 bytes, shorter "
                                                   "than its 16-byte header)"),
      "tiny.gz": (gzip.compress(good[:3]), "shorter than the 4-byte magic number"),
      "long.gz": (gzip.compress(good + b"\x00"), "longer than its header says (33 bytes"),
      "cut_stream.gz": (gzip.compress(good)[:-12], "truncated gzip file"),
      "plain.gz": (good, "not a readable gzip file"),
  }
  for name, (raw, what) in cases.items():
    path = tmp_path / name
    path.write_bytes(raw)
    with pytest.raises(idx.IdxError) as info:
      idx.read_idx(path)
    assert_one_line(info.value, str(path), what)


def test_checksum_is_checked_when_given(tmp_path):
  path = write_gz(tmp_path / "x.gz", idx_bytes(np.ones((1, 2, 2), np.uint8)))
  want = idx.sha256_bytes(open(path, "rb").read())
  assert idx.read_idx(path, want).sum() == 4
  with pytest.raises(idx.IdxError) as info:
    idx.read_idx(path, "0" * 64, hint="get the original")
  assert_one_line(info.value, path, f"sha256 {want}", "0" * 64, "; get the original")


# ------------------------------------------------------------------------------ data.load
def test_standard_named_file_with_other_checksum_errors(tmp_path):
  images, labels = small_split(3, seed=2)
  write_split(tmp_path, "train", images, labels)
  with pytest.raises(data.DatasetFileError) as info:
    data.load("fashion_mnist", "train", data_dir=str(tmp_path))
  assert isinstance(info.value, data.DatasetNotFoundError)  # train.py: one line, exit 1
  path = str(tmp_path / TRAIN_IMAGES)
  assert info.value.path == path
  assert_one_line(info.value, path, SPEC.idx.sha256[TRAIN_IMAGES],
                  "apt-get install dataset-fashion-mnist", f"remove it from {tmp_path}")


def test_idx_files_in_data_dir_are_read(unchecked, tmp_path):
  train, test = small_split(6, seed=3), small_split(4, seed=4)
  user = tmp_path / "user"
  write_split(user, "train", *train)
  write_split(user, "test", *test)
  for split, (images, labels) in [("train", train), ("test", test)]:
    ds = data.load("fashion_mnist", split, data_dir=str(user))
    assert isinstance(ds, data.ArrayDataset) and ds.origin == str(user)
    assert ds.num_examples == len(labels) and ds.image_shape == (28, 28, 1)
    got_images, got_labels = ds.read(np.arange(len(labels)))
    assert np.array_equal(got_images[..., 0], images)
    assert got_labels.dtype == np.int32 and got_labels.tolist() == labels.tolist()
  # Normalised as the registry says.
  batch = next(data.BatchIterator(ds, 4, train=False))
  want = (test[0][:4, :, :, None] / 255.0 - 0.2860) / 0.3530
  assert np.allclose(batch["image"], want, atol=1e-5)
  # data_dir/fashion_mnist works too.
  write_split(tmp_path / "nested" / "fashion_mnist", "train", *train)
  ds = data.load("fashion_mnist", "train", data_dir=str(tmp_path / "nested"))
  assert ds.origin == str(tmp_path / "nested" / "fashion_mnist")
  assert np.array_equal(ds.images[..., 0], train[0])


def test_resolution_order_data_dir_then_tfds_then_system(unchecked, tmp_path):
  system_train = small_split(5, seed=5)
  write_split(unchecked, "train", *system_train)
  user_train = small_split(3, seed=6)
  write_split(tmp_path / "user", "train", *user_train)
  empty = tmp_path / "empty"
  empty.mkdir()
  with mock_tfds(12):  # a prepared TFDS copy of 12 examples
    assert data.load("fashion_mnist", "train", str(tmp_path / "user")).num_examples == 3
    from_tfds = data.load("fashion_mnist", "train", str(empty))
    assert from_tfds.num_examples == 12 and from_tfds.origin is None
  from_system = data.load("fashion_mnist", "train", str(empty))
  assert from_system.origin == str(unchecked)
  assert np.array_equal(from_system.images[..., 0], system_train[0])
  assert data.load("fashion_mnist", "train").origin == str(unchecked)  # no data_dir at all
  # Other split strings are TFDS's, as before.
  with pytest.raises(data.DatasetNotFoundError) as info:
    data.load("fashion_mnist", "train[:10%]", str(empty))
  assert_one_line(info.value, f"tfds build fashion_mnist --data_dir={empty}")


def test_nothing_installed_is_one_line_naming_apt_get(unchecked, tmp_path):
  os.rmdir(unchecked)
  with pytest.raises(data.DatasetNotFoundError) as info:
    data.load("fashion_mnist", "test", data_dir=str(tmp_path))
  assert not isinstance(info.value, data.DatasetFileError)
  assert_one_line(info.value, "apt-get install dataset-fashion-mnist",
                  f"no IDX files in {tmp_path} or {tmp_path / 'fashion_mnist'} or {unchecked}",
                  f"no TFDS copy prepared in {tmp_path}", "--config.data_dir=DIR",
                  f"tfds build fashion_mnist --data_dir=DIR", TEST_IMAGES)


def test_bad_files_in_data_dir_are_one_line(unchecked, tmp_path):
  images, labels = small_split(4, seed=7)
  half = tmp_path / "half"
  write_split(half, "train", images, labels)
  os.remove(half / TRAIN_LABELS)
  with pytest.raises(data.DatasetFileError) as info:
    data.load("fashion_mnist", "train", str(half))
  assert_one_line(info.value, f"{half} holds some of fashion_mnist's IDX files but not "
                  f"{TRAIN_LABELS}", "apt-get install dataset-fashion-mnist")
  # The test split asked of a folder holding only the training files: not mixed with TFDS.
  with pytest.raises(data.DatasetFileError) as info:
    data.load("fashion_mnist", "test", str(half))
  assert_one_line(info.value, f"but not {TEST_IMAGES}")
  cases = {
      "small": (small_split(4, 8, hw=(8, 8)), f"{TRAIN_IMAGES}: uint8 images of shape (8, 8), "
                                              "expected uint8 (28, 28)"),
      "count": ((images, labels[:3]), f"{TRAIN_LABELS}: uint8 labels of shape (3,), expected "
                                      "uint8 [4]"),
      "range": ((images, labels * 0 + 10), f"{TRAIN_LABELS}: label 10 out of range [0, 10)"),
  }
  for name, ((im, lb), what) in cases.items():
    write_split(tmp_path / name, "train", im, lb)
    with pytest.raises(data.DatasetFileError) as info:
      data.load("fashion_mnist", "train", str(tmp_path / name))
    assert_one_line(info.value, what)
  (tmp_path / "magic").mkdir()
  write_gz(tmp_path / "magic" / TRAIN_IMAGES, b"\x00\x00\x01\x03" + bytes(12))
  write_gz(tmp_path / "magic" / TRAIN_LABELS, idx_bytes(labels))
  with pytest.raises(data.DatasetFileError) as info:
    data.load("fashion_mnist", "train", str(tmp_path / "magic"))
  assert_one_line(info.value, str(tmp_path / "magic" / TRAIN_IMAGES), "not an IDX file")


def test_digits_stays_embedded():
  ds = data.load("digits", "train", data_dir="/nonexistent")
  assert ds.num_examples == 1437 and ds.origin is None


# ------------------------------------------------------------------------------ real files
def test_registry_checksums_are_the_debian_files():
  assert set(SPEC.idx.sha256) == set(SPEC.idx.names())
  if HAVE_DEBIAN:
    for name, want in SPEC.idx.sha256.items():
      with open(os.path.join(SYSTEM_DIR, name), "rb") as f:
        assert idx.sha256_bytes(f.read()) == want


@needs_debian
def test_real_fashion_mnist_from_debian():
  train, test = data.load("fashion_mnist", "train"), data.load("fashion_mnist", "test")
  assert train.origin == test.origin == SYSTEM_DIR
  assert train.images.shape == (60000, 28, 28, 1) and test.images.shape == (10000, 28, 28, 1)
  assert train.images.dtype == np.uint8
  assert np.bincount(train.labels).tolist() == [6000] * 10
  assert np.bincount(test.labels).tolist() == [1000] * 10
  # The first labels as the files store them (ankle boot, T-shirt, T-shirt, dress, ...).
  assert train.labels[:10].tolist() == [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]
  assert test.labels[:10].tolist() == [9, 2, 1, 1, 6, 1, 4, 6, 5, 7]
  # The registry's normalisation constants are the training split's statistics.
  pixels = train.images / 255.0
  assert pixels.mean() == pytest.approx(SPEC.mean[0], abs=1e-4)
  assert pixels.std() == pytest.approx(SPEC.std[0], abs=1e-4)
  proc = subprocess.run([sys.executable, "-m", "fdg_jax.data", "--dataset", "fashion_mnist"],
                        capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr
  assert "dataset:      fashion_mnist (idx)" in proc.stdout
  assert f"files:        {SYSTEM_DIR}" in proc.stdout
  assert "train:        60000 examples" in proc.stdout


@needs_debian
def test_trainer_trains_on_real_fashion_mnist(tmp_path):
  c = tiny_config(algorithm="fdg", dataset="fashion_mnist", num_epochs=1, max_steps=100)
  result = trainer.train_and_evaluate(c, str(tmp_path))
  (record,) = read_metrics(tmp_path)  # the evaluation where max_steps stopped the run
  assert result["steps"] == record["step"] == 100
  assert record["epoch"] == pytest.approx(100 / (60000 // 64))
  # 100 ticks of batch 64 (a ninth of an epoch), evaluated on all 10,000 test images: far
  # above the 10% of chance and below the loss of a uniform guess, ln 10.
  assert result["test_accuracy"] == record["test_accuracy"] > 0.6, record
  assert record["test_loss"] < 0.5 * np.log(10)
  assert record["train_loss"] < np.log(10)


def test_a_data_dir_that_is_missing_or_a_file_is_refused_not_passed_over(unchecked, tmp_path):
  write_split(unchecked, "train", *small_split(5, seed=5))  # an installed copy to fall back on
  with pytest.raises(data.DatasetNotFoundError) as info:
    data.load("fashion_mnist", "train", str(tmp_path / "typo"))
  assert_one_line(info.value, f"data_dir {tmp_path / 'typo'} does not exist",
                  "leave data_dir unset")
  (tmp_path / "afile").write_text("x")
  with pytest.raises(data.DatasetNotFoundError) as info:
    data.load("fashion_mnist", "train", str(tmp_path / "afile"))
  assert_one_line(info.value, "is a file, not a folder")
