#!/usr/bin/env bash
# End-to-end `fit` of the ResNet-50 recipe on a generated folder of ~500x375 JPEGs, with the GPU
# prefetcher on: prints images/s per epoch (epoch start included) and peak GPU memory.
# Usage: benchmarks/fit_resnet50.sh [OUT_DIR] [extra train.py arguments...]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/bench}; shift || true
data=${BENCH_DATA:-/tmp/lit_imagenet_jpeg500}
python3 -m lit_imagenet.synthetic "$data" --train_per_class 4267 --val_per_class 500 \
  --width 500 --height 375 --quality 90 --processes "$(nproc)"
python3 train.py fit --config configs/resnet50.yaml --data.root "$data" --data.workers 15 \
  --trainer.max_epochs 2 --trainer.enable_progress_bar false \
  --trainer.default_root_dir "$out" --trainer.logger.init_args.save_dir "$out" "$@"
