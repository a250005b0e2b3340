"""Seed 001's cumulative ablation (Parallax, arXiv) on the LM and the NMT: BASE (the PS with
no optimisation), then +HYB, +LA, +OPAU, +OPSW, each adding one.

    python benchmarks/ablation.py --machines 2 --nproc-per-machine 2 --rate 100mbit
    python benchmarks/ablation.py --workloads lm --machines 2 --nproc-per-machine 2 \
        --steps 2 --warmup 1 --vocab 2000            # smoke size

runs compare.py once per workload with the systems of `STEPS`, in the paper's order:
``ps-direct+noopau+noopsw`` (BASE: every parameter on the servers, no leader hop, the
aggregates' element-wise operations on the workers: ``Config.after_aggregation="workers"``,
the ids' dedup on the servers: ``Config.id_dedup="servers"``), ``hybrid-direct+noopau+noopsw``
(+HYB: the dense parameters AllReduced), ``hybrid-aggregated+noopau+noopsw`` (+LA: a machine's
workers merge their ids and rows), ``hybrid-aggregated+noopsw`` (+OPAU: the aggregates'
operations beside them, on the servers) and ``hybrid-aggregated`` (+OPSW: the ids deduplicated
on the workers, the side whose data is smaller; the hybrid with the leader hop on). Every step
trains the same model as one device (the switches move work, not what it computes). Writes
benchmarks/out/<name>.json, .md and .png (throughput normalised to BASE); options and
outputs as table1.py. Needs root and iproute2; the NMT fetches its data on first use.
"""

from __future__ import annotations

import sys

import table1

TITLE = "Seed 001's cumulative ablation: BASE, +HYB, +LA, +OPAU, +OPSW"
#: (the paper's name, the system) of each step, in the paper's order
STEPS = (("BASE", "ps-direct+noopau+noopsw"), ("+HYB", "hybrid-direct+noopau+noopsw"),
         ("+LA", "hybrid-aggregated+noopau+noopsw"), ("+OPAU", "hybrid-aggregated+noopsw"),
         ("+OPSW", "hybrid-aggregated"))

if __name__ == "__main__":
    sys.exit(table1.run(table1.parse_args(description=__doc__, workloads=["lm", "nmt"],
                                          systems=tuple(system for _, system in STEPS),
                                          name="ablation"), TITLE))
