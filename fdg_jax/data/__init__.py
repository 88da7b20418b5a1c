"""Image datasets for fdg_jax: loading without TensorFlow, augmentation, batching.

    ds = fdg_jax.data.load("cifar10", split="train", data_dir=None)
    it = fdg_jax.data.BatchIterator(ds, 128, train=True, seed=0)
    batch = next(it)   # {"image": float32 [128, 32, 32, 3], "label": int32 [128]}
    state = it.get_state(); ...; it.set_state(state)

Datasets (``list_datasets()``): ``digits`` (scikit-learn, offline) and the TFDS datasets
``mnist``, ``fashion_mnist``, ``cifar10``, ``cifar100``, ``svhn_cropped``, ``stl10``,
``imagenet2012``, read with ``tfds.data_source`` (ArrayRecord). ``fashion_mnist`` is also
read from its original IDX files, offline: those in ``data_dir``, else TFDS's copy, else
Debian's ``apt-get install dataset-fashion-mnist``. Nothing is downloaded: a dataset
missing from ``data_dir`` raises ``DatasetNotFoundError``. Constants live in
``fdg_jax.data.registry``. ``python -m fdg_jax.data --dataset NAME`` prints dataset info.

The trainer reads any dataset registered in ``fdg_jax.data.kinds`` by name: these, the
standard library's text corpus (``stdlib_text``) and a user's own (``register``, with
``image_dataset`` or ``token_dataset``).
"""

from fdg_jax.data.batches import epoch_permutation
from fdg_jax.data.iterator import BatchIterator
from fdg_jax.data.kinds import (Splits, TrainerData, image_dataset, register, token_dataset,
                                unregister)
from fdg_jax.data.registry import REGISTRY, DatasetSpec, get_spec, list_datasets
from fdg_jax.data.sources import (ArrayDataset, Dataset, DatasetFileError, DatasetNotFoundError,
                                  TfdsDataset, from_arrays, load, load_idx, open_tfds_source,
                                  resolve_data_dir)

__all__ = [
    "ArrayDataset", "BatchIterator", "Dataset", "DatasetFileError", "DatasetNotFoundError",
    "DatasetSpec", "REGISTRY", "TfdsDataset", "epoch_permutation", "from_arrays", "get_spec",
    "list_datasets", "load", "load_idx", "open_tfds_source", "resolve_data_dir", "Splits",
    "TrainerData", "image_dataset", "register", "token_dataset", "unregister",
]
