"""bench_tier_dtype.py's comparisons, targets, table and figure, and the join of its parts.

Owns: the targets of the quantized tiers (TARGETS), what a run is compared with (float32 on the
same seed and tier; AdamW of the same seed for the loss to reach), ``analyse`` (the JSON's
"per_seed" and "targets"), ``merge`` (the JSONs of separate invocations as one), the printed
table and the figure. May call: bench_convergence's time_to_target and at_time, common.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import common
from bench_convergence import at_time, time_to_target

#: per quantized tier dtype, on every seed, against float32 on the same seed: steps to AdamW's
#: final loss at most (1 + steps) x float32's; held-out loss at most float32's + val; tier bytes
#: (the eigenbases' tiers, scales included) at most bytes x float32's. One-sided: fewer steps
#: or a lower loss than float32's is never a miss.
TARGETS = {"int8": {"steps": 0.02, "val": 0.01, "bytes": 0.27},
           "int4": {"steps": 0.05, "val": 0.02, "bytes": 0.14}}
COLORS = {"float32": "tab:blue", "bfloat16": "tab:orange", "int8": "tab:green",
          "int4": "tab:red", None: "k"}


def _by(results: list) -> dict:
    return {(r["seed"], r["optimizer"]): r for r in results}


def analyse(data: dict) -> dict:
    """``data`` with "per_seed" (each run against AdamW's final loss and against float32 on
    its seed and tier; an NVMe run against its host run, bit for bit) and "targets"."""
    rs, steps = data["results"], data["settings"]["steps"]
    by = _by(rs)
    per_seed: dict[str, Any] = {}
    for seed in data["settings"]["seeds"]:
        adamw = by.get((seed, "adamw"))
        out: dict[str, Any] = {"runs": {}}
        if adamw:
            out.update(target=adamw["smoothed"][-1], adamw_wall_s=adamw["wall_s"],
                       adamw_val_at_own_time=adamw["val"]["loss"][-1])
        for r in rs:
            if r["seed"] != seed or r["optimizer"] == "adamw":
                continue
            e: dict[str, Any] = {"tier_dtype": r["tier_dtype"], "tier": r["tier"],
                                 "val_final": r["val_final"], "tier_bytes": r["tier_bytes"],
                                 "nvme_read_per_step": r["nvme_read_per_step"],
                                 "nvme_written_per_step": r["nvme_written_per_step"]}
            if adamw:
                tt = time_to_target(r, out["target"], adamw["wall_s"], steps,
                                    adamw["cpu_time_s"][-1])
                e.update(steps_to_target=tt["step"], time_ratio=tt["time_ratio"])
                # the time axis is AdamW's only for the runs in its lockstep: the host tier's
                e["val_at_adamw_time"] = (at_time(r["val"]["time_s"], r["val"]["loss"],
                                                  adamw["wall_s"]) if r["tier"] == "host"
                                          else None)
            f32 = by.get((seed, "float32" if r["tier"] == "host" else "float32-nvme"))
            if f32:
                e["tier_bytes_over_float32"] = r["tier_bytes"] / f32["tier_bytes"]
                e["val_final_diff"] = r["val_final"] - f32["val_final"]
            if r["tier"] == "nvme":
                host = by.get((seed, r["tier_dtype"]))
                e["losses_bitwise_host"] = (None if host is None else
                                            host["losses_sha256"] == r["losses_sha256"])
            out["runs"][r["optimizer"]] = e
        for name, e in out["runs"].items():  # against float32 on the same tier
            ref = out["runs"].get("float32" if e["tier"] == "host" else "float32-nvme")
            if ref and e.get("steps_to_target") and ref.get("steps_to_target"):
                e["steps_over_float32"] = e["steps_to_target"] / ref["steps_to_target"]
            if ref and e.get("val_at_adamw_time") is not None:
                e["val_at_adamw_time_diff"] = e["val_at_adamw_time"] - ref["val_at_adamw_time"]
        per_seed[str(seed)] = out
    data["per_seed"] = per_seed
    data["noise"] = noise(per_seed)
    data["targets"] = targets(per_seed)
    return data


def noise(per_seed: dict) -> dict[str, Optional[float]]:
    """float32's (host) seed-to-seed spread of each figure the targets read."""
    f32 = [s["runs"].get("float32", {}) for s in per_seed.values()]
    out: dict[str, Optional[float]] = {}
    for k in ("steps_to_target", "val_at_adamw_time", "val_final"):
        vs = [e.get(k) for e in f32 if e.get(k) is not None]
        out[k] = max(vs) - min(vs) if len(vs) >= 2 else None
    return out


def _check(value: Optional[float], limit: float) -> dict[str, Any]:
    return {"value": value, "limit": limit, "met": value is not None and value <= limit,
            "by": None if value is None else value - limit}


