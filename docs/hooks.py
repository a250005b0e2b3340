"""MkDocs hooks: the benchmark figures (benchmarks/figures/*.png, kept once in the repository)
are served under figures/ without copying them into docs/, and figures/table3.png is drawn at
build time from the byte model the planner uses (parallax.planning.cost), so the concepts
page's figure is the code's own prediction."""

from __future__ import annotations

import tempfile
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "benchmarks" / "figures"
_drawn = tempfile.TemporaryDirectory(prefix="parallax-docs-")


def table3_figure(path: Path) -> None:
    """Bytes per machine and step of one 100k x 64 float32 table against α, 4 machines x 1
    worker, under each architecture's rule (the parameter dense, or sparse)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from parallax.planning import cost

    rows, row_bytes = 100_000, 64 * 4
    shape = cost.Shape(machines=4, workers_per_machine=1)
    alphas = np.linspace(0.001, 1.0, 200)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(alphas, [cost.ps_rows(a * rows, row_bytes, shape, local_aggregation=False) / 1e6
                     for a in alphas], label="PS: rows pulled and pushed")
    ax.plot(alphas, [cost.allgatherv_rows(a * rows, row_bytes, shape) / 1e6 for a in alphas],
            label="AllReduce architecture: AllGatherv of (ids, rows)")
    ax.axhline(cost.allreduce_dense(rows * row_bytes, shape) / 1e6, color="black",
               linestyle="--", label="AllReduce of the whole (dense) gradient")
    ax.set_xlabel("α: fraction of the table's rows a worker uses per step")
    ax.set_ylabel("MB per machine and step")
    ax.set_title("Table 3, for a 100k x 64 float32 table on 4 machines")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def on_files(files: Files, config) -> Files:  # noqa: ANN001 (MkDocs' hook signature)
    for png in sorted(FIGURES.glob("*.png")):
        files.append(File(f"figures/{png.name}", src_dir=str(FIGURES.parent),
                          dest_dir=config["site_dir"], use_directory_urls=False))
    drawn = Path(_drawn.name)
    (drawn / "figures").mkdir(exist_ok=True)
    table3_figure(drawn / "figures" / "table3.png")
    files.append(File("figures/table3.png", src_dir=str(drawn), dest_dir=config["site_dir"],
                      use_directory_urls=False))
    return files
