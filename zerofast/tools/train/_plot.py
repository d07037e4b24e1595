"""--plot: the measured memory per rank under DDP and stages 1-3 as stacked bars in a PNG
(matplotlib, optional, imported only here)."""

from __future__ import annotations


def plot(path: str, rows: dict[str, list[dict]], numel: int, precision: str) -> None:
    import matplotlib  # optional: --plot alone needs it (parse_args checked that it is there)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    world = len(next(iter(rows.values())))
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 4), sharey=True)
    colors = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "buckets": "#8172b3"}
    for ax, name in zip(axes, names):
        bottom = [0.0] * world
        for kind in ("params", "grads", "optimizer", "buckets"):  # buckets: ZeroAdam's buffers and pool
            vals = [m[kind] / 2**20 for m in rows[name]]
            ax.bar(range(world), vals, bottom=bottom, color=colors[kind], label=kind)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_title(name)
        ax.set_xticks(range(world), [f"rank {r}" for r in range(world)])
    axes[0].set_ylabel("MiB per rank (measured)")
    axes[-1].legend(loc="upper right")
    fig.suptitle(f"Memory per rank, measured, Adam (ZeroAdam in {precision}; DDP fp32), Φ = {numel:,} parameters")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
