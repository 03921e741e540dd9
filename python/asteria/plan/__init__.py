"""The offline planner, ``python3 -m asteria.plan``: will the REFRESH work keep up, for a model
this machine need not hold?

The offline form of the capacity report of ``optimizer.asteria_plan()``: the same cost model
(``asteria.refresh.cost``) priced on parameter shapes alone. For each model and step time it
prints the work per round (GFLOP), the predicted round time on the given host cores (divided
among them, as the split executor does on a CUDA machine), the window S x step time, the pool's
utilisation (its busy share of the f steps between rounds), the smallest S that hides a round
and the fewest cores that hide it at the given S; where the round must run (the host workers
with their PCIe copies, the device executor, both); the f and S of ``-f auto``; the answer of
refresh_policy "drift"; and per tier dtype the bytes each GPU keeps and copies.

Its modules, one thing each:

    shapes.py     the presets (OLMo-2 1B, 7B), the factors of a set of weight shapes, a round's
                  jobs
    storage.py    the bytes of the roots / eigenbases: held per tier dtype, copied per round
    rates.py      the lanes' rates: this machine's per-core rate, the device lane's
    replicas.py   the round of each replica set of a distributed job (``replica_round``, for
                  other code too: benchmarks/bench_cluster.py)
    drift.py      refresh_policy "drift": the budget and d of "auto", the steady state
    verdict.py    one line of the table (``row``): the round, its window, where it must run,
                  ``-f auto``, the policy
    report.py     the text: the tables and the lines under them
    cli.py        the command line (``main``); __main__.py runs it

Owns: the planner's public names, gathered here from its modules. May call: its modules,
``asteria.config`` (the tier dtypes).
Single-threaded.

Examples:
    python3 -m asteria.plan --preset olmo2-1b                        # calibrates here first
    python3 -m asteria.plan --preset olmo2-1b --preset olmo2-7b --cores 14 \\
        --tokens 65536 --tokens 524288 --gflops-per-core 20 --markdown
    python3 -m asteria.plan --shape 4096x4096 --shape 11008x4096 --step-time 1.5
    python3 -m asteria.plan --preset olmo2-7b --nodes 4 --gpus-per-node 8 --parallel hsdp
    python3 -m asteria.plan --preset olmo2-1b --tokens 65536 --gpus-per-node 8 \\
        --parallel fsdp -f auto --gpu-json $OUT/gpu_microbench.json
"""

from asteria.config import TIER_DTYPES  # the tier dtypes the bytes table lists
from asteria.plan.cli import GPU_JSON, H200_BF16_TFLOPS, PCIE_GBPS, main
from asteria.plan.drift import drift_plan, drift_steady_state, expected_ages, spread_order
from asteria.plan.rates import calibrated, device_rate
from asteria.plan.replicas import PARALLEL, layout_of, owners, replica_round, shard_shape
from asteria.plan.report import auto_line, policy_note
from asteria.plan.shapes import PRESETS, factors, preset, round_jobs
from asteria.plan.storage import output_kind, stored_bytes, tier_bytes, transfer_bytes
from asteria.plan.verdict import row

__all__ = ["GPU_JSON", "H200_BF16_TFLOPS", "PARALLEL", "PCIE_GBPS", "PRESETS", "TIER_DTYPES",
           "auto_line", "calibrated", "device_rate", "drift_plan", "drift_steady_state",
           "expected_ages", "factors", "layout_of", "main", "output_kind", "owners",
           "policy_note", "preset", "replica_round", "round_jobs", "row", "shard_shape",
           "spread_order", "stored_bytes", "tier_bytes", "transfer_bytes"]
