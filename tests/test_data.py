"""Tests of fdg_jax.data that need no TFDS dataset: registry, digits, augmentation,
BatchIterator (order, restore, padding, sharding). TFDS tests: test_data_tfds.py."""

import dataclasses
import json

import numpy as np
import pytest

from fdg_jax import data
from fdg_jax.data import augment as aug
from fdg_jax.data import sources
from fdg_jax.data.registry import AUGMENTATIONS, REGISTRY


def _index_dataset(n, shape=(4, 4, 3), num_classes=10):
  """A dataset whose images encode their index: raw pixel [0,0,0] = i % 256, [0,0,1] =
  i // 256; normalised as raw / 255 (mean 0, std 1) and never augmented."""
  spec = dataclasses.replace(data.get_spec("cifar10"), name="index", image_shape=shape,
                             mean=(0.0,) * shape[-1], std=(1.0,) * shape[-1],
                             augmentation="none")
  images = np.zeros((n,) + shape, np.uint8)
  images[:, 0, 0, 0] = np.arange(n) % 256
  images[:, 0, 0, 1] = np.arange(n) // 256
  return data.from_arrays(images, np.arange(n) % num_classes, like=spec)


def _indices(batch):
  raw = np.rint(batch["image"][:, 0, 0, :2] * 255).astype(np.int64)
  return raw[:, 0] + 256 * raw[:, 1]


def _cifar_like(n=40, seed=0):
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
  return data.from_arrays(images, rng.integers(0, 10, n), like="cifar10")


def _take(it, k):
  return [next(it) for _ in range(k)]


def _assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for key in x:
      assert np.array_equal(x[key], y[key]), key


# ---- registry ---------------------------------------------------------------------------

def test_registry_entries_are_consistent():
  assert set(data.list_datasets()) == {"digits", "mnist", "fashion_mnist", "cifar10",
                                       "cifar100", "svhn_cropped", "stl10", "imagenet2012"}
  for name, spec in REGISTRY.items():
    assert spec.name == name
    c = spec.image_shape[-1]
    assert len(spec.mean) == len(spec.std) == c
    assert all(s > 0 for s in spec.std)
    assert spec.augmentation in AUGMENTATIONS
    assert {"train", "test"} <= set(spec.splits)
  assert data.get_spec("imagenet2012").source_split("test") == "validation"
  assert data.get_spec("svhn_cropped").augmentation == "crop"  # no flip for digits
  with pytest.raises(ValueError, match="Unknown dataset"):
    data.get_spec("nope")


# ---- digits -----------------------------------------------------------------------------

def test_digits_split_is_fixed_stratified_and_stats_match_registry():
  train_idx, test_idx = sources.digits_split()
  assert len(train_idx) == 1437 and len(test_idx) == 360
  assert np.intersect1d(train_idx, test_idx).size == 0
  assert np.array_equal(np.union1d(train_idx, test_idx), np.arange(1797))
  again = sources.digits_split()
  assert np.array_equal(again[0], train_idx) and np.array_equal(again[1], test_idx)
  _, y_test = sources.load_digits_arrays("test")
  assert np.bincount(y_test, minlength=10).min() >= 35  # ~20% of every class
  x_train, _ = sources.load_digits_arrays("train")
  spec = data.get_spec("digits")
  assert np.isclose((x_train / 16.0).mean(), spec.mean[0], rtol=0, atol=1e-12)
  assert np.isclose((x_train / 16.0).std(), spec.std[0], rtol=0, atol=1e-12)


def test_digits_batches_are_normalised_real_data():
  ds = data.load("digits", "train")
  assert (ds.num_examples, ds.num_classes, ds.image_shape) == (1437, 10, (8, 8, 1))
  it = data.BatchIterator(ds, ds.num_examples, train=False)
  batch = next(it)
  assert batch["image"].dtype == np.float32 and batch["image"].shape == (1437, 8, 8, 1)
  assert batch["label"].dtype == np.int32
  assert np.allclose(batch["mask"], 1.0)
  x, y = sources.load_digits_arrays("train")
  spec = data.get_spec("digits")
  assert np.allclose(batch["image"], (x / 16.0 - spec.mean[0]) / spec.std[0], atol=1e-6)
  assert np.array_equal(batch["label"], y)
  assert abs(batch["image"].mean()) < 1e-5 and abs(batch["image"].std() - 1) < 1e-5
  with pytest.raises(StopIteration):
    next(it)


