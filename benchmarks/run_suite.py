"""Run the whole benchmark suite: every part writes <out-dir>/<name>.json and <name>.png, then a
summary table is printed and written to <out-dir>/summary.json. With --only, the parts not run
keep their entries from the summary.json already there (each entry names its command and
finishing time), so the summary always holds the latest run of every part.

Parts (each a script of its own, run in a child process so one crash, one pool or one torch
thread setting cannot leak into the next; its progress lines stream through):
  a  step_time     bench_step_time.py       step-time distribution: AdamW, native sync SOAP,
                                            Asteria async SOAP (median, p99, max)
  b  convergence   bench_convergence.py     loss vs wall time; time to AdamW's final loss
  c  tiers         bench_tiers.py           optimizer-state bytes per tier
  d  pool          bench_pool_vs_torch.py   worker-pool throughput vs torch.linalg
  e  nvme          bench_nvme.py            NVMe tier bandwidth vs an O_DIRECT baseline
  f  third_party   bench_third_party.py     Asteria SOAP vs pytorch-optimizer's and heavyball's

    python3 benchmarks/run_suite.py                 # everything: about 60 minutes on 2 cores
    python3 benchmarks/run_suite.py --quick         # smoke settings: about 2 minutes
    python3 benchmarks/run_suite.py --only b,d      # a subset, by letter or name
    python3 benchmarks/run_suite.py --quick --only tiers,nvme --out-dir /tmp/x

Default out-dir: benchmarks/results (--quick: benchmarks/results/tmp, which git ignores). A
part that fails (non-zero exit, timeout, or no fresh JSON) is reported in the table and in
summary.json with the tail of its output; the suite goes on and exits 1 at the end.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

NAME = "run_suite"
TAIL_LINES = 40


# ---- what each part's JSON says, in a few numbers --------------------------------------------------

def _by(results: list, key: str) -> dict:
    return {r.get(key): r for r in results or []}


def metrics_step_time(d: dict) -> list[tuple[str, Any, str]]:
    rs = _by(d.get("results"), "optimizer")
    rows = []
    for name in ("adamw", "soap-sync", "soap-async"):
        s = rs.get(name, {}).get("summary")
        if s:
            rows.append((f"{name} median / p99 / max ms",
                         f"{s['median_ms']:.1f} / {s['p99_ms']:.1f} / {s['max_ms']:.1f}", ""))
    a = rs.get("soap-async", {}).get("summary")
    n = rs.get("soap-sync", {}).get("summary")
    if a and n:
        rows.append(("asteria p99 / native sync p99", a["p99_ms"] / n["p99_ms"], "lower is better"))
        rows.append(("asteria max / native sync max", a["max_ms"] / n["max_ms"], ""))
    for key, t in (d.get("targets") or {}).items():
        met = {True: "met", False: "NOT met", None: "not measured"}[t.get("met")]
        rows.append((f"target {key}", t.get("value"), f"{t.get('op')} {t.get('threshold')}: {met}"))
    return rows + disturbed_row(d)


def disturbed_row(d: dict) -> list[tuple[str, Any, str]]:
    """A warning row when other processes kept cores busy during some of the part's runs."""
    names = [r.get("optimizer") for r in d.get("results") or [] if r.get("disturbed")]
    if not names:
        return []
    return [("DISTURBED runs (foreign CPU load)", ", ".join(names),
             "their timings are the machine's as much as the optimizer's")]