def targets(per_seed: dict) -> dict[str, Any]:
    """Each quantized dtype's targets per seed: {criterion: {value, limit, met, by}} and
    "met" (all of them, on every seed)."""
    out: dict[str, Any] = {}
    for dtype, t in TARGETS.items():
        seeds: dict[str, Any] = {}
        for seed, s in per_seed.items():
            host = s["runs"].get(dtype)
            if host is None:
                continue
            steps = host.get("steps_over_float32")
            c = {"steps_over_float32": _check(steps, 1 + t["steps"]),
                 "val_at_adamw_time_diff": _check(host.get("val_at_adamw_time_diff"), t["val"]),
                 "val_final_diff": _check(host.get("val_final_diff"), t["val"]),
                 "host_bytes_over_float32": _check(host.get("tier_bytes_over_float32"),
                                                   t["bytes"])}
            nvme = s["runs"].get(f"{dtype}-nvme")
            if nvme is not None:
                c["nvme_bytes_over_float32"] = _check(nvme.get("tier_bytes_over_float32"),
                                                      t["bytes"])
            seeds[seed] = {"criteria": c, "met": all(v["met"] for v in c.values())}
        out[dtype] = {"limits": t, "per_seed": seeds,
                      "met": bool(seeds) and all(v["met"] for v in seeds.values())}
    return out


def merge(dirs: list, meta: dict) -> dict:
    """The JSONs of bench_tier_dtype invocations in ``dirs`` as one (their runs together, the
    first host part's settings, every part's command and machine), analysed again."""
    parts = []
    for d in dirs:
        for fn in ("bench_tier_dtype.json", "bench_tier_dtype_nvme.json"):
            path = os.path.join(d, fn)
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    parts.append(json.load(f))
    if not parts:
        raise SystemExit(f"--merge: no bench_tier_dtype JSON in {', '.join(dirs)}")
    parts.sort(key=lambda p: "host" not in p["settings"]["tiers"])
    first = parts[0]
    settings = dict(first["settings"])
    settings["seeds"] = sorted({r["seed"] for p in parts for r in p["results"]})
    settings["tiers"] = [t for t in ("host", "nvme")
                         if any(t in p["settings"]["tiers"] for p in parts)]
    results = sorted((r for p in parts for r in p["results"]),
                     key=lambda r: (r["tier"] == "nvme", r["seed"]))
    machine = dict(first["machine"], loadavg1=min(p["machine"]["loadavg1"] for p in parts),
                   loadavg1_end=max(p["machine"].get("loadavg1_end") or 0 for p in parts))
    data = {**meta, "machine": machine, "complete": all(p["complete"] for p in parts),
            "settings": settings, "model": first["model"], "results": results,
            "parts": [{k: p[k] for k in ("date", "command", "complete", "cpu")
                       if k in p} | {"machine": p["machine"], "tiers": p["settings"]["tiers"],
                                     "seeds": p["settings"]["seeds"]} for p in parts]}
    return analyse(data)


def _mib(b: float) -> str:
    return f"{b / 2 ** 20:.2f}"


def print_table(data: dict) -> None:
    hdr = (f"{'run':<22}{'final':>8}{'steps':>7}{'x f32':>7}{'val@A':>8}{'val end':>9}"
           f"{'tier MiB':>10}{'x f32':>7}{'NVMe rd/step':>14}{'orth':>9}{'rect':>9}"
           f"{'bitwise':>8}{'load':>6}")
    common.print_header(hdr)
    for r in data["results"]:
        e = data["per_seed"][str(r["seed"])]["runs"].get(r["optimizer"], {})
        o = r.get("orthogonality") or {}

        def f(v, fmt):
            return format(v, fmt) if v is not None else "-"
        print(f"{r['label']:<22}{r['smoothed'][-1]:>8.4f}{f(e.get('steps_to_target'), 'd'):>7}"
              f"{f(e.get('steps_over_float32'), '.3f'):>7}"
              f"{f(e.get('val_at_adamw_time'), '.4f'):>8}{r['val_final']:>9.4f}"
              f"{f(e.get('tier_bytes') and e['tier_bytes'] / 2 ** 20, '.3f'):>10}"
              f"{f(e.get('tier_bytes_over_float32'), '.4f'):>7}"
              f"{f(e.get('nvme_read_per_step'), '.0f'):>14}{f(o.get('widened_max'), '.2e'):>9}"
              f"{f(o.get('rectified_max'), '.2e'):>9}"
              f"{str(e.get('losses_bitwise_host', '-')):>8}{r['loadavg1_end'] or 0:>6.1f}")
    for s, d in data["per_seed"].items():
        if "target" in d:
            print(f"seed {s}: AdamW's final loss {d['target']:.4f} (held-out at its end "
                  f"{d['adamw_val_at_own_time']:.4f})")
    n = data["noise"]
    print("float32 seed-to-seed spread: " + ", ".join(f"{k} {v:.4g}" for k, v in n.items()
                                                      if v is not None))
    for dtype, t in data["targets"].items():
        for seed, s in t["per_seed"].items():
            print(f"{dtype} seed {seed}: " + "; ".join(
                f"{k} {v['value']:.4f} <= {v['limit']:g} {'met' if v['met'] else 'MISSED'}"
                if v["value"] is not None else f"{k} - (not reached)"
                for k, v in s["criteria"].items()))
        print(f"{dtype}: targets met on every seed: {t['met']}")


