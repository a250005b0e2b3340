#!/usr/bin/env bash
# The benchmark runs of BENCHMARKS.md (not CI: hours with 3 repeats; needs root and iproute2
# for the emulated network). Each experiment writes into its scratch directory
# benchmarks/out/NAME/ (@OUT@ in the commands below), then benchmarks/records.py files every
# output as a new record, benchmarks/records/<experiment>/<commit>-<host>[-n].json (never
# overwriting one); `python benchmarks/results_page.py` then rewrites BENCHMARKS.md.
#   bash scripts/bench.sh                  every experiment
#   bash scripts/bench.sh lm-4x1 table4    the named ones (bash scripts/bench.sh --list)
# Every experiment runs even when an earlier one failed; the exit status says whether any did.
# REPEATS=N overrides the interleaved repeats of each table (default 3); VENV=DIR runs in
# another virtual environment (default .venv; the setup scripts install into it).
set -uo pipefail
cd "$(dirname "$0")/.."
export VENV=${VENV:-.venv}
py=$VENV/bin/python
repeats=(--repeats "${REPEATS:-3}")

declare -A EXPERIMENTS=(
  [lm-2x2]="$py benchmarks/compare.py --workload lm --machines 2 --nproc-per-machine 2 \
--rate 1gbit --systems hybrid hybrid-late optps ps allreduce ddp-sparse ddp-dense torchrec-rw \
--isolate"
  [lm-4x1]="$py benchmarks/compare.py --workload lm --machines 4 --nproc-per-machine 1 \
--rate 1gbit --systems hybrid hybrid-late optps ps allreduce ddp-sparse ddp-dense torchrec-rw \
torchrec-tw torchrec-plan --isolate"
  [lm-kjv]="$py benchmarks/compare.py --workload lm --machines 2 --nproc-per-machine 2 \
--rate 1gbit --workload-options {\"corpus\":\"kjv\"} --systems hybrid ddp-sparse ddp-dense \
torchrec-rw --isolate --out @OUT@/compare-lm-kjv-2x2-1gbit.json"
  [recsys]="$py benchmarks/compare.py --workload recsys --machines 2 --nproc-per-machine 2 \
--rate 1gbit --hash-multiplier 1000 --systems hybrid-lazy hybrid-sparse hybrid ddp-sparse \
torchrec-rw torchrec-tw torchrec-plan --steps 10 --isolate"
  [recsys-history]="$py benchmarks/compare.py --workload recsys --machines 2 \
--nproc-per-machine 2 --rate 1gbit --hash-multiplier 1000 --workload-options {\"history\":32} \
--systems hybrid hybrid-pooled hybrid-tablewise hybrid-rows ddp-sparse torchrec-rw torchrec-tw \
torchrec-plan --steps 10 --isolate --out @OUT@/compare-recsys-history32-2x2-1gbit.json"
  [recsys-riders]="$py benchmarks/compare.py --workload recsys --machines 2 \
--nproc-per-machine 2 --rate 1gbit --hash-multiplier 1000 --systems hybrid hybrid-tablewise \
torchrec-tw torchrec-plan --steps 20 --isolate \
--out @OUT@/compare-recsys-2x2-1gbit-pooled-open.json"
  [recsys-history-rest]="$py benchmarks/compare.py --workload recsys --machines 2 \
--nproc-per-machine 2 --rate 1gbit --hash-multiplier 1000 --workload-options {\"history\":32} \
--systems hybrid hybrid-tablewise hybrid-pooled torchrec-plan --steps 10 --isolate \
--out @OUT@/compare-recsys-history32-2x2-1gbit-rest.json"
  [recsys-history-100]="$py benchmarks/compare.py --workload recsys --machines 2 \
--nproc-per-machine 2 --rate 1gbit --hash-multiplier 1000 --workload-options {\"history\":32} \
--systems hybrid hybrid-tablewise torchrec-plan --steps 100 --isolate \
--out @OUT@/compare-recsys-history32-2x2-1gbit-rest-100steps.json"
  [recsys-history-embedding]="$py benchmarks/compare.py --workload recsys --machines 2 \
--nproc-per-machine 2 --rate 1gbit --hash-multiplier 1000 \
--workload-options {\"history\":32,\"history_lookup\":\"embedding\"} \
--systems hybrid hybrid-rows hybrid-tablewise torchrec-tw torchrec-plan --steps 30 --isolate \
--out @OUT@/compare-recsys-history32-embedding-2x2-1gbit.json"
  [recsys-history-byrows]="$py benchmarks/compare.py --workload recsys --machines 2 \
--nproc-per-machine 2 --rate 1gbit --hash-multiplier 1000 --workload-options {\"history\":32} \
--systems hybrid hybrid-tablewise hybrid-byrows torchrec-plan --steps 30 --isolate \
--out @OUT@/compare-recsys-history32-2x2-1gbit-byrows.json"
  [recsys-history-bycolumns]="$py benchmarks/compare.py --workload recsys --machines 2 \
--nproc-per-machine 2 --rate 1gbit --hash-multiplier 1000 --workload-options {\"history\":32} \
--systems hybrid hybrid-tablewise hybrid-byrows hybrid-bycolumns torchrec-cw torchrec-plan \
--steps 30 --isolate --out @OUT@/compare-recsys-history32-2x2-1gbit-bycolumns.json"
  [recsys-riders-100]="$py benchmarks/compare.py --workload recsys --machines 2 \
--nproc-per-machine 2 --rate 1gbit --hash-multiplier 1000 --systems hybrid hybrid-tablewise \
torchrec-tw torchrec-plan --steps 100 --isolate \
--out @OUT@/compare-recsys-2x2-1gbit-riders-100steps.json"
  [lm-riders-100]="$py benchmarks/compare.py --workload lm --machines 2 --nproc-per-machine 2 \
--rate 1gbit --systems hybrid torchrec-rw --steps 100 --isolate \
--out @OUT@/compare-lm-2x2-1gbit-riders-100steps.json"
  [lm-4x1-riders-100]="$py benchmarks/compare.py --workload lm --machines 4 \
--nproc-per-machine 1 --rate 1gbit --systems hybrid torchrec-rw --steps 100 --isolate \
--out @OUT@/compare-lm-4x1-1gbit-riders-100steps.json"
  [lm-riders]="$py benchmarks/compare.py --workload lm --machines 2 --nproc-per-machine 2 \
--rate 1gbit --systems hybrid torchrec-rw --steps 30 --isolate \
--out @OUT@/compare-lm-2x2-1gbit-riders.json"
  [lm-4x1-riders]="$py benchmarks/compare.py --workload lm --machines 4 --nproc-per-machine 1 \
--rate 1gbit --systems hybrid torchrec-rw --steps 30 --isolate \
--out @OUT@/compare-lm-4x1-1gbit-riders.json"
  [cnn]="$py benchmarks/compare.py --workload cnn --machines 2 --nproc-per-machine 2 \
--rate 1gbit --systems ddp-dense hybrid allreduce ps --steps 30 --isolate"
  [table1]="$py benchmarks/table1.py --machines 2 --nproc-per-machine 2 --rate 1gbit --isolate"
  [table4]="$py benchmarks/table4.py --machines 2 --nproc-per-machine 2 --rate 1gbit --isolate"
  [table4-4x1-100mbit]="$py benchmarks/table4.py --machines 4 --nproc-per-machine 1 \
--rate 100mbit --systems allreduce ps hybrid --steps 30 --warmup 3 --repeats 5 --isolate --pin \
--nmt-options {\"src_vocab\":1000,\"tgt_vocab\":1000} --name table4-4x1-100mbit"
  [table4-2x2-100mbit]="$py benchmarks/table4.py --machines 2 --nproc-per-machine 2 \
--rate 100mbit --systems allreduce ps optps hybrid --steps 30 --warmup 3 --repeats 5 --isolate \
--pin --nmt-options {\"src_vocab\":1000,\"tgt_vocab\":1000} --name table4-2x2-100mbit"
  [scaling]="$py benchmarks/scaling.py --machines 1 2 4 8 --nproc-per-machine 1 --rate 1gbit \
--systems hybrid ps allreduce ddp-dense ddp-sparse torchrec-rw \
--isolate"
  [extrapolate]="$py benchmarks/extrapolate.py"
  [scaling-fair]="$py benchmarks/scaling.py --machines 1 2 4 8 --nproc-per-machine 1 --rate 1gbit \
--systems hybrid ps allreduce ddp-sparse torchrec-rw --isolate --name scaling-fair"
  [extrapolate-fair]="$py benchmarks/extrapolate.py --scaling benchmarks/records/scaling-fair/f237e0e-intel-xeon-2c.json \
--out @OUT@/extrapolation-fair.json"
  [sparsity-fair]="$py benchmarks/sparsity_sweep.py --machines 2 --nproc-per-machine 2 \
--rate 1gbit --isolate --name sparsity-fair"
  [sparsity]="$py benchmarks/sparsity_sweep.py --machines 2 --nproc-per-machine 2 \
--rate 1gbit --isolate"
  [sparsity-seq]="$py benchmarks/sparsity_sweep.py --machines 2 --nproc-per-machine 2 \
--rate 1gbit --isolate --name sparsity-seq --points 100000:1 100000:5 100000:15 100000:30 \
100000:60 100000:120"
  [table6-4x1-100mbit]="$py benchmarks/sparsity_sweep.py --machines 4 --nproc-per-machine 1 \
--rate 100mbit --systems hybrid ps --hidden 320 --sampled 32 --steps 20 --warmup 3 --repeats 3 \
--isolate --pin --points 3000:1:32 3000:4:32 3000:15:32 3000:60:32 3000:120:32 \
--name table6-4x1-100mbit"
  [ablation-recsys]="$py benchmarks/compare.py --workload recsys --machines 2 \
--nproc-per-machine 2 --rate 1gbit --hash-multiplier 1000 --workload-options {\"history\":32} \
--systems ps-direct+rows hybrid-direct+rows hybrid-aggregated+rows hybrid-aggregated+pooled \
hybrid --steps 20 --isolate --out @OUT@/ablation-recsys-history32-2x2-1gbit.json"
  [ablation-recsys-100mbit]="$py benchmarks/compare.py --workload recsys --machines 2 \
--nproc-per-machine 2 --rate 100mbit --hash-multiplier 1000 \
--workload-options {\"history\":32} --systems ps-direct+rows hybrid-direct+rows \
hybrid-aggregated+rows hybrid-aggregated+pooled hybrid --steps 20 --isolate \
--out @OUT@/ablation-recsys-history32-2x2-100mbit.json"
  [ablation-2x2-100mbit]="$py benchmarks/ablation.py --machines 2 --nproc-per-machine 2 \
--rate 100mbit --steps 30 --warmup 3 --repeats 5 --isolate --pin \
--nmt-options {\"src_vocab\":1000,\"tgt_vocab\":1000} --name ablation-2x2-100mbit"
  [local-aggregation-2x4]="$py benchmarks/compare.py --workload lm --machines 2 \
--nproc-per-machine 4 --rate 100mbit --systems hybrid hybrid-aggregated ps optps --isolate \
--out @OUT@/local-aggregation-lm-2x4-100mbit.json"
  [local-aggregation-2x8]="$py benchmarks/compare.py --workload lm --machines 2 \
--nproc-per-machine 8 --rate 1gbit --systems hybrid hybrid-direct --isolate \
--out @OUT@/local-aggregation-lm-2x8-1gbit.json"
  [local-aggregation-2x8-100mbit]="$py benchmarks/compare.py --workload lm --machines 2 \
--nproc-per-machine 8 --rate 100mbit --systems hybrid hybrid-direct --isolate --steps 5 \
--out @OUT@/local-aggregation-lm-2x8-100mbit.json"
  [local-aggregation-2x4-10mbit]="$py benchmarks/compare.py --workload lm --machines 2 \
--nproc-per-machine 4 --rate 10mbit --systems hybrid hybrid-aggregated ps optps --isolate \
--steps 5 --out @OUT@/local-aggregation-lm-2x4-10mbit.json"
  [bandwidth]="$py benchmarks/bandwidth_sweep.py --rates 100mbit 1gbit 5gbit --isolate"
  [alpha]="$py benchmarks/alpha_crossover.py"
  [small-sums]="$py benchmarks/small_sums.py --repeats ${REPEATS:-3}"
  [partitions-2x2]="$py benchmarks/partitions.py --machines 2 --nproc-per-machine 2 \
--rate 1gbit"
  [partitions-4x1]="$py benchmarks/partitions.py --machines 4 --nproc-per-machine 1 \
--rate 1gbit"
  [partitions-2x2-paper]="$py benchmarks/partitions.py --machines 2 --nproc-per-machine 2 \
--rate 1gbit --search-steps 100 --rounds 5"
  [partitions-4x1-paper]="$py benchmarks/partitions.py --machines 4 --nproc-per-machine 1 \
--rate 1gbit --search-steps 100"
  [partition-surface]="$py benchmarks/partition_surface.py --name lm"
  [partition-surface-dense]="$py benchmarks/partition_surface.py --no-sparse --name lm-dense"
  [partition-surface-large]="$py benchmarks/partition_surface.py --tokens 20000 --dim 256 \
--steps 20 --search-steps 40 --name lm-large"
  [table-over-limit]="$py benchmarks/table_over_limit.py --limit-mib 1280 --ratio 2 \
--machines 4 --rate 1gbit"
  [progress]="$py benchmarks/progress_overhead.py"
  [slim-dp]="$py benchmarks/slim_dp.py --machines 4 8 --rates 1gbit 100mbit --steps 200"
  [slim-sweep]="$py benchmarks/slim_dp.py --sweep --machines 4 --rates 100mbit --steps 200"
  [slim-check]="$py benchmarks/slim_dp.py --machines 4 --rates 100mbit --steps 60 \
--eval-every 60 --eval-size 500 --modes plump-ar plump quant slim --name slim_dp-check-k4-100mbit"
  [slim-k8-100mbit]="$py benchmarks/slim_dp.py --vary-seeds --machines 8 --rates 100mbit \
--steps 600 --eval-every 50 --modes plump quant slim --name slim_dp-k8-100mbit-600steps"
  [slim-share]="$py benchmarks/slim_dp.py --machines 4 --rates 1gbit 2gbit 3gbit 5gbit \
--steps 100 --eval-every 100 --eval-size 200 --repeats 3 --modes plump --name slim_dp-share-k4"
  [slim-regime]="$py benchmarks/slim_dp.py --regime --vary-seeds --machines 4 --rates 3gbit \
--steps 3000 --eval-every 250 --repeats 5 --name slim_dp-regime-k4-3gbit"
  # (one seed a sitting: a seed's eight modes take about 36 minutes on 2 cores)
  [slim-regime-seed0]="$py benchmarks/slim_dp.py --regime --vary-seeds --first-seed 0 \
--machines 4 --rates 3gbit --steps 3000 --eval-every 250 --repeats 1 \
--name slim_dp-regime-k4-3gbit-seed0"
  [slim-regime-seed1]="$py benchmarks/slim_dp.py --regime --vary-seeds --first-seed 1 \
--machines 4 --rates 3gbit --steps 3000 --eval-every 250 --repeats 1 \
--name slim_dp-regime-k4-3gbit-seed1"
  [slim-regime-seed2]="$py benchmarks/slim_dp.py --regime --vary-seeds --first-seed 2 \
--machines 4 --rates 3gbit --steps 3000 --eval-every 250 --repeats 1 \
--name slim_dp-regime-k4-3gbit-seed2"
  [slim-regime-seed3]="$py benchmarks/slim_dp.py --regime --vary-seeds --first-seed 3 \
--machines 4 --rates 3gbit --steps 3000 --eval-every 250 --repeats 1 \
--name slim_dp-regime-k4-3gbit-seed3"
  [slim-regime-seed4]="$py benchmarks/slim_dp.py --regime --vary-seeds --first-seed 4 \
--machines 4 --rates 3gbit --steps 3000 --eval-every 250 --repeats 1 \
--name slim_dp-regime-k4-3gbit-seed4"
  [slim-ablation]="$py benchmarks/slim_dp.py --ablation --vary-seeds --machines 4 \
--rates 1gbit --steps 600 --eval-every 50"
  [lm-dense-sync]="$py benchmarks/compare.py --workload lm --machines 4 --nproc-per-machine 1 \
--rate 1gbit --workload-options {\"corpus\":\"kjv\",\"optimizer\":\"momentum\"} \
--systems hybrid hybrid-plump hybrid-qsgd hybrid-slim --steps 200 --isolate \
--out @OUT@/compare-lm-kjv-4x1-1gbit-dense-sync.json"
  [lm-dense-sync-100mbit]="$py benchmarks/compare.py --workload lm --machines 4 \
--nproc-per-machine 1 --rate 100mbit \
--workload-options {\"corpus\":\"kjv\",\"optimizer\":\"momentum\"} \
--systems hybrid hybrid-plump hybrid-qsgd hybrid-slim --steps 200 --isolate \
--out @OUT@/compare-lm-kjv-4x1-100mbit-dense-sync.json"
  [mp-airfoil]="$py benchmarks/model_parallel.py --data airfoil --widths 32 64 128 512 1024 \
--processes 1 2 4 8 --rate 1gbit --steps 150"
  [mp-report-loopback]="$py benchmarks/model_parallel.py --data airfoil \
--widths 32 64 128 512 1024 --processes 1 2 4 --rate none --batch 100 --steps 150 \
--name model_parallel-airfoil-batch100-loopback"
  [mp-report-1gbit]="$py benchmarks/model_parallel.py --data airfoil \
--widths 32 64 128 512 1024 --processes 1 2 4 --rate 1gbit --batch 100 --steps 150 \
--name model_parallel-airfoil-batch100-1gbit"
  [mp-synthetic]="$py benchmarks/model_parallel.py --data synthetic --rows 700000 \
--widths 128 512 1024 --processes 1 2 4 8 --rate 1gbit --steps 60"
  [mp-airfoil-100mbit]="$py benchmarks/model_parallel.py --data airfoil --widths 128 512 1024 \
--processes 1 2 4 --rate 100mbit --steps 40"
  [mp-splits]="bash scripts/mp_splits.sh"
  [phases]="$py benchmarks/phase_overhead.py"
  [host-work]="$py benchmarks/host_work.py --rounds 4"
  [host-counts]="bash scripts/host_counts.sh @OUT@"
  [host-tables]="bash scripts/host_tables.sh @OUT@"
  [host-replicated]="bash scripts/host_replicated.sh @OUT@"
  [threads-recsys]="$py benchmarks/compare.py --workload recsys --machines 2 --nproc-per-machine 2 \
--rate 1gbit --hash-multiplier 1000 --systems hybrid torchrec-tw --steps 50 --isolate \
--cpu-profile @OUT@/cpu-profile-recsys-2x2 --out @OUT@/threads-recsys-2x2-1gbit.json"
  [threads-lm]="$py benchmarks/compare.py --workload lm --machines 2 --nproc-per-machine 2 \
--rate 1gbit --systems hybrid torchrec-rw --steps 30 --isolate \
--cpu-profile @OUT@/cpu-profile-lm-2x2 --out @OUT@/threads-lm-2x2-1gbit.json"
  [launch]="$py benchmarks/launch_overhead.py"
  [launch-emulated]="$py benchmarks/launch_overhead.py --machines 2 --nproc-per-machine 1 \
--emulate-network 1gbit"
  [chaos]="$py benchmarks/chaos.py --trials 50 --machines 2 --nproc-per-machine 2 \
--local-aggregation --steps 20 --checkpoint-every 4 --step-sleep 0.05 --timeout 10 --sync mixed \
--search --kinds kill kill-save kill-plan kill-norestart stop corrupt full-disk --seed 1000 \
--out @OUT@/chaos-2x2.json"
  [chaos-link]="$py benchmarks/chaos.py --trials 50 --machines 2 --nproc-per-machine 2 \
--local-aggregation --steps 20 --checkpoint-every 4 --step-sleep 0.05 --timeout 10 \
--rate 1gbit --kinds kill-launcher link-cut --seed 50 --out @OUT@/chaos-2x2-1gbit-clean.json"
  [time-to-quality]="$py benchmarks/time_to_quality.py --machines 2 --nproc-per-machine 2 \
--rates 1gbit 100mbit --seeds 0 1 2 --target 6.88 --eval-every 25 --max-steps 500"
  [time-to-quality-nmt]="$py benchmarks/time_to_quality.py --workload nmt --machines 2 \
--nproc-per-machine 2 --rates 1gbit 100mbit --seeds 0 1 2 --eval-every 10 --max-steps 300"
  [targets-recsys]="$py benchmarks/compare.py --workload recsys --machines 2 \
--nproc-per-machine 2 --rate 1gbit --hash-multiplier 1000 --systems hybrid torchrec-tw \
torchrec-plan --steps 50 --isolate --repeats 8 --no-plot \
--out @OUT@/compare-recsys-2x2-1gbit-session41.json"
  [targets-lm-2x2]="$py benchmarks/compare.py --workload lm --machines 2 --nproc-per-machine 2 \
--rate 1gbit --systems hybrid ps torchrec-rw --steps 30 --isolate --repeats 6 --no-plot \
--out @OUT@/compare-lm-2x2-1gbit-session41.json"
  [targets-lm-bound]="$py benchmarks/compare.py --workload lm --machines 2 \
--nproc-per-machine 2 --rate 1gbit --systems hybrid torchrec-rw local-sparse --steps 30 \
--isolate --repeats 5 --no-plot --out @OUT@/compare-lm-2x2-1gbit-bound.json"
  [targets-lm-4x1]="$py benchmarks/compare.py --workload lm --machines 4 --nproc-per-machine 1 \
--rate 1gbit --systems hybrid torchrec-rw local-sparse --steps 30 --isolate --repeats 5 \
--no-plot --out @OUT@/compare-lm-4x1-1gbit-bound.json"
  [ratios-recsys]="$py benchmarks/ratios.py \
benchmarks/records/compare-recsys-2x2-1gbit-exchange/6e5b7ba-amd-epyc-2c.json benchmarks/records/compare-recsys-2x2-1gbit-riders/71de633-amd-epyc-2c.json \
benchmarks/records/compare-recsys-2x2-1gbit-riders-100steps/eed0daf-amd-epyc-2c.json benchmarks/records/compare-recsys-2x2-1gbit-pooled-open/debbe5b-amd-epyc-2c.json \
benchmarks/records/compare-recsys-2x2-1gbit-tablewise/5f730e5-amd-epyc-2c.json benchmarks/records/compare-recsys-2x2-1gbit-session37/441e71e-intel-xeon-2c.json \
benchmarks/records/compare-recsys-2x2-1gbit-session41/c124bc4-intel-xeon-2c.json --other torchrec-tw --out @OUT@/ratios-recsys-2x2.json"
  [ratios-lm-2x2]="$py benchmarks/ratios.py \
benchmarks/records/compare-lm-2x2-1gbit-exchange/6e5b7ba-amd-epyc-2c.json benchmarks/records/compare-lm-2x2-1gbit-riders/71de633-amd-epyc-2c.json \
benchmarks/records/compare-lm-2x2-1gbit-riders-100steps/eed0daf-amd-epyc-2c.json benchmarks/records/compare-lm-2x2-1gbit-session37/441e71e-intel-xeon-2c.json \
benchmarks/records/compare-lm-2x2-1gbit-session41/c124bc4-intel-xeon-2c.json benchmarks/records/compare-lm-2x2-1gbit-bound/8e15fb6-intel-xeon-2c.json \
--other torchrec-rw --out @OUT@/ratios-lm-2x2.json"
  [ratios-lm-4x1]="$py benchmarks/ratios.py \
benchmarks/records/compare-lm-4x1-1gbit-exchange/6e5b7ba-amd-epyc-2c.json benchmarks/records/compare-lm-4x1-1gbit-riders/71de633-amd-epyc-2c.json \
benchmarks/records/compare-lm-4x1-1gbit-riders-100steps/eed0daf-amd-epyc-2c.json benchmarks/records/compare-lm-4x1-1gbit-bound/8e15fb6-intel-xeon-2c.json \
--other torchrec-rw --out @OUT@/ratios-lm-4x1.json"
  [ratios-bound]="$py benchmarks/ratios.py \
benchmarks/records/compare-lm-2x2-1gbit-bound/8e15fb6-intel-xeon-2c.json benchmarks/records/compare-lm-4x1-1gbit-bound/8e15fb6-intel-xeon-2c.json \
--other local-sparse torchrec-rw --out @OUT@/ratios-lm-bound.json"
  [ratios-table4-lm]="$py benchmarks/ratios.py \
benchmarks/records/table4-lm-ps-hybrid-5rounds/b0528f6-intel-xeon-2c.json benchmarks/records/compare-lm-2x2-1gbit-session41/c124bc4-intel-xeon-2c.json \
--other ps --out @OUT@/ratios-table4-lm.json"
  [async]="$py benchmarks/async_training.py --workloads lm recsys --layouts 4x1 2x2 \
--rate 1gbit --steps 150"
)
ORDER=(lm-2x2 lm-4x1 lm-kjv time-to-quality time-to-quality-nmt recsys recsys-history recsys-riders recsys-history-rest
       recsys-history-100 recsys-history-byrows recsys-riders-100 lm-riders-100
       lm-4x1-riders-100 lm-riders lm-4x1-riders cnn table1 table4 table4-4x1-100mbit table4-2x2-100mbit scaling extrapolate scaling-fair extrapolate-fair sparsity sparsity-fair sparsity-seq table6-4x1-100mbit local-aggregation-2x4 local-aggregation-2x4-10mbit local-aggregation-2x8 local-aggregation-2x8-100mbit ablation-recsys ablation-recsys-100mbit ablation-2x2-100mbit bandwidth alpha small-sums
       partitions-2x2 partitions-4x1 partitions-2x2-paper partitions-4x1-paper partition-surface partition-surface-dense partition-surface-large table-over-limit progress slim-dp slim-sweep slim-check slim-k8-100mbit slim-share slim-regime slim-regime-seed0 slim-regime-seed1 slim-regime-seed2 slim-regime-seed3 slim-regime-seed4 slim-ablation lm-dense-sync
       lm-dense-sync-100mbit mp-airfoil mp-report-loopback mp-report-1gbit mp-synthetic mp-airfoil-100mbit mp-splits async phases host-work host-counts host-tables host-replicated threads-recsys threads-lm launch launch-emulated chaos chaos-link
       targets-recsys targets-lm-2x2 targets-lm-bound targets-lm-4x1 ratios-recsys ratios-lm-2x2
       ratios-lm-4x1 ratios-bound ratios-table4-lm)
