"""Progress of long library calls: a tqdm bar in the CLI and notebooks, a callback in the dashboard."""
from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str, int, int], None]  # (what, done, total), called after each step


def reporter(progress: bool | Progress, unit: str = "step") -> tuple[Progress, Callable[[], None]]:
    """(report, close) for a call's `progress` argument: True draws a tqdm bar that `report` moves, a callable
    is `report` itself, False is silent. Call `close` when the work ends (also on an error)."""
    if progress is True:
        from tqdm.auto import tqdm

        bar = tqdm(total=1, unit=unit)

        def update(what: str, done: int, total: int) -> None:
            bar.total, bar.n = total, done
            bar.set_description(what, refresh=False)
            bar.refresh()

        return update, bar.close
    return (progress or (lambda what, done, total: None)), (lambda: None)
