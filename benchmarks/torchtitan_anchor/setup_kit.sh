# Sourced by run_v022.sh and run_v030.sh from the repo root: the kit's common wheels in $SITE, offline settings,
# and the generated tokenizer and data in $ASSETS. $1 names the run in error messages.
HERE=$PWD/benchmarks/torchtitan_anchor
KIT=$PWD/.tt  # built by benchmarks/torchtitan_anchor/build_kit.sh
SITE=/tmp/tt_site  # tyro, torchdata, datasets... (.tt/wheels)
ASSETS=/tmp/tt_assets
if [ ! -d "$SITE/tyro" ]; then
  rm -rf "$SITE"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$KIT"/wheels/*.whl \
    || { echo "$1: wheel install failed"; exit 1; }
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export HF_DATASETS_CACHE=/tmp/tt_hf_datasets TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
if [ ! -s $ASSETS/tokenizer/tokenizer.json ] || [ ! -s $ASSETS/c4_test/data.json ]; then
  python3 "$HERE/make_assets.py" $ASSETS || { echo "$1: asset generation failed"; exit 1; }
fi