def metrics_convergence(d: dict) -> list[tuple[str, Any, str]]:
    rows: list[tuple[str, Any, str]] = []
    for sname, st in (d.get("setting_results") or {}).items():
        for seed, t in st["time_to_adamw_final"].items():
            rows.append((f"{sname}: adamw final loss, seed {seed}", t["target"],
                         f"tuned lr {st['tuned_lr'].get('adamw')}, {t['adamw_steps']} steps, "
                         f"{t['adamw_wall_s']:.1f} s"))
        for name, q in st["ratios"].items():
            per = ", ".join("-" if x is None else f"{x:.2f}" for x in q["time_ratio_per_seed"])
            rows.append((f"{sname}: {name} time to adamw final / adamw time",
                         q["time_ratio_mean"],
                         f"mean over seeds ({per}); lr {st['tuned_lr'].get(name)}"
                         + ("; target <= 0.60" if name == "asteria-soap-async" else "")))
    lim = d.get("step_limit")
    if lim:
        rows.append(("asteria-soap step / its limit", lim["step_over_limit"],
                     f"{lim['asteria_soap_step_median_ms']:.1f} vs "
                     f"{lim['limit_ms_at_peak_rate']:.1f} ms; target <= 1.02"))
        if lim.get("nonrefresh_mean_over_sync_median") is not None:
            rows.append(("asteria-soap non-refresh mean / native sync median",
                         lim["nonrefresh_mean_over_sync_median"], "target <= 1.03"))
    runs = [r for st in (d.get("setting_results") or {}).values() for r in st["runs"]]
    return rows + disturbed_row({"results": runs})


def metrics_tiers(d: dict) -> list[tuple[str, Any, str]]:
    rows = []
    for r in d.get("results", []):
        t = r["bytes_per_tier"]["tiers"]
        frac = (d.get("derived") or {}).get(r["config"], {}).get("device_fraction_of_native")
        rows.append((f"{r['config']} MiB device/host/nvme",
                     f"{t['device'] / 2**20:.2f} / "
                     f"{(t['host'] + t['host_pinned'] + t['uvm']) / 2**20:.2f} / "
                     f"{t['nvme'] / 2**20:.2f}",
                     "" if frac is None else f"device = {frac:.2f} x native"))
    for f in d.get("failures", []):
        rows.append((f"{f['config']}", "FAILED", f["error"][:110]))
    return rows


def metrics_pool(d: dict) -> list[tuple[str, Any, str]]:
    rows = []
    for r in d.get("results", []):
        rows.append((f"{r['op']} n={r['n']} pool/torch (1 | 2 | best)",
                     f"{r['ratio_pool1_torch1']:.2f} | {r['ratio_pool2_torch2']:.2f} | "
                     f"{r['ratio_pool2_torch_best']:.2f}",
                     f"blocks/s torch1 {r['torch1']['blocks_per_s']:.1f}, pool1 "
                     f"{r['pool1']['blocks_per_s']:.1f}, torch2 {r['torch2']['blocks_per_s']:.1f}, "
                     f"pool2 {r['pool2']['blocks_per_s']:.1f}"))
    g = d.get("geomean") or {}
    if g:
        rows.append(("geomean pool/torch (1 | 2 | best)",
                     f"{g['ratio_pool1_torch1']:.2f} | {g['ratio_pool2_torch2']:.2f} | "
                     f"{g['ratio_pool2_torch_best']:.2f}",
                     "best: pool2 over the better of torch 1 and 2 threads"))
    return rows


def metrics_nvme(d: dict) -> list[tuple[str, Any, str]]:
    rows = []
    for r in d.get("results", []):
        rows.append((f"{r['block_bytes'] >> 10} KiB blocks: write | read store/direct",
                     f"{r['ratio_write_store_direct']:.2f} | {r['ratio_read_store_direct']:.2f}",
                     f"MB/s store {r['store_write_MBps']:.0f} w, {r['store_read_MBps']:.0f} r; "
                     f"O_DIRECT {r['direct_write_MBps']:.0f} w, {r['direct_read_MBps']:.0f} r"))
    rows.append(("store O_DIRECT", d.get("store_nvme_direct"), d.get("page_cache", "")[:90]))
    return rows


