#!/usr/bin/env bash
# FlashAttention-4 for the GPU machine, which has no network and takes 64 MiB per call. The kit (flash-attn-4,
# quack-kernels, nvidia-cutlass-dsl with its cu13 libraries, tvm-ffi, torch-c-dlpack-ext) is 69 MB as xz, so it
# travels in two halves, .fa4a/ and .fa4b/, over two calls of one lease (a carried folder is gone on the machine
# once a call does not name it, so the first call stashes its half in /tmp):
#   bash benchmarks/fa4_kit.sh build                 # here, once (network); both folders git-ignored
#   bash benchmarks/fa4_kit.sh stash                 # there, call 1, carrying .fa4a (and whatever else it needs)
#   source benchmarks/fa4_kit.sh use                 # there, call 2, carrying .fa4b: unpacks, sets PYTHONPATH
# The machine already has cuda-bindings, cuda-pathfinder and einops (the device's package list), so they stay out.
parts=/tmp/fa4parts site=/tmp/fa4site  # (no set -u: `use` is sourced into the caller's shell)
case ${1:-} in
  build)
    cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
    grep -qx "/.fa4a/" .git/info/exclude 2>/dev/null || printf '/.fa4a/\n/.fa4b/\n' >> .git/info/exclude
    work=$(mktemp -d) && mkdir "$work/wheels" "$work/site" || exit 1
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      -d "$work/wheels" flash-attn-4==4.0.0b36 quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1 \
      nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 \
      apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 || exit 1
    # Wheels are zips; the GPU machine's Python (3.12) is not this one, so unpack rather than pip install.
    for wheel in "$work"/wheels/*.whl; do unzip -q -o "$wheel" -d "$work/site" || exit 1; done
    rm -rf .fa4a .fa4b && mkdir .fa4a .fa4b
    tar -C "$work/site" -cf - . | xz -T2 -9 | split -b 50000000 -d - "$work/part." || exit 1
    mv "$work/part.00" .fa4a/ && mv "$work/part.01" .fa4b/ || exit 1
    [ ! -e "$work/part.02" ] || { echo "fa4_kit: the kit outgrew two halves"; exit 1; }
    rm -rf "$work"; du -sh .fa4a .fa4b ;;
  stash)
    mkdir -p "$parts" && cp .fa4a/* "$parts"/ && ls -l "$parts" ;;
  use)
    if [ ! -d "$site/flash_attn" ]; then
      mkdir -p "$site" && cat "$parts"/* .fa4b/* | xz -d -T4 | tar -x -C "$site" || echo "fa4_kit: unpack failed"
    fi
    # The cutlass package sits under nvidia_cutlass_dsl/dsl_packages, found through a .pth file that Python reads
    # from site-packages only, never from PYTHONPATH.
    export PYTHONPATH=$site:$site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
    python3 -c "import flash_attn.cute.interface" && echo "fa4_kit: flash-attn-4 importable" ;;
  *) echo "usage: bash benchmarks/fa4_kit.sh build | stash; source benchmarks/fa4_kit.sh use"; return 2 2>/dev/null || exit 2 ;;
esac
