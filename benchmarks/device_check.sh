#!/usr/bin/env bash
# The CUDA checks of issue 34 (item 3), as one script for a lent GPU machine (the `device`
# tool): the CUDA tests, then the device-noise and CNN-step benchmarks. Run from the repository
# root, with the wheels of flwr, cryptography, pycryptodome, grpcio-health-checking,
# iterators, tomli, tomli-w and opacus in .whl/ (that machine has no registry):
#
#     bash benchmarks/device_check.sh       # writes to $OUT (default ./device-out)
#     bash benchmarks/device_check.sh host  # instead: that machine's CPU figures (draws,
#                                           # a learner message beside plain's and its draws)
set -o pipefail
OUT=${OUT:-device-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    2>&1 | tee -a "$OUT/gpu.txt"
status=0
if [ "${1:-}" = host ]; then
    lscpu | grep -E "Model name|^CPU\(s\)|Flags" | sed -E 's/(Flags:).*(avx512f).*/\1 ... \2 .../' \
        | tee "$OUT/host-cpu.txt"
    timeout 200 python3 benchmarks/cipher_noise.py --dims 100000 1000000 --repeats 20 \
        --cpu-time 2>&1 | tee "$OUT/host-draws.txt" || status=1
    OPENBLAS_NUM_THREADS=1 timeout 200 python3 benchmarks/flower_scale.py --message-cpu 40 \
        --dims 100000 --dtype float32 2>&1 | tee "$OUT/host-message.txt" || status=1
    exit $status
fi
timeout 240 python3 -m pytest -q -rs -o addopts="" -p no:cacheprovider -n 8 \
    tests/noise/test_device_noise.py tests/torch/test_torch_private.py \
    tests/torch/test_pytorch.py tests/torch/test_torch_streams.py 2>&1 \
    | tee "$OUT/cuda-tests.txt" || status=1
timeout 150 python3 benchmarks/device_noise.py --device cuda --dims 1000000 10000000 \
    --repeats 20 2>&1 | tee "$OUT/device-noise.txt" || status=1
timeout 150 python3 benchmarks/torch_step.py --device cuda --batch-sizes 64 --steps 20 \
    --repeats 7 --no-host --profile 2>&1 | grep -v Warning | tee "$OUT/torch-step-cuda.txt" || status=1
exit $status
