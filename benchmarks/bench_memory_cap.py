"""Memory: peak RSS of AdamW, native SOAP, Asteria (host) and Asteria (NVMe), and a training run
capped below what native SOAP needs.

Part 1, peaks (no cap): each configuration trains the same model (--layers linear layers of
--width x --width, no bias, tanh between, batch --batch, --steps steps, precondition_frequency
--freq, one torch thread, same seed and batches) in a fresh Python process, which reports its
ru_maxrss (peak resident set, KiB) and, for Asteria, asteria_stats() (bytes per tier, NVMe bytes
read / written) and the planner's decisions:
  adamw          torch.optim.AdamW
  soap-native    asteria.SOAP, runtime mode="sync" (the native reference: torch.linalg inline)
  asteria-host   asteria.SOAP, mode="async", staleness S (--staleness), eigenbases in host memory
                 (the host tier, asked for: placement {"eigenbases": "host"})
  asteria-nvme   the same with host_budget_bytes --host-budget and nvme_dir (a fresh directory
                 under --dir-parent): the eigenbases past the budget live on the NVMe tier
The Asteria configurations keep their blocks at --tier-dtype (float32). --tier-dtypes D,...
adds each of --tier-dtype-configs (asteria-nvme) at each other tier dtype D as a configuration
of its own, named with the dtype (asteria-nvme-int8, asteria-host-int4, ...), and a table of
float32 against them: the anonymous / group peaks, ru_maxrss, the planner's peak, the bytes on
each tier and the NVMe bytes read and written per step.
Part 2, the cap: a memory cgroup (benchmarks/memcap.py: cgroup v1 or v2, no swap) capped at
--cap-bytes, or by default (choose_cap) halfway between asteria-nvme's and soap-native's cgroup
peaks as measured uncapped (with --cap-margin-mib M: at most asteria-nvme's + M MiB): their
ANONYMOUS peaks (part 1 runs each configuration in a group capped at
the machine's memory and samples the group's anonymous memory every 20 ms; the group's own peak
also counts page cache, which a cap reclaims, and ru_maxrss the shared libraries' pages). Where
asteria-nvme's anonymous peak is not below native's no cap can separate them, and part 2 says
so instead of running; soap-native then asteria-nvme run inside it. The JSON records whether the
kernel's OOM killer ended each, the group's peak, the step times against the uncapped run, and
whether the capped asteria-nvme run's final parameters are bitwise equal to the uncapped one's.

The pieces (measure_uncapped, choose_cap, run_capped_configs) are also the main job's memory
part (examples/main_job.py). Writes benchmarks/results/bench_memory_cap.json and
bench_memory_cap.png.

    python3 benchmarks/bench_memory_cap.py                 # the issue's setting: 4 x 2048^2
    python3 benchmarks/bench_memory_cap.py --quick --out-dir /tmp/x
    python3 benchmarks/bench_memory_cap.py --tier-dtypes float32,int8,int4 --jobs 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

from asteria.config import TIER_DTYPES

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

NAME = "bench_memory_cap"
CONFIGS = ("adamw", "soap-native", "asteria-host", "asteria-nvme")
MiB = 1 << 20


def split_config(name: str) -> tuple[str, Optional[str]]:
    """("asteria-nvme", "int8") from "asteria-nvme-int8"; (name, None) without a dtype suffix."""
    for dt in TIER_DTYPES:
        if name.endswith("-" + dt) and name[:-len(dt) - 1] in CONFIGS:
            return name[:-len(dt) - 1], dt
    return name, None


def dtype_configs(args) -> list[str]:
    """The configurations --tier-dtypes adds: each of --tier-dtype-configs at each listed dtype
    other than --tier-dtype (the plain configurations' own)."""
    return [f"{base}-{dt}" for base in args.tier_dtype_configs for dt in args.tier_dtypes
            if dt != args.tier_dtype]


# ---- the worker (a fresh process per configuration) ------------------------------------------

def worker(spec: dict) -> dict[str, Any]:
    import resource

    import torch

    torch.set_num_threads(1)
    from asteria import SOAP

    g = torch.Generator().manual_seed(spec["seed"])
    width, layers, batch = spec["width"], spec["layers"], spec["batch"]
    lins = [torch.nn.Linear(width, width, bias=False) for _ in range(layers)]
    with torch.no_grad():
        for lin in lins:
            lin.weight.copy_(torch.randn(width, width, generator=g) / width ** 0.5)
    params = [lin.weight for lin in lins]
    name, _ = split_config(spec["config"])
    if name == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-3)
    else:
        rt: dict[str, Any] = {"mode": "sync"}
        if name.startswith("asteria"):
            rt = {"mode": "async", "staleness": spec["staleness"], "install": "deterministic",
                  "workers": 1}
            if name == "asteria-host":  # "auto" keeps CPU eigenbases in optimizer.state
                rt["placement"] = {"eigenbases": "host"}
            rt.update(spec.get("runtime_extra", {}))
        if name == "asteria-nvme":
            rt.update(nvme_dir=spec["nvme_dir"], host_budget_bytes=spec["host_budget"])
        opt = SOAP(params, lr=1e-3, precondition_frequency=spec["freq"], runtime=rt)
    target = torch.randn(width, width, generator=g) / width ** 0.5
    times, losses = [], []
    for t in range(spec["steps"]):
        gb = torch.Generator().manual_seed(spec["seed"] * 1000 + t)
        x = torch.randn(batch, width, generator=gb)
        y = torch.tanh(x @ target)
        t0 = time.perf_counter()
        h = x
        for i, lin in enumerate(lins):
            h = lin(h)
            if i + 1 < len(lins):
                h = torch.tanh(h)
        loss = torch.nn.functional.mse_loss(h, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    out: dict[str, Any] = {"config": spec["config"], "step_s": times, "losses": losses}
    if hasattr(opt, "asteria_stats"):
        st = opt.asteria_stats()
        out["stats"] = {k: v for k, v in st.items() if isinstance(v, (int, float))}
        out["plan"] = opt.asteria_plan()
        mp = opt.asteria_memory_plan()  # the planner's figures (peak bytes per tier and parts)
        parts = mp["peak_parts"]
        out["memory_plan"] = {"peak_bytes": mp["peak_bytes"], "parts": parts,
                              "peak_total": mp["peak_total"],
                              "inflight_bytes": parts.get("snapshot ring", 0)
                              + parts.get("refresh results", 0)
                              + parts.get("rotated moments", 0)}
    if spec.get("params_out"):
        torch.save([p.detach().clone() for p in params], spec["params_out"])
    if hasattr(opt, "close"):
        opt.close()
    out["ru_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


# ---- the parent ------------------------------------------------------------------------------

def spec_for(args, config: str, nvme_dir: str, params_out: Optional[str] = None) -> dict:
    dt = split_config(config)[1] or getattr(args, "tier_dtype", "float32")
    return {"config": config, "width": args.width, "layers": args.layers, "batch": args.batch,
            "steps": args.steps, "freq": args.freq, "staleness": args.staleness,
            "seed": args.seed, "nvme_dir": nvme_dir, "host_budget": args.host_budget,
            "params_out": params_out,
            "runtime_extra": {"tier_dtype": dt} if dt != "float32" else {}}


def child_cmd(spec: dict) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]


def child_env() -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    # the asteria this process imported (installed, or a dev build on PYTHONPATH), never the
    # source tree by default: it has no built extension unless a dev build put one there
    import asteria

    pkg = os.path.dirname(os.path.dirname(os.path.abspath(asteria.__file__)))
    env["PYTHONPATH"] = pkg + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def parse_result(stdout: str) -> Optional[dict]:
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return None


def run_uncapped(spec: dict, timeout: float) -> dict:
    """One configuration without a cap; inside a memory cgroup capped at the machine's memory
    where one can be made, so its group peak (anonymous memory and page cache it brought in,
    not the shared libraries other processes had mapped already, which ru_maxrss counts) is
    known and comparable with the capped runs."""
    import memcap
    if memcap.available()[0] is not None:
        r = memcap.run_capped(child_cmd(spec), os.sysconf("SC_PHYS_PAGES") *
                              os.sysconf("SC_PAGE_SIZE"), timeout, env=child_env())
        rc, out, err, peak = r["returncode"], r["stdout"], r["stderr"], r["cgroup_peak_bytes"]
        anon = r["anon_peak_bytes"]
    else:
        p = subprocess.run(child_cmd(spec), capture_output=True, text=True, env=child_env(),
                           timeout=timeout)
        rc, out, err, peak, anon = p.returncode, p.stdout, p.stderr, None, None
    res = parse_result(out)
    if rc != 0 or res is None:
        raise RuntimeError(f"{spec['config']} failed (rc {rc}): {err[-2000:]}")
    res["cgroup_peak_bytes"] = peak
    res["anon_peak_bytes"] = anon
    return res


def measure_uncapped(args, configs: Sequence[str], work: str, log,
                     jobs: int = 1) -> dict[str, Any]:
    """Each of ``configs`` trained without a cap (run_uncapped), each its own process and group,
    so peaks do not mix; ``jobs`` of them at a time side by side (peaks unaffected, step times
    shared). Each asteria-nvme configuration keeps its final parameters in ``work``
    (``ref_params``), the capped run's reference. Returns config -> result."""
    specs = {}
    for cfg in configs:
        nvme = os.path.join(work, f"nvme-{cfg}")
        os.makedirs(nvme, exist_ok=True)
        out = ref_params(work, cfg) if split_config(cfg)[0] == "asteria-nvme" else None
        specs[cfg] = spec_for(args, cfg, nvme, out)
    from concurrent.futures import ThreadPoolExecutor, as_completed
    done: dict[str, Any] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(configs)))) as ex:
        futs = {ex.submit(run_uncapped, specs[cfg], args.timeout): cfg for cfg in configs}
        for fut in as_completed(futs):  # each one's line as it ends: a long run's log has them
            cfg = futs[fut]
            r = done[cfg] = fut.result()
            st = r.get("stats", {})
            log(f"{cfg:18s} ru_maxrss {r['ru_maxrss_bytes'] / MiB:8.1f} MiB, cgroup peak "
                f"{(r['cgroup_peak_bytes'] or 0) / MiB:8.1f} MiB, anon peak "
                f"{(r['anon_peak_bytes'] or 0) / MiB:8.1f} MiB, planned "
                f"{((r.get('memory_plan') or {}).get('peak_total') or 0) / MiB:.1f} MiB, NVMe "
                f"{st.get('bytes_nvme', 0) / MiB:.1f} MiB, read / written per step "
                f"{st.get('bytes_nvme_read', 0) / MiB / len(r['step_s']):.1f} / "
                f"{st.get('bytes_nvme_written', 0) / MiB / len(r['step_s']):.1f} MiB, median "
                f"step {sorted(r['step_s'])[len(r['step_s']) // 2]:.3f} s, final loss "
                f"{r['losses'][-1]:.6f}")
    return {cfg: done[cfg] for cfg in configs}