# the scripts that interleave systems over repeats (compare.py and the experiments on it)
TAKES_REPEATS=(lm-2x2 lm-4x1 lm-kjv recsys recsys-history recsys-riders recsys-history-rest
               recsys-history-100 recsys-history-byrows recsys-riders-100 lm-riders-100 lm-4x1-riders-100
               lm-riders lm-4x1-riders cnn table1 table4 scaling scaling-fair sparsity sparsity-fair sparsity-seq local-aggregation-2x4 local-aggregation-2x4-10mbit local-aggregation-2x8 local-aggregation-2x8-100mbit ablation-recsys ablation-recsys-100mbit bandwidth slim-dp
               slim-sweep slim-check slim-k8-100mbit slim-ablation lm-dense-sync lm-dense-sync-100mbit async
               threads-recsys threads-lm)

if [ "${1:-}" = "--list" ]; then
  for name in "${ORDER[@]}"; do printf '%-18s %s\n' "$name" "${EXPERIMENTS[$name]}"; done
  exit 0
fi
names=("$@")
[ ${#names[@]} -eq 0 ] && names=("${ORDER[@]}")
for name in "${names[@]}"; do
  if [ -z "${EXPERIMENTS[$name]+x}" ]; then
    echo "bench.sh: no experiment '$name'; the experiments: ${ORDER[*]}" >&2
    exit 2
  fi
done

bash scripts/setup.sh || exit 1
if [ -f benchmarks/setup_bench.sh ]; then bash benchmarks/setup_bench.sh || exit 1; fi
failed=()
for name in "${names[@]}"; do
  # word splitting of the command line is intended (no argument holds a space)
  read -r -a cmd <<< "${EXPERIMENTS[$name]}"
  if [[ " ${TAKES_REPEATS[*]} " == *" $name "* ]]; then cmd+=("${repeats[@]}"); fi
  scratch=benchmarks/out/$name
  rm -rf "$scratch" && mkdir -p "$scratch"
  cmd=("${cmd[@]//@OUT@/$scratch}")
  echo "== $name: ${cmd[*]}"
  if PARALLAX_BENCH_OUT=$scratch "${cmd[@]}"; then
    "$py" benchmarks/records.py add "$name" "$scratch" --command "${cmd[*]}" || failed+=("$name")
  else
    failed+=("$name")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  printf 'bench.sh: failed: %s\n' "${failed[@]}" >&2
  exit 1
fi
