"""The papers' CIFAR-100 experiments; arguments as configs/cifar10.py.

    python train.py --config configs/cifar100.py:model=resnet110,k=2,algorithm=fdg
"""

import importlib.util
import pathlib

_path = pathlib.Path(__file__).with_name("cifar10.py")
_spec = importlib.util.spec_from_file_location("_fdg_config_cifar10", _path)
cifar10 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cifar10)


def get_config(arg: str | None = None):
  return cifar10.make("cifar100", arg)
