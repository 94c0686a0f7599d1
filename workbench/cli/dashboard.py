"""`workbench dashboard`: serve the Panel dashboard (binds to localhost unless --address says otherwise)."""
from __future__ import annotations

import argparse

from workbench.cli._device import add_device_arguments, resolve_device_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dashboard", help="browse heads, edit patterns live, export configs (Panel server)",
                       description=__doc__)
    p.add_argument("--model", default=None, help="model folder or hub id (default: the embedded SmolLM2-135M)")
    p.add_argument("--port", type=int, default=5006, help="port (default 5006; 0 picks a free one)")
    p.add_argument("--address", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 exposes it to the network)")
    p.add_argument("--task", default="passkey", help="first sample's task (default passkey)")
    p.add_argument("--length", type=int, default=4096, help="first sample's length in tokens (default 4096)")
    p.add_argument("--seed", type=int, default=0, help="first sample's seed (default 0)")
    p.add_argument("--layers", default=None, help="capture only these layers, e.g. 0-3 (default: all)")
    p.add_argument("--config", default=None,
                   help="HeadConfig to start from, or 'search' to fit one on the sample "
                        "(default: <configs-dir>/<model>.json if it exists, else search; the page says which)")
    p.add_argument("--configs-dir", default="configs",
                   help="folder of head configs (default configs): without --config a session starts from "
                        "<configs-dir>/<model name>.json when it exists, else from a search on the sample; "
                        "'Save' writes here")
    p.add_argument("--forecast-report", default=None, help="forecast report JSON for the Forecast tab")
    p.add_argument("--bench", default=None, help="kernel benchmark JSON of the latency estimate "
                   "(default assets/benchmarks/prefill_h200.json)")
    p.add_argument("--show", action="store_true", help="open a browser tab")
    add_device_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import threading
    import time

    import panel as pn

    from workbench.views.dashboard.app import create_app
    from workbench.views.dashboard.state import MIN_LENGTH, SHARED, Settings

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} must be in 0..65535")
    if args.length < MIN_LENGTH:
        raise ValueError(f"--length {args.length} is too short: use at least {MIN_LENGTH} tokens")
    where = resolve_device_args(args)
    device, dtype = str(where["device"]), str(where["dtype"]).removeprefix("torch.")
    settings = Settings(model=args.model, task=args.task, length=args.length, seed=args.seed, config=args.config,
                        configs_dir=args.configs_dir, forecast_report=args.forecast_report, bench=args.bench,
                        layers=Settings.parse_layers(args.layers), device=device, dtype=dtype)
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
