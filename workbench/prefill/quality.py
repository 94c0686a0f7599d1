"""What a head config costs in quality: sparse prefill vs dense on retrieval prompts, end to end.

Per prompt length and sample (a passkey / needle at depths spread over the context, one seed each):

- next-token KL(dense || sparse) and top-1 agreement at the answer position (the prompt's last token,
  which precedes the answer);
- greedy decoding of a few tokens after a dense and after a sparse prefill (decode steps are dense in
  both, reading the cache each prefill wrote): retrieval accuracy = the answer appears in the text;
- per-layer cosine between the sparse and the dense attention output on the same inputs (first
  `cosine_samples` samples per length);
- the one-layer-at-a-time sensitivity table: sparsity on a single layer, KL and top-1 at the answer
  position, on `sensitivity_samples` prompts (layers whose heads are all dense are skipped). Layers
  before the sparse one are computed once: the run resumes from the stored input of that layer.

The dense side of each sample (greedy tokens and next-token logits) does not depend on the config:
it is cached per model fingerprint and prompt (`dense_greedy`), so comparing several configs on the
same prompts pays for dense once.

The report is rewritten (atomically) after every sample and resumes from an existing file made with
the same config and settings, so a long CPU run can be stopped and continued (the sensitivity table
runs first, then the samples, interleaved over the lengths). `merge_reports` joins reports of the
same config run in parallel (e.g. one process per length).
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from workbench.config import HeadConfig
from workbench.core.device import model_device
from workbench.core.io import write_json
from workbench.core.model import ModelShape
from workbench.prefill.sparse import SparsePrefill, generate_greedy

KL_BAR = 0.05
BACKENDS = {"torch": "PyTorch reference of the sparse kernel's tiles",
            "triton": "Triton index builders + Triton sparse kernel (the deployed path)"}


def gpu_environment(device_type: str) -> dict[str, Any]:
    """GPU name, driver-side CUDA and Triton versions when the run is on a GPU (empty on the CPU)."""
    if device_type != "cuda":
        return {}
    import triton

    return {"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda, "triton": triton.__version__}


def kl_top1(dense_logits: torch.Tensor, sparse_logits: torch.Tensor) -> tuple[float, bool]:
    """(KL(p_dense || p_sparse) in nats, whether the top-1 tokens agree) from two logit vectors `[V]`."""
    p = torch.log_softmax(dense_logits.double(), -1)
    q = torch.log_softmax(sparse_logits.double(), -1)
    return float((p.exp() * (p - q)).sum()), bool(dense_logits.argmax() == sparse_logits.argmax())


def config_digest(config: HeadConfig) -> str:
    return hashlib.sha256(json.dumps([h.to_dict() for h in config.heads], sort_keys=True).encode()).hexdigest()[:16]


class LayerInputs:
    """Keeps every decoder layer's input (hidden state and keyword arguments) of one dense prefill, so a
    prefill can be resumed from any layer: `logits_from(layer)` runs layers `layer..L-1` (each with its own
    keyword arguments: Gemma's layers differ in mask and RoPE), the final norm and the LM head on the last
    position. Decoders with model.model.layers / norm and lm_head (Llama family, Gemma-3)."""

    def __init__(self, model: torch.nn.Module, input_ids: torch.Tensor):
        self.model = model
        self.inputs: list[tuple[torch.Tensor, dict[str, Any]]] = []
        layers = model.model.layers

        def keep(_module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self.inputs.append((hidden.detach(), {k: v for k, v in kwargs.items() if k != "hidden_states"}))

        handles = [layer.register_forward_pre_hook(keep, with_kwargs=True) for layer in layers]
        try:
            with torch.no_grad():
                ids = input_ids.reshape(1, -1).to(model_device(model))
                self.logits = model(ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()
        finally:
            for h in handles:
                h.remove()

    @torch.no_grad()
    def logits_from(self, layer: int) -> torch.Tensor:
        hidden = self.inputs[layer][0]
        for block, (_, kwargs) in zip(self.model.model.layers[layer:], self.inputs[layer:]):
            out = block(hidden, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
        return self.model.lm_head(self.model.model.norm(hidden[:, -1:]))[0, -1].float()


def dense_cache_path(model: torch.nn.Module, shape: ModelShape, sample: Any, max_new_tokens: int) -> Path:
    """Where `dense_greedy` caches one prompt's dense result: keyed by weights, device type and dtype."""
    from workbench.core.model import cache_dir

    p = next(model.parameters())
    where = f"{model_device(model).type}-{str(p.dtype).removeprefix('torch.')}"
    return cache_dir() / "dense" / shape.fingerprint[:16] / where / f"{sample.sha}-{sample.length}-{max_new_tokens}.pt"


def dense_greedy(model: torch.nn.Module, tok: Any, shape: ModelShape, sample: Any,
                 max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """`generate_greedy` of the dense model on `sample`, cached on disk under the model's weights
    fingerprint, device type, dtype and the prompt's sha: (tokens `[T]`, next-token logits `[V]`, seconds it
    took to compute). A bf16 GPU run never reuses fp32 CPU results."""
    from workbench.core.io import atomic_path

    path = dense_cache_path(model, shape, sample, max_new_tokens)
    if path.exists():
        hit = torch.load(path)
        return hit["tokens"], hit["logits"], hit["seconds"]
    t0 = time.perf_counter()
    tokens, logits = generate_greedy(model, sample.input_ids, max_new_tokens, tok.eos_token_id)
    seconds = round(time.perf_counter() - t0, 2)
    with atomic_path(path) as tmp:
        torch.save({"tokens": tokens, "logits": logits, "seconds": seconds}, tmp)
    return tokens, logits, seconds


def sample_record(model, tok, shape, config, sample, max_new_tokens: int, cosine: bool,
                   backend: str = "auto", drift_model: torch.nn.Module | None = None) -> dict[str, Any]:
    ids = sample.input_ids
    dense_tokens, dense_logits, dense_seconds = dense_greedy(model, tok, shape, sample, max_new_tokens)
    drift: dict[str, Any] = {}
    if drift_model is not None:  # the same dense model in fp32: how far the dtype alone moves the answer
        ref_tokens, ref_logits, _ = dense_greedy(drift_model, tok, shape, sample, max_new_tokens)
        drift_kl, drift_agree = kl_top1(ref_logits, dense_logits)
        drift = {"dense_fp32_correct": sample.answer in tok.decode(ref_tokens, skip_special_tokens=True),
                 "dense_drift_kl": drift_kl, "dense_drift_top1_agree": drift_agree}
    t1 = time.perf_counter()
    with SparsePrefill(model, shape, config, min_length=0, compare=cosine, backend=backend) as sp:
        sparse_tokens, sparse_logits = generate_greedy(model, ids, max_new_tokens, tok.eos_token_id)
    t2 = time.perf_counter()
    kl, agree = kl_top1(dense_logits, sparse_logits)
    dense_text = tok.decode(dense_tokens, skip_special_tokens=True)
    sparse_text = tok.decode(sparse_tokens, skip_special_tokens=True)
    rec = {"n": sample.length, "seed": sample.seed, "depth": sample.depth, "answer": sample.answer,
           "dense_text": dense_text, "sparse_text": sparse_text,
           "dense_correct": sample.answer in dense_text, "sparse_correct": sample.answer in sparse_text,
           "kl": kl, "top1_agree": agree, "dense_seconds": dense_seconds, "sparse_seconds": round(t2 - t1, 2),
           "sha": sample.sha, **drift}
    if cosine:
        rec["cosine"] = {str(l): [round(float(x), 6) for x in c] for l, c in sorted(sp.cosine.items())}
    return rec


def sensitivity(model, shape: ModelShape, config: HeadConfig, input_ids: torch.Tensor,
                progress: bool = True, backend: str = "auto") -> list[dict[str, Any]]:
    """One layer sparse at a time on one prompt: [{layer, kl, top1_agree}] for layers with sparse heads
    (layers the model fixes run as the model does and are skipped)."""
    from workbench.prefill.sparse import LayerPlan

    base = LayerInputs(model, input_ids)
    rows = []
    layers = [l for l in range(shape.n_layers)
              if not LayerPlan.from_config(config, l).all_dense and config.window(l) is None]
    for layer in tqdm(layers, desc="sensitivity", unit="layer", disable=not progress, leave=False):
        with SparsePrefill(model, shape, config, min_length=0, layers=[layer], backend=backend):
            logits = base.logits_from(layer)
        kl, agree = kl_top1(base.logits, logits)
        rows.append({"layer": layer, "kl": kl, "top1_agree": agree})
    return rows


def summarize(records: Sequence[dict[str, Any]], sens: Sequence[dict[str, Any]], n_layers: int) -> dict[str, Any]:
    """Per length: accuracy dense / sparse, KL mean / max, top-1 agreement; per layer: mean cosine and
    mean sensitivity KL; the worst layers by sensitivity."""
    out: dict[str, Any] = {"per_length": {}, "per_layer": [], "worst_layers": []}
    for n in sorted({r["n"] for r in records}):
        rs = [r for r in records if r["n"] == n]
        kls = sorted(r["kl"] for r in rs)
        dense_acc = sum(r["dense_correct"] for r in rs) / len(rs)
        sparse_acc = sum(r["sparse_correct"] for r in rs) / len(rs)
        out["per_length"][str(n)] = {
            "samples": len(rs), "dense_accuracy": dense_acc, "sparse_accuracy": sparse_acc,
            "accuracy_equal": dense_acc == sparse_acc, "kl_mean": sum(kls) / len(kls), "kl_median": kls[len(kls) // 2],
            "kl_max": kls[-1], "top1_agreement": sum(r["top1_agree"] for r in rs) / len(rs),
            "kl_bar": KL_BAR, "kl_mean_within_bar": sum(kls) / len(kls) <= KL_BAR,
            "dense_seconds_mean": sum(r["dense_seconds"] for r in rs) / len(rs),
            "sparse_seconds_mean": sum(r["sparse_seconds"] for r in rs) / len(rs)}
        drift = [r for r in rs if "dense_drift_kl" in r]
        if drift:  # dense in this dtype vs dense in fp32, beside the sparse-vs-dense numbers
            out["per_length"][str(n)].update({
                "dense_fp32_accuracy": sum(r["dense_fp32_correct"] for r in drift) / len(drift),
                "dense_drift_kl_mean": sum(r["dense_drift_kl"] for r in drift) / len(drift),
                "dense_drift_kl_max": max(r["dense_drift_kl"] for r in drift),
                "dense_drift_top1_agreement": sum(r["dense_drift_top1_agree"] for r in drift) / len(drift)})
    for layer in range(n_layers):
        cos = [min(r["cosine"][str(layer)]) for r in records if "cosine" in r and str(layer) in r["cosine"]]
        mean_cos = [sum(r["cosine"][str(layer)]) / len(r["cosine"][str(layer)]) for r in records
                    if "cosine" in r and str(layer) in r["cosine"]]
        sk = [s["kl"] for s in sens if s["layer"] == layer]
        out["per_layer"].append({"layer": layer, "cosine_mean": sum(mean_cos) / len(mean_cos) if mean_cos else None,
                                 "cosine_worst_head": min(cos) if cos else None,
                                 "sensitivity_kl_mean": sum(sk) / len(sk) if sk else None,
                                 "sensitivity_top1": (sum(s["top1_agree"] for s in sens if s["layer"] == layer) / len(sk))
                                 if sk else None})
    ranked = sorted((r for r in out["per_layer"] if r["sensitivity_kl_mean"] is not None),
                    key=lambda r: -r["sensitivity_kl_mean"])
    out["worst_layers"] = [{"layer": r["layer"], "sensitivity_kl_mean": r["sensitivity_kl_mean"],
                            "cosine_worst_head": r["cosine_worst_head"]} for r in ranked[:5]]
    return out


def quality_report(model: torch.nn.Module, tok: Any, shape: ModelShape, config: HeadConfig, *,
                   lengths: Sequence[int] = (4096, 8192), samples: int = 20, task: str = "passkey",
                   max_new_tokens: int = 8, cosine_samples: int = 4, sensitivity_length: int | None = None,
                   sensitivity_samples: int = 2, out: str | Path | None = None, command: str = "",
                   progress: bool = True, backend: str = "auto",
                   drift_model: torch.nn.Module | None = None) -> dict[str, Any]:
    """Run the quality comparison (see module docstring) and return the report dict; with `out`, write
    it after every sample and resume from it. Sparsity is on at every length (min_length 0). `backend`:
    SparsePrefill's ("triton", "flex", "torch" = reference); reports of several backends on the same
    prompts compare them (the dense side is cached per weights, device and dtype). `drift_model`: the same
    weights in fp32 on the same device; each record then also has the dense dtype-vs-fp32 drift."""
    from workbench.core.corpus import depths, make_sample

    config.validate(shape)
    for n in lengths:
        shape.check_length(n)
    if samples < 1:
        raise ValueError(f"samples={samples}: use at least 1 sample per length (20 for the report)")
    sens_n = sensitivity_length or min(lengths)
    where, dtype = model_device(model).type, str(next(model.parameters()).dtype).removeprefix("torch.")
    used = backend if backend != "auto" else ("triton" if where == "cuda" else "torch")
    settings = {"lengths": list(lengths), "samples": samples, "task": task, "max_new_tokens": max_new_tokens,
                "cosine_samples": cosine_samples, "sensitivity_length": sens_n,
                "sensitivity_samples": sensitivity_samples, "min_length": 0, "config_sha": config_digest(config),
                **({"backend": backend} if backend != "auto" else {}),  # "auto" keeps older reports resumable
                **({"device": where, "dtype": dtype} if (where, dtype) != ("cpu", "float32") else {}),
                **({"dense_drift": "fp32"} if drift_model is not None else {})}
    report: dict[str, Any] = {
        "model": shape.to_dict(), "config": {"provenance": config.provenance, "summary": config.summary(),
                                             "sha": settings["config_sha"]},
        "settings": settings, "command": command,
        "environment": {"torch": torch.__version__, "device": str(model_device(model)),
                        "dtype": str(next(model.parameters()).dtype), "threads": torch.get_num_threads(),
                        "backend": BACKENDS.get(used, used), **gpu_environment(where)},
        "records": [], "sensitivity": [], "sensitivity_prompts": []}
    if out is not None and Path(out).exists():
        old = json.loads(Path(out).read_text())
        if old.get("settings") == settings:
            report["records"], report["sensitivity"] = old["records"], old["sensitivity"]
            report["sensitivity_prompts"] = old.get("sensitivity_prompts", [])

    def save() -> None:
        report["summary"] = summarize(report["records"], report["sensitivity"], shape.n_layers) if report["records"] \
            or report["sensitivity"] else {}
        if out is not None:
            write_json(out, report)
            write_html(report, Path(out).with_suffix(".html"))

    sens_spread = depths(sensitivity_samples)
    for j in range(sensitivity_samples):
        if j in report["sensitivity_prompts"]:
            continue
        sample = make_sample(task, tok, sens_n, seed=1000 + j, depth=sens_spread[j])
        for row in sensitivity(model, shape, config, sample.input_ids, progress, backend):
            report["sensitivity"].append({**row, "prompt": j, "n": sens_n, "depth": sample.depth})
        report["sensitivity_prompts"].append(j)
        save()
    done = {(r["n"], r["seed"]) for r in report["records"]}
    spread = depths(samples)
    todo = [(i, n) for i in range(samples) for n in lengths]  # interleaved: partial runs cover every length
    bar = tqdm(total=len(todo), desc="quality", unit="sample", disable=not progress)
    for i, n in todo:
        bar.update(1)
        if (n, i) in done:
            continue
        sample = make_sample(task, tok, n, seed=i, depth=spread[i])
        rec = sample_record(model, tok, shape, config, sample, max_new_tokens, cosine=i < cosine_samples,
                             backend=backend, drift_model=drift_model)
        report["records"].append(rec)
        save()
    bar.close()
    save()
    return report


def merge_reports(paths: Sequence[str | Path], out: str | Path) -> dict[str, Any]:
    """Join quality reports of the same config (records and sensitivity rows), recompute the summary,
    write JSON + HTML to `out`."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    if len({r["settings"]["config_sha"] for r in reports}) != 1:
        raise ValueError("these reports were made with different head configs: merge reports of one config only")
    merged = {**reports[0], "records": [x for r in reports for x in r["records"]],
              "sensitivity": [x for r in reports for x in r["sensitivity"]],
              "command": " ; ".join(r["command"] for r in reports),
              "settings": {**reports[0]["settings"], "lengths": sorted({n for r in reports for n in r["settings"]["lengths"]}),
                           "merged_from": [r["settings"] for r in reports]}}
    merged["summary"] = summarize(merged["records"], merged["sensitivity"], merged["model"]["n_layers"])
    write_json(out, merged)
    write_html(merged, Path(out).with_suffix(".html"))
    return merged


def write_html(report: dict[str, Any], path: str | Path) -> Path:
    """The report as one self-contained HTML page of tables (no plotting library needed)."""
    from workbench.core.report import Report

    page = Report("Sparse prefill quality vs dense")
    s = report["settings"]
    page.text(f"Model {report['model']['name']} ({report['environment']['dtype']}, {report['environment']['device']}, "
              f"{report['environment']['backend']}); config sha {s['config_sha']} {report['config']['summary']}; "
              f"task {s['task']}, lengths {s['lengths']}, {s['samples']} samples per length (needle depths spread "
              f"over 0.05-0.95), greedy decoding of {s['max_new_tokens']} tokens; sparse at every length.")
    if report.get("command"):
        page.text("Command: " + report["command"])
    for note in report.get("notes", []):
        page.text(note)
    summary = report.get("summary") or {}
    page.heading("Per length")
    page.table([{"length": n, **v} for n, v in summary.get("per_length", {}).items()], digits=4)
    page.heading("Worst layers (one layer sparse at a time, KL at the answer position)")
    page.table(summary.get("worst_layers", []), digits=5)
    page.heading("Per layer: attention-output cosine (sparse vs dense, same inputs) and sensitivity")
    page.table([r for r in summary.get("per_layer", []) if r["cosine_mean"] is not None
                or r["sensitivity_kl_mean"] is not None], digits=5)
    if report.get("comparisons"):
        page.heading("Other configs on the same kind of prompts")
        page.table(report["comparisons"], digits=4)
    page.heading("Samples")
    page.table([{k: v for k, v in r.items() if k != "cosine"} for r in report["records"]], digits=5)
    return page.write(path)


# ---- fixing a config the report flags ----------------------------------------------------------------

def dense_fallback(config: HeadConfig, layers: Sequence[int], note: str = "") -> HeadConfig:
    """A copy of `config` whose `layers` run dense (every head), with the change in its provenance; heads the
    model fixes (sliding window) keep their window: dense there would not be the model."""
    from workbench.config import HeadEntry

    layers = sorted(set(layers))
    heads = [HeadEntry(e.layer, e.head, "dense", {}, recall={"mean": 1.0, "worst": 1.0}) if e.layer in layers and not e.fixed
             else HeadEntry.from_dict(e.to_dict()) for e in config.heads]
    prov = dict(config.provenance, dense_fallback={"layers": layers, "reason": note})
    return HeadConfig(model=dict(config.model), heads=heads, provenance=prov, proxy=dict(config.proxy), block=config.block)


def rechoose(config: HeadConfig, target: float, tail_target: float | None = None) -> HeadConfig:
    """Re-run the search's choice (`search.choose`, `search.build_config`) at another captured-mass
    `target` from the per-head evidence stored in `config` (worst-sample mass and mean physical density
    of every candidate), without capturing the calibration prompts again."""
    from workbench.patterns import causal_tiles
    from workbench.search.search import Candidate, Evidence, build_config, choose

    cands = [Candidate.from_dict(c) for c in config.provenance["candidates"]]
    n_layers = config.model["n_layers"]
    n = max(s["length"] for s in config.provenance["calibration"])
    grid = lambda key: torch.tensor([[e.evidence[key] if not e.fixed else [0.0] * len(cands)  # noqa: E731
                                      for e in config.layer(l)] for l in range(n_layers)], dtype=torch.float64)[None]
    mass = grid("mass_worst")
    tail = grid("tail_worst") if all(e.fixed or "tail_worst" in e.evidence for e in config.heads) else mass
    ev = Evidence(cands, [{"stored_evidence": "worst calibration sample per head"}], [n], mass, tail,
                  grid("oracle_mean"), grid("physical_density") * causal_tiles(n), torch.zeros_like(mass),
                  torch.ones(1, n_layers, dtype=torch.float64), config.model["n_heads"] // config.model["n_kv_heads"])
    prov = {k: v for k, v in config.provenance.items()
            if k not in ("target", "tail_target", "created", "tool", "hardware")}
    prov["rechosen"] = {"from_target": config.provenance.get("target"), "target": target, "tail_target": tail_target,
                        "evidence": "per-head worst-sample mass and mean density stored in the config"}
    return build_config(ev, choose(ev, target, tail_target=tail_target), dict(config.model), target=target,
                        tail_target=tail_target, proxy=config.proxy,
                        provenance=prov)


@torch.no_grad()
def backend_agreement(model: torch.nn.Module, shape: Any, config: HeadConfig, input_ids: torch.Tensor,
                      backends: tuple[str, ...] = ("torch", "flex")) -> dict[str, Any]:
    """Prefill one prompt `[N]` sparsely with each SparsePrefill backend ("torch" = the reference, "flex",
    "triton") and compare the next-token logits: {"logits": {backend: Float `[V]`}, "max_abs_diff":
    {backend: max |logits - logits of backends[0]|}, "top1": {backend: token id}}."""
    ids = input_ids.reshape(1, -1).to(next(model.parameters()).device)
    logits = {}
    for backend in backends:
        with SparsePrefill(model, shape, config, min_length=0, backend=backend):
            logits[backend] = model(ids, use_cache=False, logits_to_keep=1).logits[0, -1].float().cpu()
    base = logits[backends[0]]
    return {"logits": logits, "max_abs_diff": {b: float((x - base).abs().max()) for b, x in logits.items()},
            "top1": {b: int(x.argmax()) for b, x in logits.items()}}
