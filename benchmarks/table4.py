"""Table 4 analog (Parallax, EuroSys'19): AllReduce, PS, OptPS and the hybrid on LM and NMT.

    python benchmarks/table4.py --rate 1gbit
    python benchmarks/table4.py --workloads lm --machines 2 --nproc-per-machine 1 \
        --steps 2 --warmup 1 --vocab 2000            # smoke size

runs compare.py once per workload with systems ``allreduce ps optps hybrid`` (parallax's four
architectures: Horovod-like, TF-PS-like, PS with local aggregation, hybrid) and writes
benchmarks/out/table4.json, .md and .png (throughput normalised to allreduce, per
workload). Same options and outputs as table1.py; NMT fetches its data on first use. Needs root
and iproute2.
"""

from __future__ import annotations

import sys

import table1

TITLE = "Table 4 analog: AR / PS / OptPS / HYB"

if __name__ == "__main__":
    sys.exit(table1.run(table1.parse_args(description=__doc__, workloads=["lm", "nmt"],
                                          systems=("allreduce", "ps", "optps", "hybrid"),
                                          name="table4"), TITLE))