def ref_params(work: str, config: str = "asteria-nvme") -> str:
    """Where the uncapped run of ``config`` (an asteria-nvme one) leaves its final parameters."""
    return os.path.join(work, f"{config}-uncapped.pt")


def choose_cap(native_anon: int, asteria_anon: int,
               margin: Optional[int] = None) -> tuple[Optional[int], str]:
    """(cap bytes, how it was chosen) from the uncapped anonymous peaks of native SOAP and
    asteria-nvme: halfway between them, or with ``margin`` at most Asteria's peak + margin
    (native SOAP's need varies from run to run by up to ~120 MiB on 4 x 1024^2, Asteria's far
    less: a cap halfway between one pair's peaks can sit above native's next need). (None,
    why) where Asteria's peak is not below native's: no cap separates them."""
    if asteria_anon >= native_anon:
        return None, (f"no cap separates them: asteria-nvme's anonymous peak "
                      f"({asteria_anon / MiB:.0f} MiB) is not below native SOAP's "
                      f"({native_anon / MiB:.0f} MiB)")
    half = (native_anon + asteria_anon) // 2
    if margin is None or asteria_anon + margin >= half:
        return half, "halfway between native SOAP's and asteria-nvme's uncapped anonymous peaks"
    return asteria_anon + margin, (f"asteria-nvme's uncapped anonymous peak + "
                                   f"{margin / MiB:.0f} MiB (below halfway to native SOAP's)")