def metrics_third_party(d: dict) -> list[tuple[str, Any, str]]:
    cmp = (d.get("comparison") or {}).get("runs", {})
    rows = []
    for r in d.get("results", []):
        name = r["optimizer"]
        if not r.get("ok"):
            rows.append((name, "FAILED", f"{r.get('stage')}: {r.get('error', '')[:100]}"))
            continue
        c = cmp.get(name, {})
        df = c.get("final_loss_diff_vs_reference")
        rows.append((f"{name} median / p99 ms, final loss",
                     f"{r['summary']['median_ms']:.1f} / {r['summary']['p99_ms']:.1f}, "
                     f"{r['final_loss']:.3f}",
                     (f"{r.get('version')}; " if r.get("version") else "")
                     + ("" if df is None else f"final - native sync {df:+.3f}")))
    return rows + disturbed_row(d)


@dataclasses.dataclass(frozen=True)
class Part:
    key: str
    name: str
    script: str
    json: str
    metrics: Callable[[dict], list]
    # rough full / quick wall seconds on 2 idle cores, for the progress line only
    expect_s: tuple[int, int]


PARTS = (
    Part("a", "step_time", "bench_step_time.py", "bench_step_time.json", metrics_step_time, (240, 15)),
    Part("b", "convergence", "bench_convergence.py", "bench_convergence.json",
         metrics_convergence, (2700, 25)),
    Part("c", "tiers", "bench_tiers.py", "bench_tiers.json", metrics_tiers, (40, 10)),
    Part("d", "pool", "bench_pool_vs_torch.py", "bench_pool_vs_torch.json", metrics_pool, (150, 15)),
    Part("e", "nvme", "bench_nvme.py", "bench_nvme.json", metrics_nvme, (60, 8)),
    Part("f", "third_party", "bench_third_party.py", "bench_third_party.json",
         metrics_third_party, (150, 15)),
)


def headline(parts: dict[str, dict]) -> dict[str, Any]:
    """The three numbers a reader asks for first."""
    def metric(key: str, label: str):
        for row in parts.get(key, {}).get("metrics", []):
            if row["metric"] == label:
                return row["value"]
        return None

    pool = parts.get("d", {}).get("data_geomean") or {}
    return {
        "convergence_soap_async_time_ratio": metric(
            "b", "users: asteria-soap-async time to adamw final / adamw time"),
        "step_time_asteria_p99_over_native_sync_p99": metric(
            "a", "asteria p99 / native sync p99"),
        "pool_over_torch_linalg_geomean_1_thread": pool.get("ratio_pool1_torch1"),
        "pool_over_torch_linalg_geomean_2_threads": pool.get("ratio_pool2_torch2"),
        "pool2_over_best_torch_linalg_geomean": pool.get("ratio_pool2_torch_best"),
    }


# ---- running ------------------------------------------------------------------------------------

