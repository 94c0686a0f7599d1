"""What each host KV store costs in quality, on the GPU (issue 26): the embedded model in bf16, a 4K passkey
prompt, 64 new tokens, teacher-forced top-1 agreement and KL vs dense-resident with the model-dtype store, for
the model dtype, FP8, INT8, INT4 and INT8-key / INT4-value stores (`compare_modes(..., quality=True)`). Writes
$OUT/q_gpu.json (the runs) and $OUT/q_gpu_quality.json; assets/benchmarks/decode_store_quality_h200.json holds
both with the machine. Run on the GPU machine after `source scripts/device_env.sh` (the embedded model staged, DEVELOPERS.md)."""
import json
import os

import torch

from workbench.core.corpus import make_sample
from workbench.core.model import load_model
from workbench.decode.compare import compare_modes
from workbench.patterns.infllm import Budget

model, tok, _ = load_model(device="cuda", dtype=torch.bfloat16)
ids = make_sample("passkey", tok, 4096, seed=0).input_ids
specs = ["dense-resident", "sparse-resident", "sparse-resident/forecast"] + [
    f"{m}@{s}" for s in ("fp8", "int8", "int4", "int8k-int4v") for m in ("sparse-resident", "sparse-resident/forecast")]
r = compare_modes(model, ids, modes=specs, new_tokens=64, budget=Budget(init=1, local=2, topk=8), quality=True,
                  trace=False, progress=False)
rows = r.rows()
print(json.dumps(r.quality, indent=1, default=str))
json.dump(r.quality, open(os.environ["OUT"] + "/q_gpu_quality.json", "w"), indent=1, default=str)
json.dump(rows, open(os.environ["OUT"] + "/q_gpu.json", "w"), indent=1, default=str)
for row in rows:
    print({k: row.get(k) for k in row if any(s in k for s in ("mode", "store", "top1", "kl", "agree", "tokens_per"))})
