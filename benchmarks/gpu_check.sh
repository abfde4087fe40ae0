#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one script for a lent machine (CI has none).
#
#   benchmarks/gpu_check.sh OUT [PARTS]
#
# PARTS (comma-separated, default "tests,quick,gpt"):
#   tests  pytest tests/test_devices.py (float64 on the GPU against the CPU, NCCL
#          in a group of one, float32 training, checkpoints across devices)
#   quick  `kaisa demo --quick --device cuda` (what `make demo-quick` runs)
#   gpt    the gpt workload on the GPU: AdamW, Muon, SOAP and AdamW + kaisa in
#          the language-model configuration, $GPT_SEEDS seeds (default 0)
#   images the three image workloads likewise, $IMAGE_SEEDS seeds (default 0)
#   gpt-defaults  the gpt workload with kaisa's defaults: AdamW, Muon, AdamW + kaisa
#   timm   benchmarks/timm_coverage.py on the GPU: timm's models (the image has timm
#          and torchvision; the pinned CPU machines do not), coverage and a short run
#   transfer  benchmarks/timm_lr_transfer.py on the GPU: timm models on Fashion-MNIST,
#          AdamW alone and AdamW + kaisa at AdamW's rates ($TRANSFER_MODELS)
#   eigh   benchmarks/eigh_devices.py: one eigendecomposition on the CPU and the GPU
#   refresh  benchmarks/refresh_cost.py --part sides on the GPU: the refresh's
#          finiteness check and a warm low-rank refresh with it, session 25's way and now
#   suite  the whole test suite on that machine's CPU (torch as installed there)
#
# The machine runs its own python3 and packages (no network): the data and
# heavyball come in .gpu/ (git-ignored; see benchmarks/README.md, "On a GPU"),
# Fashion-MNIST in .gpu/fashion-mnist, the fortunes corpus in .gpu/fortunes,
# wheels in .gpu/whl. Each part has its own time limit and log under OUT; a
# failing part does not stop the next. DEVICE=cpu runs the demo parts here.
# The device tool brings back at most 8 files: pack OUT (tar) into its $OUT.
set -u
out=${1:?usage: benchmarks/gpu_check.sh OUT [PARTS]}
parts=${2:-tests,quick,gpt}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .gpu/whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .gpu/whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv || true
    python3 -c 'import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA")'
    nproc
    cat /proc/loadavg
} 2>&1 | tee "$out/machine.txt"

LM_KFAC="--factor-update-steps 5 --inv-update-steps 5 --eigenvalue-correction ekfac \
--eigenbasis-tolerance 0.05 --time-budget 1.25 --adaptive-intervals on"
demo=(python3 -m kaisa.demo.cli --device "${DEVICE:-cuda}" --data-dir .gpu/fashion-mnist
    --text-dir .gpu/fortunes --no-progress)
part() {  # part NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s) $(date -u +%T)"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc in $((SECONDS - t0)) s"
    tail -n 25 "$out/$name.log"
}
for p in ${parts//,/ }; do
    case $p in
    tests) part tests 240 python3 -m pytest -q -p no:cacheprovider tests/test_devices.py ;;
    quick) part quick 240 "${demo[@]}" --quick --out "$out/quick" ;;
    gpt) part gpt 420 "${demo[@]}" --workload gpt --arms adamw,muon,soap,kaisa-adamw \
        --seeds "${GPT_SEEDS:-0}" $LM_KFAC --out "$out/gpt" ;;
    images) part images 420 "${demo[@]}" --workload gap_cnn,small_cnn,vit \
        --arms adamw,muon,kaisa-sgd,kaisa-adamw --seeds "${IMAGE_SEEDS:-0}" $LM_KFAC \
        --out "$out/images" ;;
    gpt-defaults) part gpt-defaults 300 "${demo[@]}" --workload gpt \
        --arms adamw,muon,kaisa-adamw --seeds "${GPT_SEEDS:-0}" --out "$out/gpt-defaults" ;;
    timm) part timm 150 python3 benchmarks/timm_coverage.py --device "${DEVICE:-cuda}" \
        --json "$out/timm.json" ;;
    transfer) part transfer 240 python3 benchmarks/timm_lr_transfer.py --device "${DEVICE:-cuda}" \
        --data-dir .gpu/fashion-mnist --models "${TRANSFER_MODELS:-resnet18,convnext_atto,vit_tiny_patch16_224,efficientnet_b0}" \
        --json "$out/transfer.json" ;;
    eigh) part eigh 120 python3 benchmarks/eigh_devices.py --json "$out/eigh.json" ;;
    refresh) part refresh 120 python3 benchmarks/refresh_cost.py --part sides \
        --device "${DEVICE:-cuda}" --json "$out/refresh.json" ;;
    suite) part suite 500 python3 -m pytest -q -p no:cacheprovider -x tests ;;
    *) echo "unknown part $p" >&2 ;;
    esac
done
cat /proc/loadavg