def run_capped_configs(args, cap: int, work: str, log,
                       configs: Sequence[str] = ("soap-native", "asteria-nvme"),
                       tag: str = "capped", jobs: int = 1) -> dict[str, Any]:
    """Each of ``configs`` in a fresh memory cgroup capped at ``cap`` bytes (memcap.run_capped),
    ``jobs`` at a time: config -> whether the kernel's OOM killer ended it, the group's peaks,
    whether it completed, its result, and for each asteria-nvme configuration whether its final
    parameters are bitwise equal to its uncapped run's (``ref_params``, from
    measure_uncapped)."""
    import memcap
    import torch

    def one(cfg: str) -> dict[str, Any]:
        nvme = os.path.join(work, f"nvme-{tag}-{cfg}")
        os.makedirs(nvme, exist_ok=True)
        out = os.path.join(work, f"{cfg}-{tag}.pt")
        spec = spec_for(args, cfg, nvme, out)
        r = memcap.run_capped(child_cmd(spec), cap, args.timeout, env=child_env())
        res = parse_result(r["stdout"])
        entry = {k: r[k] for k in ("returncode", "killed_by_oom", "oom_kill_count",
                                   "limit_hits", "cgroup_peak_bytes", "anon_peak_bytes",
                                   "wall_s")}
        entry["completed"] = res is not None and r["returncode"] == 0
        entry["stderr_tail"] = r["stderr"][-600:]
        if res is not None:
            entry["result"] = res
            ref_path = ref_params(work, cfg)
            if split_config(cfg)[0] == "asteria-nvme" and os.path.exists(ref_path):
                ref, got = torch.load(ref_path), torch.load(out)
                entry["bitwise_equal_to_uncapped"] = (
                    len(ref) == len(got) and all(torch.equal(a, b) for a, b in zip(ref, got)))
        log(f"capped {cfg:18s} at {cap / MiB:.0f} MiB: rc {r['returncode']}, OOM-killed "
            f"{entry['killed_by_oom']}, group peak {(r['cgroup_peak_bytes'] or 0) / MiB:.0f} MiB")
        return entry

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(configs)))) as ex:
        return dict(zip(configs, ex.map(one, configs)))


