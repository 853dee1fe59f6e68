#!/usr/bin/env bash
# The wheels a device check carries (launch/accelerator_check.sh installs them there): the packages this project
# imports that the device's image lacks (it has Python 3.12 with jax, flax, optax, orbax-checkpoint, numpy,
# absl-py, protobuf, etils, tensorstore, pyarrow, ...), at the versions constraints.txt pins, for the image's
# Python and platform, into .whl/ (git-ignored; name it in the device run's `carry`). Run here, where the package
# registry can be reached; the device machine reaches nothing. PY=3.13 for another Python there.
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-3.12}
PIP=${PIP:-python3 -m pip}
rm -rf .whl && mkdir -p .whl
# tensorflow-datasets and its own needs only for `data.source=tfds` and the tests; the check reads none.
$PIP download -q --no-deps --only-binary=:all: -c constraints.txt --python-version "$PY" --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_28_x86_64 --platform any -d .whl \
  grain array_record portpicker ml_collections tensorboardX zstandard importlib_resources
ls .whl