def test_digits_logistic_regression_beats_90_percent():
  train = data.BatchIterator(data.load("digits", "train"), 32, train=True, seed=0,
                             num_epochs=5)
  w = np.zeros((64, 10), np.float32)
  b = np.zeros((10,), np.float32)
  for batch in train:
    x = batch["image"].reshape(len(batch["label"]), -1)
    logits = x @ w + b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(x)), batch["label"]] -= 1.0
    w -= 0.05 * x.T @ p / len(x)
    b -= 0.05 * p.mean(0)
  correct = total = 0
  for batch in data.BatchIterator(data.load("digits", "test"), 100, train=False):
    pred = (batch["image"].reshape(len(batch["label"]), -1) @ w + b).argmax(1)
    correct += ((pred == batch["label"]) * batch["mask"]).sum()
    total += batch["mask"].sum()
  assert total == 360
  assert correct / total > 0.9


# ---- transforms -------------------------------------------------------------------------

def test_normalize_matches_manual_formula():
  spec = data.get_spec("cifar100")
  x = np.random.default_rng(0).integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)
  want = (x.astype(np.float64) / 255.0 - np.array(spec.mean)) / np.array(spec.std)
  got = aug.normalize(x, spec)
  assert got.dtype == np.float32 and got.flags.c_contiguous
  assert np.allclose(got, want, atol=1e-5)


def test_crop_flip_matches_per_image_reference():
  rng = np.random.default_rng(1)
  x = rng.integers(0, 256, (16, 8, 6, 3), dtype=np.uint8)
  pad = 3
  dy, dx, flip = aug.sample_crop_flip(rng, 16, pad, flip=True)
  got = aug.crop_flip(x, dy, dx, flip, pad)
  for i in range(16):
    ref = np.pad(x[i], ((pad, pad), (pad, pad), (0, 0)))[dy[i]:dy[i] + 8, dx[i]:dx[i] + 6]
    if flip[i]:
      ref = ref[:, ::-1]
    assert np.array_equal(got[i], ref)
  assert got.flags.c_contiguous
  centre = np.full(16, pad)
  assert np.array_equal(aug.crop_flip(x, centre, centre, np.zeros(16, bool), pad), x)
  assert not aug.sample_crop_flip(rng, 64, pad, flip=False)[2].any()


def test_rrc_boxes_fit_and_center_box():
  rng = np.random.default_rng(0)
  h = rng.integers(20, 400, 200)
  w = rng.integers(20, 400, 200)
  boxes = aug.rrc_boxes(h, w, aug.sample_rrc_uniforms(rng, 200))
  top, left, ch, cw = boxes.T
  assert (top >= 0).all() and (left >= 0).all() and (ch >= 1).all() and (cw >= 1).all()
  assert (top + ch <= h).all() and (left + cw <= w).all()
  # Every attempt fails (zero area) -> centre crop, aspect clamped to [3/4, 4/3].
  boxes = aug.rrc_boxes(np.array([100, 100]), np.array([300, 100]),
                        np.zeros((2, aug.RRC_ATTEMPTS * 4 + 1)), scale=(0.0, 0.0))
  assert boxes.tolist() == [[0, 83, 100, 133], [0, 0, 100, 100]]
  assert aug.center_box(512, 256) == (144.0, 16.0, 224.0, 224.0)


# ---- BatchIterator ----------------------------------------------------------------------

def test_shuffle_depends_only_on_seed_and_epoch():
  ds = _index_dataset(23)
  a = data.BatchIterator(ds, 5, train=True, seed=3, drop_remainder=False, prefetch=0)
  epochs = [np.concatenate([_indices(b)[b["mask"] > 0] for b in _take(a, 5)])
            for _ in range(3)]
  for order in epochs:  # each epoch visits every example exactly once
    assert np.array_equal(np.sort(order), np.arange(23))
  assert not np.array_equal(epochs[0], epochs[1])
  for e, order in enumerate(epochs):
    assert np.array_equal(order, data.epoch_permutation(3, e, 23))
  b = data.BatchIterator(ds, 5, train=True, seed=4, drop_remainder=False)
  assert not np.array_equal(_indices(next(b)), epochs[0][:5])
  ev = data.BatchIterator(ds, 5, train=False)
  assert np.array_equal(np.concatenate([_indices(x)[x["mask"] > 0] for x in ev]),
                        np.arange(23))


def test_augmentation_is_seeded():
  ds = _cifar_like()
  kw = dict(train=True, shuffle=False, prefetch=0)
  first = lambda seed, **k: next(data.BatchIterator(ds, 8, seed=seed, **kw, **k))
  a, a2, b = first(0), first(0), first(1)
  assert a["image"].shape == (8, 32, 32, 3) and a["image"].dtype == np.float32
  assert np.array_equal(a["image"], a2["image"])
  assert not np.array_equal(a["image"], b["image"])
  assert np.array_equal(a["label"], b["label"])  # same (unshuffled) examples
  plain = first(0, augment=False)["image"]
  x, _ = ds.read(np.arange(8))
  assert np.array_equal(plain, aug.normalize(x, ds.spec))
  assert not np.array_equal(plain, a["image"])


