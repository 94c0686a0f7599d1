"""`workbench analyze`: capture a sample, compute every head's statistics, write an HTML + JSON report."""
from __future__ import annotations

import argparse
import time

from workbench.cli._args import add_device, add_layers, add_length, add_out, add_tasks
from workbench.cli._stream import add_stream_arguments, load_for_stream, stream_sample


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("analyze", help="capture attention on a sample and report every head's statistics",
                       description=__doc__)
    p.add_argument("--model", default=None, help="local HF model folder or hub id (default: embedded SmolLM2-135M)")
    add_tasks(p, "passkey", what="the sample's task", one=True)
    add_length(p, 4096)
    p.add_argument("--seed", type=int, default=0, help="sample seed (default 0)")
    add_layers(p, None, what="layers to capture")
    add_device(p, device_map=True)
    add_out(p, "reports/analyze", "report folder: summary.json and index.html, replaced only when the run succeeds")
    p.add_argument("--config", default=None, help="a head config: also report the recall of its indexes")
    p.add_argument("--no-fits", action="store_true", help="skip pattern fits and proxy-vs-oracle recall")
    add_stream_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from workbench.analysis.layer_profiles import LayerProfiles
    from workbench.cli._args import check_layers, check_lengths, check_tasks, one_task, out_dir
    from workbench.config import HeadConfig
    from workbench.core.corpus import TASKS
    from workbench.core.io import write_json
    from workbench.core.report import Report
    from workbench.core.stream import stopped_midway, stream_capture
    from workbench.views.viz import attention_map, head_grid

    task = one_task(args.tasks)
    check_tasks([task], TASKS)
    out = out_dir(args.out)
    if args.config and args.no_fits:
        raise ValueError("--config is reported in the pattern fits: drop --no-fits, or drop --config")
    # read before the model and the long work (then checked against the model): a bad file fails in seconds
    config = HeadConfig.load(args.config) if args.config else None
    t0 = time.perf_counter()
    model, tok, shape = load_for_stream(args, args.layers)
    check_lengths([args.length], shape.max_positions, shape.name, "--length")
    check_layers(args.layers, shape.n_layers)
    if config is not None:
        config.validate(shape)
    sample = stream_sample(args, tok, shape, task, model)
    t1 = time.perf_counter()
    cap = stream_capture(model, shape, sample.input_ids, layers=args.layers, chunk=args.chunk,
                         analysis="stats" if args.no_fits else "evidence")
    stats = LayerProfiles(cap.scale)
    cap.on_layer(stats)  # statistics in the same pass as the fits: one forward, each layer's q/k dropped after
    fits = None
    with stopped_midway("no report was written"):
        if args.no_fits:
            cap.run()
        else:
            from workbench.search.search import pattern_fits

            fits = pattern_fits(cap, config=config, progress=True)
            cap.close()
    t3 = time.perf_counter()
    t2 = t1 + cap.runner.forward_seconds
    profiles = stats.profiles
    kinds: dict[str, int] = {}
    for p in profiles:
        kinds[p.kind] = kinds.get(p.kind, 0) + 1
    summary = {
        "model": shape.to_dict(), "sample": sample.describe(), "layers": list(cap.layers),
        "seconds": {"load": round(t1 - t0, 2), "capture": round(t2 - t1, 2), "statistics": round(stats.seconds, 2),
                    **({"fits": round(t3 - t2 - stats.seconds, 2)} if fits else {})},
        "stream": {"chunk": cap.runner.chunk, "forward_passes": cap.passes},
        "kinds": kinds, "heads": [p.to_dict() for p in profiles],
    }
    random = getattr(model, "workbench_random", None)
    if random:
        summary["random_weights"] = random
    rep = Report(f"Attention analysis: {shape.name}, {sample.task}, {sample.length} tokens"
                 + (" - RANDOM WEIGHTS: time and memory only" if random else ""))
    rep.text(f"{len(profiles)} heads in {len(cap.layers)} layers. Head kinds: "
             + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) + ". Timings (s): "
             + ", ".join(f"{k} {v}" for k, v in summary["seconds"].items()))
    rep.heading("Head grid")
    for metric in ("local", "sink", "vertical", "slash", "block"):
        rep.figure(head_grid(profiles, metric))
    rep.heading("Most vertical, slash and block heads")
    for metric in ("vertical", "slash", "block"):
        top, top_map = stats.top[metric]
        title = f"L{top.layer} H{top.head}: strongest {metric} ({getattr(top, metric):.2f})"
        rep.figure(attention_map(top_map, 0, max_cells=256, title=title))
    rep.heading("Per-layer summary")
    rows = []
    for layer in cap.layers:
        ps = [p for p in profiles if p.layer == layer]
        rows.append({"layer": layer, **{m: sum(getattr(p, m) for p in ps) / len(ps)
                                         for m in ("sink", "local", "vertical", "slash", "block", "entropy")},
                     "kinds": ", ".join(sorted({p.kind for p in ps}))})
    rep.table(rows)
    if fits is not None:
        summary["pattern_fits"] = fits
        s = fits["summary"]
        rep.heading("Pattern fits and proxy vs oracle")
        rep.text(f"Cheapest pattern reaching {s['target']} captured mass on this prompt: "
                 + ", ".join(f"{k} {v}" for k, v in sorted(s["fits"].items()))
                 + f" heads (mean physical density {s['mean_fit_density']}). At {s['budget']} keys per query: "
                 f"VS proxy {s['vs_proxy']} vs oracle {s['vs_oracle']} (gap {s['vs_gap']}), block proxy "
                 f"{s['block_proxy']} vs oracle {s['block_oracle']} (gap {s['block_gap']}), A-shape {s['ashape']}."
                 + (f" Config {args.config}: mean {s['config_mass_mean']}, worst head {s['config_mass_worst']}."
                    if config is not None else ""))
        rep.table(fits["layers"])
    # both files only now, after every step succeeded: a failed run leaves an earlier report as it was
    write_json(out / "summary.json", summary)
    rep.write(out / "index.html")
    print(f"wrote {out / 'index.html'} and {out / 'summary.json'} ({len(profiles)} heads; "
          f"capture {t2 - t1:.1f}s, statistics {stats.seconds:.1f}s)" + (f"; {random}" if random else ""))
    return 0