def child_env() -> tuple[dict[str, str], Optional[str]]:
    """The environment of the parts: ours, plus python/ on PYTHONPATH when asteria is not
    importable otherwise (a dev checkout with the extension built in place)."""
    env = dict(os.environ)
    added = None
    if importlib.util.find_spec("asteria") is None:
        added = os.path.join(common.ROOT, "python")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (added, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env, added


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def previous_parts(args) -> dict[str, dict]:
    """With --only: the other parts' entries of the summary.json already in out-dir (same
    --quick setting), so the summary keeps the latest run of every part. Each entry says when
    and by which command it ran."""
    path = os.path.join(args.out_dir, "summary.json")
    if not args.only or not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
    except (OSError, ValueError):
        return {}
    if old.get("quick") != args.quick:
        return {}
    chosen = {p.key for p in args.parts}
    keep = {}
    for key, p in (old.get("parts") or {}).items():
        if key not in chosen:
            keep[key] = dict(p, finished=p.get("finished") or old.get("date"),
                             from_previous_suite_run=p.get("from_previous_suite_run")
                             or old.get("command"))
    return keep


def _echo(stream, tail: collections.deque) -> None:
    """Pass a part's output through as it comes (its progress lines), keeping the tail."""
    for line in stream:
        print(line, end="", flush=True)
        tail.append(line.rstrip("\n"))


def run_part(part: Part, args, env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, os.path.join(HERE, part.script), "--out-dir", args.out_dir]
    if args.quick:
        cmd.append("--quick")
    display = common.command_line(os.path.join(HERE, part.script),
                                  cmd[2:])
    expect = part.expect_s[1 if args.quick else 0]
    print(f"\n=== ({part.key}) {part.name}: {display}   [about {expect} s on idle cores; "
          f"load {common.loadavg()}]", flush=True)
    json_path = os.path.join(args.out_dir, part.json)
    # a part may take twice its idle-machine time (loaded machines), never less than the floor
    limit = max(args.part_timeout, 2 * expect)
    t0 = time.time()
    tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=os.getcwd(), start_new_session=True, bufsize=1)
    reader = threading.Thread(target=_echo, args=(proc.stdout, tail), daemon=True)
    reader.start()
    timed_out = False
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    reader.join(timeout=10)
    wall = time.time() - t0
    out: dict[str, Any] = {"key": part.key, "name": part.name, "script": part.script,
                           "command": display, "finished": _now(), "rc": rc,
                           "wall_s": round(wall, 1),
                           "timed_out": timed_out, "json": json_path, "ok": False}
    png = os.path.join(args.out_dir, part.json[:-5] + ".png")
    out["png"] = png if os.path.exists(png) and os.path.getmtime(png) >= t0 - 1 else None
    error = None
    data = None
    if timed_out:
        error = f"timed out after {limit:.0f} s"
    elif rc != 0:
        error = f"exit status {rc}"
    elif not os.path.exists(json_path) or os.path.getmtime(json_path) < t0 - 1:
        error = f"no fresh {part.json} written"
    else:
        try:
            with open(json_path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            error = f"unreadable {part.json}: {e}"
    if data is not None:
        try:
            out["metrics"] = [{"metric": m, "value": v, "note": n} for m, v, n in part.metrics(data)]
            out["ok"] = True
            out["loadavg1"] = (data.get("machine") or {}).get("loadavg1")
            out["loadavg1_end"] = (data.get("machine") or {}).get("loadavg1_end")
            if part.key == "d":
                out["data_geomean"] = data.get("geomean")
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            error = f"{part.json} lacks an expected field: {type(e).__name__}: {e}"
    if error:
        out["error"] = error
        out["output_tail"] = list(tail)
        print(f"=== ({part.key}) {part.name} FAILED: {error}", flush=True)
    else:
        print(f"=== ({part.key}) {part.name} done in {wall:.0f} s", flush=True)
    return out


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return "-" if v is None else str(v)


def print_summary(summary: dict) -> None:
    rows = []
    for p in summary["parts"].values():
        if not p["ok"]:
            rows.append((f"({p['key']}) {p['name']}", "FAILED", p.get("error", "")))
            continue
        for m in p["metrics"]:
            rows.append((f"({p['key']}) {p['name']}: {m['metric']}", fmt(m["value"]), m["note"]))
    w0 = max([len(r[0]) for r in rows] + [10])
    w1 = max([len(r[1]) for r in rows] + [5])
    print("\n" + "=" * 30 + " benchmark suite summary " + "=" * 30)
    print(f"{'part: metric':<{w0}}  {'value':>{w1}}  note")
    print("-" * (w0 + w1 + 30))
    for a, b, c in rows:
        print(f"{a:<{w0}}  {b:>{w1}}  {c}")
    print("-" * (w0 + w1 + 30))
    for p in summary["parts"].values():
        print(f"({p['key']}) {p['name']:<12} {'ok' if p['ok'] else 'FAILED':<7} "
              f"{p['wall_s']:>7.1f} s  load {p.get('loadavg1')} -> "
              f"{p.get('loadavg1_end')}  {p['json']}"
              + (f"  (kept from an earlier run, {p.get('finished')})"
                 if p.get("from_previous_suite_run") else ""))
    h = summary["headline"]
    print(f"headline: (b) soap-async time to AdamW's final / AdamW's time = "
          f"{fmt(h['convergence_soap_async_time_ratio'])} (target <= 0.60); (a) Asteria p99 / "
          f"native sync p99 = {fmt(h['step_time_asteria_p99_over_native_sync_p99'])}; (d) pool / "
          f"torch.linalg geomean = {fmt(h['pool_over_torch_linalg_geomean_1_thread'])} (1 thread), "
          f"{fmt(h['pool_over_torch_linalg_geomean_2_threads'])} (2 threads), "
          f"{fmt(h['pool2_over_best_torch_linalg_geomean'])} (2 workers vs torch's better)")
    print(f"load average: {summary['machine']['loadavg1']} at the start, "
          f"{summary['machine'].get('loadavg1_end')} at the end (nproc "
          f"{summary['machine']['nproc']}); suite wall time {summary['wall_s']:.0f} s")


def select(only: Optional[str]) -> list[Part]:
    if not only:
        return list(PARTS)
    keys = {p.key: p for p in PARTS}
    keys.update({p.name: p for p in PARTS})
    chosen = []
    for tok in (t.strip() for t in only.split(",")):
        if not tok:
            continue
        if tok not in keys:
            raise SystemExit(f"--only: unknown part {tok!r}; allowed: "
                             + ", ".join(f"{p.key}/{p.name}" for p in PARTS))
        if keys[tok] not in chosen:
            chosen.append(keys[tok])
    return sorted(chosen, key=PARTS.index)


def parse_args(argv: Optional[Sequence[str]]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="every part's smoke settings")
    ap.add_argument("--only", default=None,
                    help="comma-separated parts, by letter or name: "
                         + ", ".join(f"{p.key}={p.name}" for p in PARTS))
    ap.add_argument("--out-dir", default=None,
                    help="where every JSON / PNG and summary.json go (default benchmarks/results; "
                         "--quick: benchmarks/results/tmp)")
    ap.add_argument("--part-timeout", type=float, default=None,
                    help="seconds one part may take before it is killed, at least (default 900; "
                         "--quick 300; a part expected to take longer gets twice its time)")
    args = ap.parse_args(argv)
    if args.out_dir is None:
        args.out_dir = os.path.join(common.RESULTS_DIR, "tmp") if args.quick else common.RESULTS_DIR
    args.out_dir = os.path.abspath(args.out_dir)
    if args.part_timeout is None:
        args.part_timeout = 300.0 if args.quick else 900.0
    args.parts = select(args.only)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    meta = common.run_metadata(NAME, __file__, argv)
    meta["machine"]["loadavg"] = list(os.getloadavg())  # 1, 5, 15 minutes
    env, added = child_env()
    t0 = time.time()
    print(f"[{NAME}] parts {', '.join(f'({p.key}) {p.name}' for p in args.parts)}; out-dir "
          f"{args.out_dir}; {'quick' if args.quick else 'full'} settings; nproc "
          f"{meta['machine']['nproc']}, load {common.loadavg()}"
          + (f"; PYTHONPATH += {added}" if added else ""), flush=True)
    parts = previous_parts(args)
    if parts:
        print(f"[{NAME}] keeping the previous results of parts {', '.join(sorted(parts))} "
              "in summary.json", flush=True)
    for part in args.parts:
        parts[part.key] = run_part(part, args, env)
    parts = {p.key: parts[p.key] for p in PARTS if p.key in parts}
    meta["machine"]["loadavg1_end"] = common.loadavg()
    meta["machine"]["loadavg_end"] = list(os.getloadavg())
    summary = {**meta, "quick": args.quick, "out_dir": args.out_dir,
               "pythonpath_added": added, "wall_s": round(time.time() - t0, 1),
               "parts": parts, "headline": headline(parts)}
    print_summary(summary)
    path = common.write_json(summary, "summary.json", args.out_dir)
    print(f"[{NAME}] wrote {path}", flush=True)
    return 0 if all(parts[p.key]["ok"] for p in args.parts) else 1


if __name__ == "__main__":
    sys.exit(main())