@pytest.mark.parametrize("prefetch", [0, 3])
def test_restore_reproduces_uninterrupted_batches(prefetch):
  ds = _cifar_like(n=30)
  make = lambda: data.BatchIterator(ds, 8, train=True, seed=7, prefetch=prefetch)
  ref_it = make()
  assert ref_it.steps_per_epoch == 3
  ref = _take(ref_it, 10)
  for k in (0, 2, 3, 5):  # 3 and 5 are across an epoch boundary
    it = make()
    _take(it, k)
    state = json.loads(json.dumps(it.get_state()))
    assert (state["epoch"], state["step"]) == divmod(k, 3)
    restored = make()
    restored.set_state(state)
    _assert_batches_equal(_take(restored, 10 - k), ref[k:])
    it.set_state(state)  # rewinding/reseeking a used iterator also works
    _assert_batches_equal(_take(it, 2), ref[k:k + 2])
    restored.close()


def test_set_state_rejects_a_different_stream():
  ds = _cifar_like(n=30)
  state = data.BatchIterator(ds, 8, train=True, seed=7).get_state()
  with pytest.raises(ValueError, match="seed"):
    data.BatchIterator(ds, 8, train=True, seed=8).set_state(state)
  with pytest.raises(ValueError, match="batch_size"):
    data.BatchIterator(ds, 4, train=True, seed=7).set_state(state)


def test_drop_remainder_versus_padding_and_mask():
  ds = _index_dataset(10)
  drop = data.BatchIterator(ds, 4, train=True, seed=0)
  assert drop.steps_per_epoch == 2 and drop.drop_remainder
  batch = next(drop)
  assert set(batch) == {"image", "label"}
  padded = data.BatchIterator(ds, 4, train=False)
  assert padded.steps_per_epoch == 3 and len(padded) == 3
  batches = list(padded)
  assert all(set(b) == {"image", "label", "mask"} for b in batches)
  assert all(b["image"].shape == (4, 4, 4, 3) and b["mask"].dtype == np.float32
             for b in batches)
  assert batches[-1]["mask"].tolist() == [1, 1, 0, 0]
  assert np.array_equal(_indices(batches[-1])[:2], [8, 9])
  assert not batches[-1]["image"][2:].any() and not batches[-1]["label"][2:].any()
  with pytest.raises(ValueError, match="not one full batch"):
    data.BatchIterator(_index_dataset(3), 4, train=True)


@pytest.mark.parametrize("drop_remainder", [True, False])
def test_process_shards_are_disjoint_and_union_is_global_batch(drop_remainder):
  ds = _cifar_like(n=30)  # augmented, so shards must also share the augmentation draws
  kw = dict(train=True, seed=5, drop_remainder=drop_remainder, prefetch=0)
  glob = _take(data.BatchIterator(ds, 8, **kw), 8)
  for count in (2, 4):
    shards = [_take(data.BatchIterator(ds, 8, process_index=i, process_count=count, **kw), 8)
              for i in range(count)]
    for step, g in enumerate(glob):
      parts = [s[step] for s in shards]
      assert all(p["image"].shape[0] == 8 // count for p in parts)
      for key in g:
        assert np.array_equal(np.concatenate([p[key] for p in parts]), g[key])
  idx = _index_dataset(30)
  kw["augment"] = False
  for step in range(3):
    seen = [_indices(data.BatchIterator(idx, 8, process_index=i, process_count=4, **kw)
                     .batch_at(0, step)) for i in range(4)]
    real = np.concatenate(seen)[:min(8, 30 - 8 * step)]
    assert len(np.unique(real)) == len(real)
  with pytest.raises(ValueError, match="divisible"):
    data.BatchIterator(ds, 10, train=True, process_count=4)


def test_state_restores_under_a_different_process_count():
  ds = _cifar_like(n=30)
  one = data.BatchIterator(ds, 8, train=True, seed=2)
  _take(one, 4)
  state, want = one.get_state(), next(one)
  halves = []
  for i in range(2):
    it = data.BatchIterator(ds, 8, train=True, seed=2, process_index=i, process_count=2)
    it.set_state(state)
    halves.append(next(it))
  for key in want:
    assert np.array_equal(np.concatenate([h[key] for h in halves]), want[key])
