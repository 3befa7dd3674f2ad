#!/usr/bin/env bash
# Builds the git-ignored kit .tt/ that run_v022.sh and run_v030.sh read: torchtitan v0.2.2's source and the
# wheels the GPU machine lacks (python 3.12, x86-64). Needs network once, here; the runs are offline.
#   bash benchmarks/torchtitan_anchor/build_kit.sh            # clones torchtitan (blobs on demand)
#   TORCHTITAN_GIT_DIR=/path/to/torchtitan.git bash ...       # or reads an existing clone or mirror
# Then carry .tt (about 4.4 MB) to the GPU machine beside the working tree.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
KIT=.tt
rm -rf "$KIT" && mkdir -p "$KIT/v022" "$KIT/wheels" "$KIT/wheels030"
git_dir=${TORCHTITAN_GIT_DIR:-}
if [ -z "$git_dir" ]; then
  git_dir=$(mktemp -d)/torchtitan.git
  git clone -q --bare --filter=blob:none https://github.com/pytorch/torchtitan.git "$git_dir"
fi
git --git-dir="$git_dir" archive v0.2.2 torchtitan | tar -x -C "$KIT/v022"
# Only llama3 runs: the experiments (several MB) stay out, as does the documentation.
find "$KIT/v022/torchtitan/experiments" -mindepth 1 -not -name __init__.py -prune -exec rm -rf {} +
find "$KIT/v022" -name '*.md' -delete
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$@"
}
download "$KIT/wheels" tyro==1.0.16 typeguard==4.6.0 docstring_parser==0.18.0 torchdata==0.11.0 datasets==5.2.0 \
  dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
download "$KIT/wheels030" torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing==0.1.1
du -sh "$KIT"
