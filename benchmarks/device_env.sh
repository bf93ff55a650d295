#!/usr/bin/env bash
# Source on a device host without network, from the checkout's root, before any benchmark or
# launcher:   source benchmarks/device_env.sh
# Installs into /tmp/site, from the wheels `bash benchmarks/offline_wheels.sh` put in .wheels/
# and .wheels/extra/, those whose module the host's Python cannot import (a GPU image has JAX,
# flax, optax, numpy; the H200 one lacked the first eight below), then puts /tmp/site first on
# PYTHONPATH. Nothing is downloaded; a module with neither an import nor a wheel, and a wheel
# that does not install, are named (an ImportError later says which one mattered).
PY="${PYTHON:-python3}"
SITE="${DEVICE_SITE:-/tmp/site}"
missing=()
# wheel file prefix : module it provides
for pair in google_crc32c:google_crc32c grain:grain array_record:array_record portpicker:portpicker \
  ml_collections:ml_collections bm25s:bm25s pystemmer:Stemmer gguf:gguf \
  sentencepiece:sentencepiece jaxtyping:jaxtyping wadler_lindig:wadler_lindig matplotlib:matplotlib \
  contourpy:contourpy cycler:cycler fonttools:fontTools kiwisolver:kiwisolver pyparsing:pyparsing \
  pillow:PIL python_dateutil:dateutil six:six packaging:packaging tqdm:tqdm; do
  if ! "$PY" -c "import ${pair#*:}" 2>/dev/null; then
    found=(.wheels/"${pair%%:*}"-*.whl .wheels/extra/"${pair%%:*}"-*.whl)
    found=($(ls "${found[@]}" 2>/dev/null))
    if [[ ${#found[@]} -gt 0 ]]; then missing+=("${found[0]}"); else echo "device_env: no module ${pair#*:} and no wheel for it" >&2; fi
  fi
done
installed=0
for whl in "${missing[@]}"; do  # one at a time: a wheel for another Python is named and skipped
  if "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$whl" 2>/dev/null; then
    installed=$((installed + 1))
  else
    echo "device_env: $whl does not install for $PY (another Python or platform?); skipped" >&2
  fi
done
echo "device_env: installed $installed wheel(s) the host lacked into $SITE" >&2
export PYTHONPATH="$SITE:.${PYTHONPATH:+:$PYTHONPATH}"
