"""MkDocs hook: the benchmark figures (benchmarks/figures/*.png, kept once in the repository)
are served under figures/ without copying them into docs/."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

FIGURES = Path(__file__).resolve().parents[1] / "benchmarks" / "figures"


def on_files(files: Files, config) -> Files:  # noqa: ANN001 (MkDocs' hook signature)
    for png in sorted(FIGURES.glob("*.png")):
        files.append(File(f"figures/{png.name}", src_dir=str(FIGURES.parent),
                          dest_dir=config["site_dir"], use_directory_urls=False))
    return files
