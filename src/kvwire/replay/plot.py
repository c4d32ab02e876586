"""The hit rate against the pool's size, per configuration and for Belady's optimum, as a PNG.

Read the other way, a miss-ratio curve: how many blocks each doubling of the
pool saves from being computed. Drawn with matplotlib (kvwire's `bench`
extra), imported only here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvwire.exceptions import MissingExtraError
from kvwire.replay.sweep import SweepRow

NEEDED_BY = "kvwire replay --plot"


def require_matplotlib() -> None:
    """`MissingExtraError` naming the `bench` extra when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError as error:
        if error.name != "matplotlib":
            raise
        raise MissingExtraError(NEEDED_BY, "matplotlib", "bench") from None


def plot_hit_rates(rows: Sequence[SweepRow], path: str | os.PathLike[str], title: str) -> None:
    """Draw `rows` into the PNG file at `path`; `MissingExtraError` without matplotlib."""
    require_matplotlib()
    import matplotlib

    # No display is needed: the figure only goes to a file.
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({row.pool_blocks for row in rows})
    figure, axes = plt.subplots(figsize=(8, 5))
    try:
        optimum = {row.pool_blocks: row.belady_hit_rate for row in rows}
        axes.plot(sizes, [optimum[size] for size in sizes], "k--", marker="o", label="Belady")
        configurations = dict.fromkeys((row.policy, row.save_threshold) for row in rows)
        for policy, threshold in configurations:
            curve = {
                row.pool_blocks: row.hit_rate
                for row in rows
                if (row.policy, row.save_threshold) == (policy, threshold)
            }
            axes.plot(
                sizes,
                [curve[size] for size in sizes],
                marker="o",
                label=f"{policy}, save_threshold {threshold}",
            )
        if len(sizes) > 1 and sizes[-1] >= 4 * sizes[0]:
            axes.set_xscale("log")
        axes.set_xlabel("pool size (blocks)")
        axes.set_ylabel("hit rate (blocks loaded / blocks asked for)")
        axes.set_ylim(bottom=0)
        axes.set_title(title)
        axes.grid(True, alpha=0.3)
        axes.legend()
        figure.tight_layout()
        figure.savefig(os.fspath(path), dpi=120)
    finally:
        plt.close(figure)
