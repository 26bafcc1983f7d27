#!/usr/bin/env bash
# gpu_train.sh: trains the small model on one H200 and writes it into $OUT (at most 8 files, each
# ≤ 15 MB): config.json, generation_config.json, tokenizer.json, model.safetensors.index.json,
# 3 safetensors shards and training_log.json (metrics + curve merged to stay within 8 files).
#
# Run from the repository root on the GPU machine:   bash tools/gpu_train.sh
# Budget: at most 8 min of training (it stops earlier at 32 epochs) + ~1 min for the tokenizer,
# evaluation and saving (< 10 min in all). The weights kept are those with the best validation bpb.
# Extra arguments are passed on to tools.train_small (e.g. --minutes 7 --lr 1e-3).
set -euo pipefail

: "${OUT:?set OUT to the folder whose files come back}"
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=true

python3 - <<'EOF'
import sys, sysconfig, torch
print("python", sys.version.split()[0], "stdlib", sysconfig.get_paths()["stdlib"])
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
EOF

python3 -m tools.train_small --out "$OUT" --minutes 8 --merged-log "$@"

n_files=$(find "$OUT" -type f | wc -l)
ls -l "$OUT"
echo "files in \$OUT: $n_files (limit 8)"
if [ "$n_files" -gt 8 ]; then
    echo "error: more than 8 files in \$OUT" >&2
    exit 1
fi
if find "$OUT" -type f -size +15M | grep -q .; then
    echo "error: a file in \$OUT is larger than 15 MiB" >&2
    exit 1
fi
