#!/usr/bin/env bash
# Downloads the wheels a device host without network lacks into .wheels/ (ignored by git), for
# the host's Python and platform; the device tool carries the folder with the working tree.
#
#   bash benchmarks/offline_wheels.sh [PYTHON_VERSION] [PLATFORM]   # default: 3.12 manylinux2014_x86_64
#
# On the host (JAX, flax, optax, numpy already installed there): source benchmarks/device_env.sh
# The list: what the project imports beyond the GPU image's JAX stack (the H200 run of issue 36
# had to add exactly these). `pip download` resolves nothing (--no-deps): a missing dependency
# shows as an ImportError naming it on the host; add it to WHEELS.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYV="${1:-3.12}"
PLAT="${2:-manylinux2014_x86_64}"
PIP="${PIP:-python3 -m pip}"
WHEELS=(google-crc32c grain array-record portpicker ml_collections bm25s PyStemmer gguf)
# .wheels/extra: dependencies an image may lack (benchmarks/device_env.sh installs only those
# whose module does not import there): the tokenizer, shape annotations, the evaluation's plots
EXTRA=(sentencepiece jaxtyping wadler_lindig matplotlib contourpy cycler fonttools kiwisolver pyparsing pillow
  python-dateutil six packaging tqdm)
mkdir -p .wheels
# several platform tags: a wheel built for a newer manylinux still installs on a current host
$PIP download --no-deps --only-binary=:all: --python-version "$PYV" --platform "$PLAT" \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
  -d .wheels "${WHEELS[@]}"
$PIP download --no-deps --only-binary=:all: --python-version "$PYV" --platform "$PLAT" \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
  -d .wheels/extra "${EXTRA[@]}"
du -sh .wheels
