"""The planner's text: its tables (``fmt_table``, ``fmt_policy``, ``fmt_tiers``, each as
markdown or padded columns, ``render``) and the lines under them (``replicas_note``,
``auto_line``, ``policy_note``), from the rows of ``verdict.row``.

Owns: how the planner's answers read. May call: ``asteria.refresh.cost``
(``choose_staleness``: the S of the ``-S auto`` hint).
"""

from __future__ import annotations

from asteria.refresh import cost as C


def render(head: list, lines: list, markdown: bool) -> str:
    """A table: markdown, or columns padded to their widest cell."""
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(x) + " |" for x in lines]
        return "\n".join(out)
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(head)]
    out = ["  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip() for x in [head] + lines]
    return "\n".join(out)


def fmt_table(rows: list, cores: int, staleness, frequency, markdown: bool) -> str:
    auto = frequency == "auto"
    s_name = "S" if auto else f"S={staleness}"
    head = ["model", "tokens/GPU/step", "step s", "factors", "GFLOP/round",
            f"round s ({cores} cores)", f"window {s_name} (s)",
            "pool busy (f)" if auto else f"pool busy (f={frequency})", "smallest S",
            f"cores for {s_name}", f"hidden at {s_name}", "PCIe s", "REFRESH on"]
    if auto:
        head += ["f auto", "S"]
    reps = "replicas" in rows[0]
    if reps:
        head += ["ranks", "replica set", "round s/set", "speed-up", "smallest S/set"]
    lines = []
    for r in rows:
        s_min = r["run_smallest_s"]
        lines.append([r["model"], "-" if r["tokens"] is None else f"{r['tokens'] // 1024}k",
                      f"{r['step_s']:.2f}", str(r["factors"]), f"{r['gflop']:.0f}",
                      f"{r['round_s']:.1f}", f"{r['window_s']:.1f}",
                      f"{100 * r['utilisation']:.0f}%",
                      str(s_min) + ("" if s_min <= r["frequency"]
                                    else f" (> f={r['frequency']})"),
                      "> 256" if r["smallest_cores"] is None else str(r["smallest_cores"]),
                      "yes" if r["fits"] else "no", f"{r['transfer_s']:.2f}",
                      r["refresh_on"]])
        if auto:
            lines[-1] += (["refused", "-"] if r["auto_refused"] else
                          [str(r["frequency"]), str(r["staleness"])] if r["auto_hidden"] else
                          ["none", str(r["staleness"])])
        if reps:
            rep = r["replicas"]
            lines[-1] += [str(rep["ranks"]), str(rep["replica_set_size"]),
                          f"{r['run_round_s']:.2f}",
                          f"{r['round_s'] / r['run_round_s']:.2f}x" if r["run_round_s"] > 0
                          else "-", str(r["run_smallest_s"])]
    return render(head, lines, markdown)


def fmt_policy(rows: list, markdown: bool) -> str:
    """The table of refresh_policy "drift" (``drift_plan``), a line per row."""
    head = ["model", "tokens/GPU/step", "ranks", "step s", "factors/rank", "round s/rank",
            "R", "budget", "d", "refreshes/factor/100 steps", "mean age", "max age",
            "hidden"]
    lines = []
    for r in rows:
        p = r["policy"]
        k = round(1 / p["budget"])
        lines.append([r["model"], "-" if r["tokens"] is None else f"{r['tokens'] // 1024}k",
                      str(r.get("replicas", {}).get("ranks", 1)), f"{r['step_s']:.2f}",
                      str(p["factors"]), f"{p['round_s']:.1f}", f"{p['R']:.1f}",
                      "1" if k == 1 else f"1/{k}", str(p["delay"]) +
                      ("" if p["delay"] == p["rule_delay"] else f" (rule {p['rule_delay']})"),
                      f"{p['refreshes_per_100']:.1f}", f"{p['mean_age']:.1f}",
                      str(p["max_age"]),
                      "yes" if p["hidden"] else f"no ({p['wait_s']:.1f} s)"])
    return render(head, lines, markdown)


def fmt_tiers(tiers: list, pcie_gbps: float, fp32_tflops: float, markdown: bool) -> str:
    """The table of one GPU's bytes per tier dtype: [(model, ranks, tier_dtype, tier_bytes)];
    the staging ring's copies each step priced at ``pcie_gbps`` (0: left out), and the step's
    widening of quantized bases at ``fp32_tflops`` (float32 matmuls at that rate)."""
    head = ["model", "ranks", "bases/GPU", "tier_dtype", "host (or NVMe) GB/GPU",
            "PCIe GB/round of installs", f"ring s/step at {pcie_gbps:g} GB/s",
            "widen TFLOP/step", f"widen s/step at {fp32_tflops:g} TFLOP/s"]
    lines = []
    for name, ranks, dt, b in tiers:
        if b is None:
            lines.append([name, str(ranks), "-", dt, "refused (roots)"] + ["-"] * 4)
            continue
        lines.append([name, str(ranks), str(b["bases"]), dt, f"{b['host'] / 1e9:.2f}",
                      f"{b['install_h2d'] / 1e9:.2f}",
                      f"{b['step_h2d'] / (pcie_gbps * 1e9):.3f}" if pcie_gbps else "-",
                      f"{b['widen_flops'] / 1e12:.1f}",
                      f"{b['widen_flops'] / (fp32_tflops * 1e12):.3f}"])
    return render(head, lines, markdown)


def replicas_note(args, rows: list) -> str:
    r0 = rows[0]["replicas"]
    lines = [f"{args.parallel} on {args.nodes} node(s) x {args.gpus_per_node} GPU(s): "
             f"{len(r0['replica_sets'])} replica set(s) of {r0['replica_set_size']} rank(s); "
             "each replicated factor computed by one owner (the coherence registry's LPT, n^3 "
             f"per factor) on its {args.cores} cores; round s/set = the slowest owner's; the "
             "transfer of the results is not modelled"]
    for name, rep in {r["model"]: r["replicas"] for r in rows}.items():
        g = rep["owner_gflop"]
        lines.append(f"{name}: GFLOP per rank {min(g):.0f} to {max(g):.0f} (all ranks "
                     f"{rep['gflop']:.0f}, one rank alone {rep['single_rank_gflop']:.0f}); "
                     f"slowest rank {rep['slowest_rank']}")
    return "\n".join(lines)


def auto_line(r: dict, args) -> str:
    """What ``-f auto`` answers for one row: the f and S it chooses (hidden), or that the
    runtime refuses it, or that no f hides a round at the S given."""
    tok = "" if r["tokens"] is None else f" at {r['tokens'] // 1024}k tokens"
    who = (f"a round of the slowest rank's {r['run_factors']} factors"
           if r["run_rank"] is not None else f"a round of the {r['factors']} factors")
    rnd = f"{who} takes {r['choice_round_s']:.1f} s"
    s_auto = C.choose_staleness(r["choice_round_s"], r["step_s"], r["fb_s"])
    p = r["policy"]
    drift = (f"refresh_policy 'drift' (budget 1/{round(1 / p['budget'])}, d={p['delay']}, "
             f"the table below)")
    if r["auto_refused"]:
        rep = r["replicas"]
        return (f"{r['model']}{tok}: -f auto: the runtime refuses precondition_frequency "
                f"'auto' with replicated parameters ({args.parallel}: replica sets of "
                f"{rep['replica_set_size']} ranks; each rank would choose its own f); {rnd}, "
                f"the smallest S that hides it is {r['run_smallest_s']}: give integers, e.g. "
                f"-f {max(1, s_auto)} -S {s_auto} (the 1.5x margin of -S auto), or "
                f"refresh_policy 'drift' with refresh_budget {p['budget']:.4g} and "
                f"install_delay {p['delay']} (numbers: 'auto' is refused there too)\n")
    if r["auto_hidden"]:
        return (f"{r['model']}{tok}: -f auto chooses f={r['frequency']}, S={r['staleness']}: "
                f"hidden ({rnd}, the window {r['window_s']:.1f} s)\n")
    return (f"{r['model']}{tok}: -f auto: no f hides a round at S={r['staleness']} ({rnd}, "
            f"the window {r['window_s']:.1f} s); the smallest S that hides it is "
            f"{r['run_smallest_s']} (-S auto: f = S = {max(1, s_auto)}), or {drift}. "
            f"(Given S={r['staleness']}, the runtime's rule would take f={r['runtime_f']}, "
            f"and each install would wait about "
            f"{max(0.0, r['choice_round_s'] - r['window_s']):.1f} s once every "
            f"{r['runtime_f']} steps)\n")


def policy_note(rows: list, device: bool) -> str:
    """The legend of the policy table."""
    lanes = "the host workers and the device" if device else "the host workers"
    return ("refresh_policy 'drift' with refresh_budget and install_delay 'auto', f=1: R = a "
            "round of the rank's factors (round s/rank, on " + lanes + ", its PCIe copies "
            "included) over the step; budget = 1/ceil(1.5 R) of a round's FLOPs started a "
            "step (1, d=0 where 1.5x the round fits the forward and backward), d = the steps "
            "that cover 1.5x the larger of a step's work and the longest factor (the runtime's "
            "rule; \"rule\" where whole factors on the slots needed more); refreshes, mean and "
            "max age (steps, at step ends) from the steady state of the factors in "
            "round-robin order (equal drift scores, no skips), simulated step by step; hidden: "
            "every step's work done within its d steps")