def measure(args, work: str, log) -> tuple[dict[str, Any], dict[str, Any]]:
    """Part 1 (uncapped, measure_uncapped), part 2 (the cap, run_capped_configs) and the
    --tier-dtypes configurations (uncapped: after part 2, or with --parallel beside parts 1 and
    2, each in its own group): (config -> result, the capped part)."""
    import memcap
    from concurrent.futures import ThreadPoolExecutor

    extra = dtype_configs(args)
    jobs = len(CONFIGS) + len(extra) if args.parallel else args.jobs
    capped: dict[str, Any] = {}
    with ThreadPoolExecutor(max_workers=1) as side:
        beside = (side.submit(measure_uncapped, args, extra, work, log, jobs)
                  if extra and args.parallel else None)
        results = measure_uncapped(args, CONFIGS, work, log, jobs)
        kind, why = memcap.available()
        native, nv = results["soap-native"], results["asteria-nvme"]
        cap, how = args.cap_bytes or None, "--cap-bytes"
        if kind is None:
            capped = {"skipped": why}
            log(f"no capped run: {why}")
        elif cap is None:
            # Under a cap the group's page cache is reclaimed: the anonymous peaks are the need.
            margin = args.cap_margin_mib * MiB if args.cap_margin_mib else None
            cap, how = choose_cap(native["anon_peak_bytes"], nv["anon_peak_bytes"], margin)
            if cap is None:
                capped = {"skipped": how}
                log(how)
        if kind is not None and cap is not None:
            capped = {"cgroup": kind, "cap_bytes": cap, "cap_rule": how,
                      "runs": run_capped_configs(args, cap, work, log,
                                                 jobs=2 if args.parallel else 1)}
        if extra:
            results.update(beside.result() if beside is not None
                           else measure_uncapped(args, extra, work, log, jobs))
    return results, capped


