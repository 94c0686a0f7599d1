"""Gemma-3-270M on the GPU machine, one process, model loaded once per dtype: the searched configs (8K and 32K,
targets 0.95 and 0.90), quality at 32K on 20 retrieval prompts with the dense bf16-vs-fp32 drift, the d=256
sparse layers timed beside dense SDPA, the model-fixed layers through the Triton path against the model's own
forward, length generalisation (4K -> 16K, 8K -> 16K and 32K) and the statistics of all 18 layers.

    source scripts/device_env.sh; python3 scripts/gemma_h200.py --out $OUT [--steps a,b] [--budget 540]

Steps run in priority order and each writes its files as it ends (JSON under --out, a copy under --state so
a second call while the machine is warm skips what is done); a step that would start after --budget seconds
is left for the next call. `gemma_h200.json` lists every step with its seconds, files and result. On a CPU,
`--quick` runs every step at small lengths (the check that the script works before the GPU runs it).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GRAPH_MODES = {False: "eager", True: "graph", None: "default"}  # SparsePrefill(graph_index=): never, always, where faster
STEPS = ("search32k", "quality32k", "timing32k", "prefill32k", "fixed32k", "search8k", "generalize8k", "search4k", "generalize4k",
         "analyze32k")
ESTIMATE_S = {"load": 60, "search32k": 40, "quality32k": 150, "timing32k": 15, "prefill32k": 20, "fixed32k": 15, "search8k": 15,
              "generalize8k": 70, "search4k": 10, "generalize4k": 40, "analyze32k": 60}  # H200 guesses


class Run:
    def __init__(self, args: argparse.Namespace):
        import torch

        self.args, self.t0 = args, time.perf_counter()
        self.out, self.state = Path(args.out), Path(args.state)
        self.out.mkdir(parents=True, exist_ok=True)
        self.state.mkdir(parents=True, exist_ok=True)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        q = args.quick
        self.n32, self.n16, self.n8, self.n4 = (1024, 512, 256, 128) if q else (32768, 16384, 8192, 4096)
        self.samples = 2 if q else 10  # per retrieval task: passkey + multikey = 20 prompts per config
        self.summary_path = self.out / "gemma_h200.json"
        old = self.state / "gemma_h200.json"
        self.summary = json.loads(old.read_text()) if old.exists() else {"steps": {}}
        self.summary.update(environment=self.environment(), quick=q, device=self.device,
                            command="python3 scripts/gemma_h200.py " + " ".join(sys.argv[1:]))
        self._models: dict[str, tuple] = {}

    # ---- helpers -----------------------------------------------------------------------------------
    @staticmethod
    def environment() -> dict:
        import torch
        import transformers

        from workbench.core.timing import environment

        return {**environment(), "transformers": transformers.__version__, "torch": torch.__version__}

    def model(self, dtype: str):
        """(model, tok, shape) of Gemma-3-270M in `dtype` on the device, loaded once (the first load
        dequantises the GGUF into $WORKBENCH_CACHE)."""
        import torch

        from workbench.core.model import GEMMA, load_model

        if dtype not in self._models:
            t = time.perf_counter()
            self._models[dtype] = load_model(GEMMA, device=self.device, dtype=getattr(torch, dtype))
            self.summary.setdefault("load_seconds", {})[dtype] = round(time.perf_counter() - t, 1)
        return self._models[dtype]

    def path(self, name: str) -> Path:
        return self.state / name

    def config(self, n: int, target: float):
        from workbench.config import HeadConfig

        shape = self.model("float32")[2]
        return HeadConfig.load(self.path(config_name(n, target)), shape)

    def save(self) -> None:
        from workbench.core.io import write_json

        write_json(self.state / "gemma_h200.json", self.summary)
        for f in self.state.iterdir():  # everything made so far, also by an earlier call
            if f.is_file():
                shutil.copy2(f, self.out / f.name)

    # ---- steps -------------------------------------------------------------------------------------
    def search(self, n: int) -> dict:
        """search_heads at n on passkey, code, vartrack (seed 0) in fp32; target 0.95, and 0.90 re-chosen
        from the stored evidence (`prefill.quality.rechoose`)."""
        from workbench.core.corpus import make_sample
        from workbench.prefill.quality import rechoose
        from workbench.search.search import search_heads

        model, tok, shape = self.model("float32")
        samples = [make_sample(t, tok, n, seed=0) for t in ("passkey", "code", "vartrack")]
        t = time.perf_counter()
        cfg, _ = search_heads(model, tok, shape, samples, target=0.95, progress=False, provenance={
            "command": f"scripts/gemma_h200.py (search_heads at {n}, tasks passkey,code,vartrack, seed 0, fp32)"})
        seconds = time.perf_counter() - t
        cfg.save(self.path(config_name(n, 0.95)))
        low = rechoose(cfg, 0.90)
        low.save(self.path(config_name(n, 0.90)))
        return {"seconds_search": round(seconds, 1), "files": [config_name(n, 0.95), config_name(n, 0.90)],
                **{f"t{t}": {"summary": c.summary(), "free_layer_physical_density": free_density(c, shape)}
                   for t, c in ((0.95, cfg), (0.90, low))}}

    def search32k(self) -> dict:
        return self.search(self.n32)

    def search8k(self) -> dict:
        return self.search(self.n8)

    def search4k(self) -> dict:
        return self.search(self.n4)

    def quality32k(self) -> dict:
        """prefill quality at 32K, bf16 Triton path, passkey and multikey (10 each: 20 prompts) per config, the
        dense fp32 model beside it for the drift; the two tasks' reports merged per config."""
        from workbench.prefill.quality import merge_reports, quality_report

        model, tok, shape = self.model("bfloat16")
        fp32 = self.model("float32")[0]
        out = {}
        for target in (0.95, 0.90):
            cfg = self.config(self.n32, target)
            parts = []
            for task in ("passkey", "multikey"):
                name = f"prefill_quality_gemma_{tokens(self.n32)}_t{target:.2f}_{task}.json"
                command = f"scripts/gemma_h200.py quality32k ({task}, {config_name(self.n32, target)})"
                quality_report(model, tok, shape, cfg, lengths=[self.n32], samples=self.samples, task=task,
                               cosine_samples=2, sensitivity_samples=1, out=self.path(name), progress=False,
                               drift_model=fp32, command=command, backend=self.args.backend)
                parts.append(self.path(name))
            merged = f"prefill_quality_gemma_{tokens(self.n32)}_t{target:.2f}.json"
            rep = merge_reports(parts, self.path(merged))
            out[f"t{target}"] = {"file": merged, **rep["summary"]["per_length"][str(self.n32)]}
        return out

    def timing32k(self) -> dict:
        """The d=256 layers timed beside dense causal SDPA on the same q/k/v (bf16): the last full layer (17) under
        each config, and a sliding layer (16) under its fixed window; the index eager, from a CUDA graph and as the
        default keeps it (`GRAPH_MODES`)."""
        from workbench.core.capture import capture_attention
        from workbench.core.corpus import make_sample
        from workbench.prefill.latency import time_model_layer

        model, tok, shape = self.model("bfloat16")
        ids = make_sample("passkey", tok, self.n32, seed=0).input_ids
        cap = capture_attention(model, shape, ids, [shape.fixed_layers[-1], shape.free_layers[-1]], progress=False)
        rows = []
        for target in self.args.targets:
            cfg = self.config(self.n32, target)
            for layer in cap.layers:
                for graph, name in GRAPH_MODES.items():  # the index eager, replayed from a CUDA graph, the default
                    timed = time_model_layer(cap, cfg, layer, reps=10, backend=self.args.backend, graph_index=graph)
                    rows.append({"config": config_name(self.n32, target), "index": name, **timed})
        return {"rows": rows}

    def prefill32k(self) -> dict:
        """The whole 32K prefill (bf16, one forward, last logits) dense against the searched configs with the index
        eager, replayed from CUDA graphs and as the default keeps it (`SparsePrefill(graph_index=)`, `GRAPH_MODES`):
        median ms of each, side by side in one process, and whether the sparse runs' logits are equal (the graph
        replays the same launches)."""
        import torch

        from workbench.core.corpus import make_sample
        from workbench.core.timing import time_ms
        from workbench.prefill.sparse import SparsePrefill

        model, tok, shape = self.model("bfloat16")
        ids = make_sample("passkey", tok, self.n32, seed=0).input_ids[None].to(self.device)
        forward = lambda: model(ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()  # noqa: E731
        rows = []
        with torch.no_grad():
            dense_ms = time_ms(forward, min_reps=5)
            for target in self.args.targets:
                cfg, logits, row = self.config(self.n32, target), {}, {"config": config_name(self.n32, target)}
                for graph, name in GRAPH_MODES.items():
                    with SparsePrefill(model, shape, cfg, min_length=0, backend=self.args.backend,
                                       graph_index=graph) as sp:
                        logits[name] = forward()
                        ms = time_ms(forward, min_reps=5)
                    row[f"{name}_ms"] = ms
                    row[f"{name}_speedup_vs_dense"] = dense_ms / ms
                    if sp.index_graphs is not None:
                        row[f"{name}_graphs"] = len(sp.index_graphs)
                        row[f"{name}_capture_failures"] = list(sp.index_graphs.failures.values())
                        row[f"{name}_eager_and_replay_ms"] = {str(key): t for (key, _), t in sp.index_graphs.timings.items()}
                row["logits_equal"] = all(torch.equal(logits["eager"], x) for x in logits.values())
                rows.append(row)
        return {"dense_ms": dense_ms, "rows": rows}

    def fixed32k(self) -> dict:
        """The model's own forward against the sparse prefill that runs its 15 sliding layers through the sparse
        path (A-shape, no sink, window 512; Triton on the GPU) and its 3 full layers dense, bf16 and fp32."""
        import torch

        from workbench.config import HeadConfig, HeadEntry
        from workbench.core.corpus import make_sample
        from workbench.prefill.sparse import SparsePrefill

        out = {}
        for dtype in ("bfloat16", "float32"):
            model, tok, shape = self.model(dtype)
            heads = [HeadEntry.model_fixed(l, h, shape.window(l)) if shape.window(l) else HeadEntry(l, h, "dense", {})
                     for l in range(shape.n_layers) for h in range(shape.n_heads)]
            cfg = HeadConfig(model=shape.to_dict(), heads=heads, provenance={"source": "the model's own windows"})
            ids = make_sample("multikey", tok, self.n32, seed=0).input_ids[None].to(self.device)
            with torch.no_grad():
                dense = model(ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()
                with SparsePrefill(model, shape, cfg, min_length=0, backend=self.args.backend) as sp:
                    sparse = model(ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()
            p, q = torch.log_softmax(dense.double(), -1), torch.log_softmax(sparse.double(), -1)
            out[dtype] = {"calls": {f"{m} ({r})": c for (m, r), c in sp.calls.items()},
                          "max_abs_logit_diff": float((dense - sparse).abs().max()),
                          "kl": float((p.exp() * (p - q)).sum()), "top1_equal": bool(dense.argmax() == sparse.argmax())}
        return out

    def generalize(self, n: int, lengths: list[int]) -> dict:
        from workbench.prefill.generalize import generalization_report
        from workbench.views.lengths import write_html

        model, tok, shape = self.model("float32")
        cfg = self.config(n, 0.95)
        name = f"length_generalization_gemma_{tokens(n)}_h200.json"
        rep = generalization_report(model, tok, shape, cfg, lengths=lengths, tasks=["multikey"], samples=2,
                                    quality_samples=4, backend=self.args.backend, out=self.path(name),
                                    config_source=config_name(n, 0.95),
                                    command=f"scripts/gemma_h200.py generalize ({config_name(n, 0.95)} -> {lengths})",
                                    progress=False)
        write_html(rep, self.path(name).with_suffix(".html"))
        return {"file": name, "summary": rep["summary"], "dropping": {v: [(r["layer"], r["head"], r["drop"]) for r in rows]
                                                                       for v, rows in rep["dropping"].items()},
                "quality": {v: {k: x for k, x in q.items() if k != "records"} for v, q in rep["quality"].items()}}

    def generalize8k(self) -> dict:
        return self.generalize(self.n8, [self.n16, self.n32])

    def generalize4k(self) -> dict:
        return self.generalize(self.n4, [self.n16])

    def analyze32k(self) -> dict:
        """Every head of all 18 layers at 32K (one passkey prompt, fp32): the statistics and head kinds of
        `workbench analyze` (no pattern fits: the searches hold those of the 3 full layers). On a sliding
        layer they describe the full causal softmax of its q/k, not the window the model computes."""
        from workbench.analysis.head_kinds import profile_layer
        from workbench.analysis.stats import layer_stats
        from workbench.core.capture import capture_attention
        from workbench.core.corpus import make_sample
        from workbench.core.io import write_json

        model, tok, shape = self.model("float32")
        sample = make_sample("passkey", tok, self.n32, seed=0)
        profiles = []
        for layer in range(shape.n_layers):  # one layer at a time: 18 layers of fp32 q/k/v at 32K would be 2.4 GB
            cap = capture_attention(model, shape, sample.input_ids, [layer], progress=False)
            q, k, _ = cap.layer_qkv(layer)
            st = layer_stats(q, k, cap.scale, maps=("max_map", "block_mass", "column_mass", "diag_mass", "row_entropy"))
            profiles += [{**p.to_dict(), "layer_type": shape.layer_types[layer]} for p in profile_layer(st, layer)]
        name = f"gemma_analyze_{tokens(self.n32)}.json"
        write_json(self.path(name), {"model": shape.to_dict(), "sample": sample.describe(), "heads": profiles})
        kinds: dict[str, int] = {}
        for p in profiles:
            kinds[f"{p['layer_type']}: {p['kind']}"] = kinds.get(f"{p['layer_type']}: {p['kind']}", 0) + 1
        return {"file": name, "kinds": kinds}

    # ---- driver ------------------------------------------------------------------------------------
    def run(self, steps: list[str]) -> int:
        failed = 0
        self.model("float32")
        self.save()
        for step in steps:
            done = self.summary["steps"].get(step, {})
            if done.get("ok"):
                continue
            left = self.args.budget - (time.perf_counter() - self.t0)
            if left < ESTIMATE_S[step]:
                self.summary["steps"][step] = {"ok": False, "skipped": f"{left:.0f} s left of --budget, step needs "
                                                                      f"~{ESTIMATE_S[step]} s: run again while warm"}
                continue
            t = time.perf_counter()
            try:
                result = getattr(self, step)()
                self.summary["steps"][step] = {"ok": True, "seconds": round(time.perf_counter() - t, 1), **result}
            except Exception as e:  # record it and go on with the next step
                failed += 1
                self.summary["steps"][step] = {"ok": False, "seconds": round(time.perf_counter() - t, 1),
                                               "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            print(json.dumps({step: {k: v for k, v in self.summary["steps"][step].items() if k != "traceback"}})[:1500],
                  flush=True)
            self.save()
        self.summary["seconds_total"] = round(time.perf_counter() - self.t0, 1)
        self.save()
        return 1 if failed else 0


def tokens(n: int) -> str:
    """32768 -> "32k", 768 -> "768"."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def config_name(n: int, target: float) -> str:
    return f"gemma-3-270m-{tokens(n)}-t{target:.2f}.json"


def free_density(cfg, shape) -> float:
    """Mean physical density of the heads of the layers the model does not fix (its full-attention layers)."""
    heads = [e for e in cfg.heads if not e.fixed and e.density]
    return round(sum(e.density["physical"] for e in heads) / max(len(heads), 1), 5)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the results (the device call's $OUT)")
    p.add_argument("--state", default="/tmp/gemma_h200", help="results kept between calls while the machine is warm")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, in this order: {','.join(STEPS)}")
    p.add_argument("--budget", type=float, default=540, help="seconds: no step starts that would end after it")
    p.add_argument("--quick", action="store_true", help="small lengths (a CPU check of the script)")
    p.add_argument("--targets", type=lambda x: [float(t) for t in x.split(",")], default=[0.95, 0.90],
                   help="timing32k: the searched configs' targets (their files in --state, e.g. copied from "
                        "workbench/data/configs)")
    p.add_argument("--backend", default="auto", help="sparse path: auto (Triton on CUDA), triton, torch (the reference)")
    args = p.parse_args()
    steps = [s for s in args.steps.split(",") if s]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        p.error(f"--steps: unknown {unknown}; use {','.join(STEPS)}")
    return Run(args).run(steps)


if __name__ == "__main__":
    sys.exit(main())