def _clip_top(ax, top: float = 3.0) -> None:
    """Cut the first steps' high losses off an axis whose curves go below ``top``."""
    lo, hi = ax.get_ylim()
    if lo < top < hi:
        ax.set_ylim(top=top)


def plot(data: dict, path: str) -> None:
    plt = common.pyplot()
    rs = data["results"]
    fig, axes = plt.subplots(1, 4, figsize=(22, 4.8))
    a, b, c, d = axes
    seeds = data["settings"]["seeds"]
    styles = {s: ls for s, ls in zip(seeds, ("-", "--", ":", "-."))}
    host = [r for r in rs if r["tier"] in ("host", None)]
    for r in host:
        sm = r["smoothed"]
        a.plot(range(1, len(sm) + 1), sm, styles.get(r["seed"], "-"), lw=0.9,
               color=COLORS[r["tier_dtype"]], label=r["label"])
    for s, ps in data["per_seed"].items():
        if "target" in ps:
            a.axhline(ps["target"], color="k", lw=0.5, ls=styles.get(int(s), "-"))
    w = data["settings"]["window"]
    a.set(xlabel="step", ylabel=f"train loss (trailing mean of {w})",
          title="Training loss (host tier), AdamW's final loss as lines")
    _clip_top(a)
    by = _by(rs)
    for r in host:
        f32 = by.get((r["seed"], "float32"))
        if r["tier_dtype"] in (None, "float32") or f32 is None:
            continue
        dl = [x - y for x, y in zip(r["smoothed"], f32["smoothed"])]
        b.plot(range(1, len(dl) + 1), dl, styles.get(r["seed"], "-"), lw=0.8,
               color=COLORS[r["tier_dtype"]], label=f"{r['label']} - float32")
    f32s = [by[(s, "float32")] for s in seeds if (s, "float32") in by]
    if len(f32s) >= 2:
        dl = [x - y for x, y in zip(f32s[1]["smoothed"], f32s[0]["smoothed"])]
        b.plot(range(1, len(dl) + 1), dl, color="tab:gray", lw=0.6, alpha=0.7,
               label="float32: seed 1 - seed 0 (noise)")
    b.axhline(0, color="k", lw=0.8)
    b.set(xlabel="step", ylabel="difference of trailing-mean losses",
          title="Each tier dtype against float32")
    for r in host:
        v = r["val"]
        c.plot(v["time_s"], v["loss"], styles.get(r["seed"], "-"), marker=".", ms=3, lw=0.8,
               color=COLORS[r["tier_dtype"]], label=r["label"])
    for s, ps in data["per_seed"].items():
        if "adamw_wall_s" in ps:
            c.axvline(ps["adamw_wall_s"], color="k", lw=0.5, ls=styles.get(int(s), "-"))
    c.set(xlabel="the run's own time (s, in lockstep)", ylabel="held-out loss",
          title="Held-out loss; AdamW's time as lines")
    _clip_top(c)
    first = [r for r in rs if r["seed"] == seeds[0] and r["tier_dtype"]]
    labels = [f"{r['tier_dtype']}\n{r['tier']}" for r in first]
    bottom = [0.0] * len(first)
    for t, col in zip(("host", "nvme"), ("tab:blue", "tab:purple")):
        vals = [r["memory"]["tiers"][t] / 2 ** 20 for r in first]
        d.bar(labels, vals, bottom=bottom, color=col, label=f"{t} tier")
        bottom = [x + y for x, y in zip(bottom, vals)]
    for i, r in enumerate(first):
        e = data["per_seed"][str(r["seed"])]["runs"][r["optimizer"]]
        if e.get("tier_bytes_over_float32") is not None:
            d.text(i, bottom[i], f"{e['tier_bytes_over_float32']:.3f}x", ha="center",
                   va="bottom", fontsize=7)
    d.set(ylabel="MiB after the last step", title=f"Eigenbases' tier bytes, seed {seeds[0]}")
    d.set_ylim(0, 1.2 * max(bottom + [1e-9]))
    d.tick_params(axis="x", labelsize=7)
    m, st = data["model"], data["settings"]
    common.save_figure(fig, axes, path,
                       f"Asteria SOAP (f={st['frequency']}, S={st['staleness']}, lr "
                       f"{st['lr']:g}) eigenbases per tier dtype vs AdamW (lr {st['adamw_lr']:g})"
                       f": {m['params'] / 1e6:.2f}M-param TinyGPT, {m['tokens_per_step']} "
                       f"tokens/step, {st['steps']} steps", data["machine"])
