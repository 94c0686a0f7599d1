"""`workbench dashboard`: serve the Panel dashboard (binds to localhost unless --address says otherwise)."""
from __future__ import annotations

import argparse

from workbench.cli._args import add_device, add_layers, add_length, add_out, add_tasks, renamed, resolve_device_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dashboard", help="browse heads, edit patterns live, export configs (Panel server)",
                       description=__doc__)
    p.add_argument("--model", default=None, help="model folder or hub id (default: the embedded SmolLM2-135M)")
    p.add_argument("--port", type=int, default=5006, help="port (default 5006; 0 picks a free one)")
    p.add_argument("--address", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 exposes it to the network)")
    add_tasks(p, "passkey", what="first sample's task", one=True)
    add_length(p, 4096, what="first sample's length in tokens")
    p.add_argument("--seed", type=int, default=0, help="first sample's seed (default 0)")
    add_layers(p, None, what="capture only these layers")
    p.add_argument("--config", default=None,
                   help="HeadConfig to start from, or 'search' to fit one on the sample (default: <--out>/<model>.json "
                        "if saved there, else the config the package ships for the model, else search; the page says which)")
    add_out(p, "reports/configs", "folder that 'Save' writes head configs into")
    p.add_argument("--forecast-report", default=None, help="forecast report JSON for the Forecast tab")
    p.add_argument("--bench", default=None, help="the latency estimate's kernel benchmark: a JSON, or the GPU of a "
                   "table the package ships (h100, h200; default: this machine's GPU's, else the H200's)")
    p.add_argument("--show", action="store_true", help="open a browser tab")
    add_device(p)
    renamed(p, configs_dir="--out")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import threading
    import time

    from workbench.cli._args import check_tasks, one_task, out_dir
    from workbench.core.corpus import TASKS

    try:
        import panel as pn
    except ImportError:
        raise ValueError("the dashboard needs Panel: pip install 'sparse-attention-workbench[dashboard]'") from None
    from workbench.views.dashboard.app import create_app
    from workbench.views.dashboard.state import MIN_LENGTH, SHARED, Settings

    task = one_task(args.tasks)
    check_tasks([task], TASKS)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} must be in 0..65535")
    if args.length < MIN_LENGTH:
        raise ValueError(f"--length {args.length} is too short: use at least {MIN_LENGTH} tokens")
    out_dir(args.out)
    where = resolve_device_args(args)
    device, dtype = str(where["device"]), str(where["dtype"]).removeprefix("torch.")
    settings = Settings(model=args.model, task=task, length=args.length, seed=args.seed, config=args.config,
                        configs_dir=args.out, forecast_report=args.forecast_report, bench=args.bench,
                        layers=None if args.layers is None else tuple(args.layers), device=device, dtype=dtype)
    t0 = time.perf_counter()
    threading.Thread(target=SHARED.model, args=(args.model, device, dtype), daemon=True).start()  # shared by all sessions
    server = pn.serve({"/": lambda: create_app(settings)}, port=args.port, address=args.address, show=args.show,
                      start=False, title="Sparse Attention Workbench",
                      websocket_origin="*" if args.address == "0.0.0.0" else None)
    print(f"serving http://{args.address}:{server.port}/ (started in {time.perf_counter() - t0:.1f} s); Ctrl-C stops",
          flush=True)
    try:
        server.io_loop.start()
    except KeyboardInterrupt:
        pass
    return 0
