"""TFDS side of fdg_jax.data, all offline and without TensorFlow: every registered TFDS
dataset under ``tfds.testing.mock_data``, a really prepared (tiny, fake) ArrayRecord
``cifar10`` read end to end, and the missing-dataset error and CLI."""

import contextlib
import io
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest

tfds = pytest.importorskip("tensorflow_datasets")
from tensorflow_datasets.testing import mocking  # pylint: disable=g-import-not-at-top

from fdg_jax import data  # pylint: disable=g-import-not-at-top
from fdg_jax.data import augment as aug  # pylint: disable=g-import-not-at-top

TFDS_NAMES = ["mnist", "fashion_mnist", "cifar10", "cifar100", "svhn_cropped", "stl10",
              "imagenet2012"]


def _mock_getitems(*args, generator, serialized=False):
  # tfds 4.9.10's mocked data source sets `__getitems__` as a plain MagicMock attribute,
  # so it is called without `self` and fails; this version accepts both call forms.
  assert not serialized
  return [generator[int(k)] for k in args[-1]]


@contextlib.contextmanager
def mock_tfds(num_examples):
  """``tfds.testing.mock_data`` with code-generated metadata (no files needed)."""
  with mock.patch.object(mocking, "_getitems", _mock_getitems), tfds.testing.mock_data(
      num_examples=num_examples, policy=tfds.testing.MockPolicy.USE_CODE):
    yield


@pytest.mark.parametrize("name", TFDS_NAMES)
def test_tfds_dataset_loads_under_mock_data(name, tmp_path):
  n = 6 if name == "imagenet2012" else 12
  spec = data.get_spec(name)
  with mock_tfds(n):
    train = data.load(name, "train", data_dir=str(tmp_path))
    test = data.load(name, "test", data_dir=str(tmp_path))
    raw = tfds.data_source(name, split=spec.source_split("train"), data_dir=str(tmp_path),
                           download=False)
    raw_images = [np.asarray(raw[i]["image"]) for i in range(n)]
    raw_labels = np.array([int(raw[i]["label"]) for i in range(n)])
  assert train.num_examples == test.num_examples == n
  assert train.num_classes == spec.num_classes
  assert train.image_shape == spec.image_shape
  assert isinstance(train, data.TfdsDataset if name == "imagenet2012" else data.ArrayDataset)

  def first(ds, **kw):
    return next(data.BatchIterator(ds, 4, **kw))

  plain = first(train, train=False)  # dataset order, no augmentation
  assert plain["image"].shape == (4,) + spec.image_shape
  assert plain["image"].dtype == np.float32 and plain["label"].dtype == np.int32
  assert np.array_equal(plain["label"], raw_labels[:4])
  assert ((raw_labels >= 0) & (raw_labels < spec.num_classes)).all()
  if spec.fixed_size:  # normalisation formula against a manual computation
    want = (np.stack(raw_images[:4]) / 255.0 - np.array(spec.mean)) / np.array(spec.std)
  else:  # resize 256 / centre crop 224, then the formula
    crops = np.stack([aug.resize_box(im, aug.center_box(*im.shape[:2]), 224)
                      for im in raw_images[:4]])
    want = (crops / 255.0 - np.array(spec.mean)) / np.array(spec.std)
  assert np.allclose(plain["image"], want, atol=1e-5)

  t = first(test, train=False)
  assert t["image"].shape == (4,) + spec.image_shape and "mask" in t

  kw = dict(train=True, shuffle=False, prefetch=0)
  a, a2, b = first(train, seed=0, **kw), first(train, seed=0, **kw), first(train, seed=1, **kw)
  assert a["image"].shape == (4,) + spec.image_shape and a["image"].dtype == np.float32
  assert np.array_equal(a["image"], a2["image"])
  assert np.array_equal(a["label"], plain["label"])
  if spec.augmentation == "none":
    assert np.array_equal(a["image"], plain["image"]) and np.array_equal(b["image"], a["image"])
  else:
    assert not np.array_equal(a["image"], b["image"])


def _png(image):
  buf = io.BytesIO()
  from PIL import Image  # pylint: disable=g-import-not-at-top
  Image.fromarray(image).save(buf, format="PNG")
  buf.seek(0)
  return buf