def run(args, argv) -> dict[str, Any]:
    import common

    log, meta = common.start_run(NAME, __file__, argv)
    os.makedirs(args.dir_parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix="asteria-memcap-", dir=args.dir_parent)
    eig_bytes = args.layers * 2 * args.width * args.width * 4
    log(f"{args.layers} x {args.width}^2, batch {args.batch}, {args.steps} steps, f={args.freq}, "
        f"S={args.staleness}; eigenbases {eig_bytes / MiB:.0f} MiB; load {common.loadavg()}")
    try:
        results, capped = measure(args, work, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    meta["machine"]["loadavg_end"] = list(os.getloadavg())
    data = {**meta,
            "settings": {k: getattr(args, k) for k in ("width", "layers", "batch", "steps", "freq",
                                                       "staleness", "host_budget", "seed",
                                                       "cap_bytes", "cap_margin_mib",
                                                       "tier_dtype", "tier_dtypes",
                                                       "tier_dtype_configs", "jobs", "parallel",
                                                       "quick")},
            "eigenbasis_bytes": eig_bytes, "uncapped": results, "capped": capped,
            "tier_dtypes": dtype_table(results, args), "targets": targets(results, eig_bytes)}
    return common.finish(data, NAME, args.out_dir, args.no_plot, print_table, plot, log)


def dtype_table(results: dict, args) -> dict[str, Any]:
    """Per configuration of --tier-dtype-configs, its runs at each tier dtype (the plain one at
    --tier-dtype first): the peaks, the planner's, the bytes per tier and the NVMe bytes per
    step. Empty without --tier-dtypes."""
    if not dtype_configs(args):
        return {}
    table: dict[str, Any] = {}
    for base in args.tier_dtype_configs:
        rows = {}
        for dt in [args.tier_dtype] + [d for d in args.tier_dtypes if d != args.tier_dtype]:
            r = results.get(base if dt == args.tier_dtype else f"{base}-{dt}")
            if r is None:
                continue
            st, mp, steps = r.get("stats", {}), r.get("memory_plan") or {}, len(r["step_s"])
            rows[dt] = {"anon_peak_bytes": r.get("anon_peak_bytes"),
                        "cgroup_peak_bytes": r.get("cgroup_peak_bytes"),
                        "ru_maxrss_bytes": r["ru_maxrss_bytes"],
                        "planned_peak_total_bytes": mp.get("peak_total"),
                        "planned_peak_bytes": mp.get("peak_bytes"),
                        "tier_bytes": {t: st.get(f"bytes_{t}", 0)
                                       for t in ("device", "host", "host_pinned", "uvm", "nvme")},
                        "nvme_read_bytes_per_step": st.get("bytes_nvme_read", 0) / steps,
                        "nvme_written_bytes_per_step": st.get("bytes_nvme_written", 0) / steps,
                        "median_step_s": sorted(r["step_s"])[steps // 2],
                        "final_loss": r["losses"][-1]}
        table[base] = rows
    return table


def targets(results: dict, eig_bytes: int) -> dict:
    """The issue's targets: NVMe peak <= native - 0.8 x eigenbases; host async peak <= native +
    the planner's in-flight snapshot and result bytes."""
    native = results["soap-native"]["ru_maxrss_bytes"]
    nvme = results["asteria-nvme"]["ru_maxrss_bytes"]
    host = results["asteria-host"]
    anon = {c: r.get("anon_peak_bytes") for c, r in results.items()}
    mp = host.get("memory_plan") or {}
    inflight = mp.get("inflight_bytes")
    out = {"nvme_peak_minus_native_bytes": nvme - native,
           "nvme_target_bytes": native - int(0.8 * eig_bytes),
           "nvme_target_met": nvme <= native - 0.8 * eig_bytes,
           "host_peak_minus_native_bytes": host["ru_maxrss_bytes"] - native,
           "anon_peak_bytes": anon,
           "planned_peak_total_bytes": {c: (r.get("memory_plan") or {}).get("peak_total")
                                        for c, r in results.items()}}
    if anon.get("soap-native") and anon.get("asteria-nvme"):
        out["anon_nvme_minus_native_bytes"] = anon["asteria-nvme"] - anon["soap-native"]
        out["anon_nvme_target_met"] = (anon["asteria-nvme"]
                                       <= anon["soap-native"] - 0.8 * eig_bytes)
    if inflight is not None:
        out["host_target_bytes"] = native + inflight
        out["host_target_met"] = host["ru_maxrss_bytes"] <= native + inflight
    return out


def plot(data: dict, path: str) -> None:
    import common
    plt = common.pyplot()
    table = data.get("tier_dtypes") or {}
    fig, axes = plt.subplots(1, 3 if table else 2, figsize=(16.5 if table else 11, 4.5))
    res = data["uncapped"]
    names = [c for c in CONFIGS if c in res]
    axes[0].bar(names, [res[c]["ru_maxrss_bytes"] / MiB for c in names],
                color=["grey", "tab:red", "tab:blue", "tab:green"][:len(names)])
    axes[0].axhline(data["targets"]["nvme_target_bytes"] / MiB, ls="--", color="tab:green",
                    label="NVMe target (native - 0.8 x eigenbases)")
    axes[0].set(ylabel="peak RSS (ru_maxrss), MiB", title="Peak memory, uncapped")
    axes[0].legend(fontsize=7)
    cap = data["capped"]
    if cap.get("runs"):
        runs = cap["runs"]
        cn = list(runs)
        axes[1].bar(cn, [(runs[c]["cgroup_peak_bytes"] or 0) / MiB for c in cn],
                    color=["tab:red" if runs[c]["killed_by_oom"] else "tab:green" for c in cn])
        axes[1].axhline(cap["cap_bytes"] / MiB, ls="--", color="black", label="cap")
        for i, c in enumerate(cn):
            axes[1].text(i, cap["cap_bytes"] / MiB * 0.5,
                         "OOM-killed" if runs[c]["killed_by_oom"] else
                         ("completed" if runs[c]["completed"] else "failed"), ha="center")
        axes[1].set(ylabel="cgroup peak, MiB", title=f"Capped at {cap['cap_bytes'] / MiB:.0f} "
                    f"MiB (cgroup {cap['cgroup']})")
        axes[1].legend(fontsize=7)
    else:
        axes[1].text(0.5, 0.5, cap.get("skipped", "no capped run"), ha="center", wrap=True)
    if table:
        plot_dtypes(axes[2], table)
    common.write_png(fig, path)


def plot_dtypes(ax, table: dict) -> None:
    """Each tier dtype's anonymous peak (bars) and NVMe bytes read per step (dots, right axis)."""
    labels, peaks, reads = [], [], []
    for base, rows in table.items():
        for dt, row in rows.items():
            labels.append(f"{base.replace('asteria-', '')}\n{dt}")
            peaks.append((row["anon_peak_bytes"] or row["ru_maxrss_bytes"]) / MiB)
            reads.append(row["nvme_read_bytes_per_step"] / MiB)
    x = range(len(labels))
    ax.bar(x, peaks, color="tab:green", label="anonymous peak")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set(ylabel="anonymous peak, MiB", title="Tier dtypes: peak and NVMe reads")
    ax.set_ylim(bottom=min(peaks) * 0.8)
    tw = ax.twinx()
    tw.plot(x, reads, "o", color="tab:purple", label="NVMe read per step")
    tw.set(ylabel="NVMe MiB read per step")
    tw.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=7)
    tw.legend(loc="upper right", fontsize=7)


def print_table(data: dict) -> None:
    print(f"{'config':20s}{'ru_maxrss MiB':>15s}{'cgroup MiB':>12s}{'anon MiB':>10s}"
          f"{'plan MiB':>10s}{'median step s':>15s}"
          f"{'host MiB':>10s}"
          f"{'nvme MiB':>10s}{'nvme rd MiB':>12s}{'nvme wr MiB':>12s}")
    for c, r in data["uncapped"].items():
        st = r.get("stats", {})
        steps = sorted(r["step_s"])
        print(f"{c:20s}{r['ru_maxrss_bytes'] / MiB:15.1f}"
              f"{(r.get('cgroup_peak_bytes') or 0) / MiB:12.1f}"
              f"{(r.get('anon_peak_bytes') or 0) / MiB:10.1f}"
              f"{((r.get('memory_plan') or {}).get('peak_total') or 0) / MiB:10.1f}"
              f"{steps[len(steps) // 2]:15.3f}"
              f"{st.get('bytes_host', 0) / MiB:10.1f}{st.get('bytes_nvme', 0) / MiB:10.1f}"
              f"{st.get('bytes_nvme_read', 0) / MiB:12.1f}"
              f"{st.get('bytes_nvme_written', 0) / MiB:12.1f}")
    cap = data["capped"]
    for c, r in cap.get("runs", {}).items():
        print(f"capped {c}: rc {r['returncode']} OOM-killed {r['killed_by_oom']} completed "
              f"{r['completed']} bitwise equal {r.get('bitwise_equal_to_uncapped')}")
    for base, rows in (data.get("tier_dtypes") or {}).items():
        print(f"\n{base} by tier dtype (MiB; NVMe per step):")
        print(f"{'tier dtype':12s}{'anon peak':>11s}{'group peak':>12s}{'ru_maxrss':>11s}"
              f"{'plan':>9s}{'host':>9s}{'nvme':>9s}{'rd/step':>9s}{'wr/step':>9s}"
              f"{'final loss':>12s}")
        for dt, w in rows.items():
            print(f"{dt:12s}{(w['anon_peak_bytes'] or 0) / MiB:11.1f}"
                  f"{(w['cgroup_peak_bytes'] or 0) / MiB:12.1f}{w['ru_maxrss_bytes'] / MiB:11.1f}"
                  f"{(w['planned_peak_total_bytes'] or 0) / MiB:9.1f}"
                  f"{w['tier_bytes']['host'] / MiB:9.1f}{w['tier_bytes']['nvme'] / MiB:9.1f}"
                  f"{w['nvme_read_bytes_per_step'] / MiB:9.1f}"
                  f"{w['nvme_written_bytes_per_step'] / MiB:9.1f}{w['final_loss']:12.6f}")
    print("targets:", json.dumps(data["targets"]))


def parse_args(argv: Optional[Sequence[str]]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--width", type=int, default=None, help="layer width (2048; --quick 512)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=None, help="steps (31; --quick 21)")
    ap.add_argument("--freq", type=int, default=10, help="precondition_frequency")
    ap.add_argument("--staleness", type=int, default=5)
    ap.add_argument("--host-budget", type=int, default=1 << 20)
    ap.add_argument("--cap-bytes", type=int, default=0,
                    help="0: chosen from the uncapped peaks (choose_cap)")
    ap.add_argument("--cap-margin-mib", type=float, default=0,
                    help="0: the cap halfway between native's and asteria-nvme's anonymous "
                         "peaks; else at most asteria-nvme's peak + this many MiB")
    ap.add_argument("--tier-dtype", default="float32", choices=TIER_DTYPES,
                    help="the Asteria configurations' runtime tier_dtype")
    ap.add_argument("--tier-dtypes", default="",
                    help="comma-separated tier dtypes (of " + ", ".join(TIER_DTYPES) + "): each "
                         "of --tier-dtype-configs also runs at each one other than --tier-dtype")
    ap.add_argument("--tier-dtype-configs", default="asteria-nvme",
                    help="comma-separated Asteria configurations --tier-dtypes applies to")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--dir-parent", default=None,
                    help="where nvme_dir goes (default benchmarks/results/tmp)")
    ap.add_argument("--parallel", action="store_true",
                    help="part 1's configurations side by side, and part 2's, and the "
                         "--tier-dtypes ones beside both (peaks unaffected, times shared)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="part 1's configurations this many at a time (as --parallel)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    if args.worker is not None:
        return args
    args.tier_dtypes = [d.strip() for d in args.tier_dtypes.split(",") if d.strip()]
    for d in args.tier_dtypes:
        if d not in TIER_DTYPES:
            ap.error(f"--tier-dtypes: {d!r} is not a tier dtype; allowed: "
                     + ", ".join(TIER_DTYPES))
    args.tier_dtype_configs = [c.strip() for c in args.tier_dtype_configs.split(",")
                               if c.strip()]
    for c in args.tier_dtype_configs:
        if not c.startswith("asteria-") or c not in CONFIGS:
            ap.error(f"--tier-dtype-configs: {c!r} is not an Asteria configuration; allowed: "
                     + ", ".join(c for c in CONFIGS if c.startswith("asteria-")))
    if args.jobs < 1:
        ap.error("--jobs: at least 1")
    import common
    q = args.quick
    common.fill_defaults(args, dict(width=512 if q else 2048, steps=21 if q else 31,
                                    dir_parent=os.path.join(common.RESULTS_DIR, "tmp"),
                                    out_dir=os.path.join(common.RESULTS_DIR, "tmp") if q
                                    else common.RESULTS_DIR))
    return args


def main(argv: Optional[Sequence[str]] = None) -> Any:
    args = parse_args(argv)
    if args.worker is not None:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return None
    return run(args, argv)


if __name__ == "__main__":
    main()
