#!/usr/bin/env bash
# Build the wheel folders the GPU machine needs (it has torch, Triton and transformers 5.17, no network) from the
# local .venv's versions, for CPython 3.12 on manylinux x86_64 (see DEVELOPERS.md):
#   .whl     transformers (5.17 there converts Gemma-3's GGUF tokenizer one character per token), gguf, jsonschema
#            and its dependencies, plotly, narwhals, huggingface-hub (5.25 needs >= 2.4; the machine has 1.33) and its
#            HTTP client; not what the machine has, nor Hugging Face's `kernels` / tomlkit, which 5.25 lists but the
#            workbench never uses (it loads with use_kernels=False)
#   .whl-ui  the dependency closure of panel, bokeh, ipykernel, nbclient, ipywidgets (notebooks and the dashboard),
#            less what the machine has (torch, numpy, jinja2 ...) and what .whl holds
#   scripts/device_wheels.sh        (after `make install`; then `scripts/device_payload.sh` packs .whl-ui)
set -euo pipefail
py=.venv/bin/python
get() {  # get DIR REQUIREMENTS-FILE
  mkdir -p "$1"
  $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$1" -r "$2"
}
tmp=$(mktemp -d)
closure() {  # closure ROOTS SKIP: name==version of ROOTS and their requirements (no extras) in .venv, less SKIP
  $py - "$1" "$2" <<'EOF'
import importlib.metadata as md, re, sys
from packaging.requirements import Requirement
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
skip, seen, todo = {norm(s) for s in sys.argv[2].split(",")}, {}, sys.argv[1].split(",")
while todo:
    name = norm(todo.pop())
    if name in seen or name in skip:
        continue
    dist = md.distribution(name)
    seen[name] = dist.version
    todo += [r.name for r in map(Requirement, dist.requires or []) if not r.marker or r.marker.evaluate({"extra": ""})]
print("\n".join(f"{n}=={v}" for n, v in sorted(seen.items())))
EOF
}
main="transformers,gguf,jsonschema,plotly,narwhals"
closure "$main" "numpy,packaging,pyyaml,regex,tokenizers,safetensors,tqdm,typer,sentencepiece,requests,typing-extensions,kernels,tomlkit,filelock,fsspec,anyio,idna,h11,certifi,sniffio" > "$tmp/main.txt"
closure "panel,bokeh,ipykernel,nbclient,nbformat,ipywidgets,panel-material-ui" \
  "torch,triton,numpy,sympy,mpmath,networkx,fsspec,filelock,typing-extensions,jinja2,markupsafe,setuptools,pip,debugpy,widgetsnbextension,$main,jsonschema-specifications,referencing,rpds-py,attrs" \
  > "$tmp/ui.txt"
get .whl "$tmp/main.txt"
get .whl-ui "$tmp/ui.txt"
for d in .whl .whl-ui; do grep -qxF "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
echo ".whl: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1); .whl-ui: $(ls .whl-ui | wc -l) wheels, $(du -sh .whl-ui | cut -f1)"
rm -rf "$tmp"
