"""The headless Chromium that the UI and JupyterLab tests drive through Playwright: Debian's `chromium` package
(`make browser`), never Playwright's own download (no network at run time)."""
import shutil

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