FAKE = {s: np.random.default_rng(i).integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
        for i, (s, n) in enumerate([("train", 21), ("test", 7)])}


class _FakeCifar10(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Writes real ArrayRecord files laid out like a prepared ``cifar10`` (PNG via PIL)."""
  name = "cifar10"
  VERSION = tfds.core.Version("3.0.2")

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        "id": tfds.features.Text(),
        "image": tfds.features.Image(shape=(32, 32, 3)),
        "label": tfds.features.ClassLabel(num_classes=10)}))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {s: self._generate_examples(s) for s in FAKE}

  def _generate_examples(self, split):
    for i, image in enumerate(FAKE[split]):
      yield i, {"id": f"{split}_{i}", "image": _png(image), "label": (3 * i) % 10}


@pytest.fixture(scope="module")
def prepared_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("tfds")
  _FakeCifar10(data_dir=str(root), file_format="array_record").download_and_prepare()
  return str(root)


@pytest.mark.parametrize("cache", [True, False])
def test_prepared_array_record_dataset_is_read_without_tensorflow(prepared_dir, cache):
  for split in ("train", "test"):
    ds = data.load("cifar10", split, data_dir=prepared_dir, cache=cache)
    assert isinstance(ds, data.ArrayDataset if cache else data.TfdsDataset)
    n = len(FAKE[split])
    assert ds.num_examples == n
    images, labels = ds.read(np.arange(n))
    assert images.dtype == np.uint8 and images.shape == (n, 32, 32, 3)
    # TFDS shuffles records when preparing: match every image to its source.
    flat = FAKE[split].reshape(n, -1)
    src = [int(np.flatnonzero((flat == im.reshape(1, -1)).all(1))[0]) for im in images]
    assert sorted(src) == list(range(n))
    assert labels.tolist() == [(3 * i) % 10 for i in src]
    batches = list(data.BatchIterator(ds, 4, train=False))
    assert sum(int(b["mask"].sum()) for b in batches) == n
  assert "tensorflow" not in sys.modules


def test_tfds_source_goes_to_worker_processes(prepared_dir):
  """A TfdsDataset (ArrayRecord data source) pickles to BatchIterator workers, which yield
  bitwise the batches of workers=0."""
  ds = data.load("cifar10", "train", data_dir=prepared_dir, cache=False)
  assert isinstance(ds, data.TfdsDataset)
  kw = dict(train=True, seed=4, drop_remainder=False)  # 6 batches/epoch, last one padded
  want = [next(it) for it in [data.BatchIterator(ds, 4, **kw)] for _ in range(8)]
  with data.BatchIterator(ds, 4, workers=2, **kw) as it:
    got = [next(it) for _ in range(8)]
  for g, w in zip(got, want):
    assert g.keys() == w.keys()
    assert all(g[k].tobytes() == w[k].tobytes() for k in w)
  assert "tensorflow" not in sys.modules


def test_missing_dataset_raises_one_line_error(tmp_path):
  with pytest.raises(data.DatasetNotFoundError) as info:
    data.load("cifar100", "train", data_dir=str(tmp_path))
  msg = str(info.value)
  assert isinstance(info.value, RuntimeError)
  assert "\n" not in msg
  assert "cifar100" in msg and str(tmp_path) in msg
  assert f"tfds build cifar100 --data_dir={tmp_path}" in msg
  assert f"--config.data_dir={tmp_path}" in msg
  assert not any(tmp_path.iterdir())  # nothing downloaded or written


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "fdg_jax.data", *args], capture_output=True,
                        text=True, timeout=120, check=False)


def test_cli_missing_dataset_prints_one_line_and_fails(tmp_path):
  proc = _cli("--dataset", "cifar10", "--data_dir", str(tmp_path))
  assert proc.returncode != 0
  assert "Traceback" not in proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1
  assert "cifar10" in lines[0] and str(tmp_path) in lines[0] and "tfds build" in lines[0]
  assert proc.stdout == ""


def test_cli_prints_info_of_a_prepared_dataset(prepared_dir):
  proc = _cli("--dataset", "cifar10", "--data_dir", prepared_dir)
  assert proc.returncode == 0, proc.stderr
  assert "train:        21 examples" in proc.stdout
  assert "test:         7 examples" in proc.stdout
  assert "num_classes:  10" in proc.stdout
