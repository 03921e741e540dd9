"""``python3 -m asteria.plan``: ``-f auto`` never chooses a setting it reports as not hidden
(over the presets, per-core rates, GPU counts and layouts); refresh_policy "drift"'s budget, d,
refreshes and ages against their derivation; the device lane's rate (the published prior, the
GPU microbenchmark's JSON: valid, missing, foreign); the tier dtypes' bytes against libasteria's
quant_layout; bad arguments name the option.

No timing: the cost models are given (GFLOP/s per core), so rounds are FLOPs / rate.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from collections import Counter

import pytest

from asteria import plan
from asteria.config import TIER_RECTIFY_STEPS
from asteria.refresh import cost as C
from asteria.refresh.engine import Lane
from models import require_c_extension

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


def given(gflops: float = 10.0) -> C.CostModel:
    return C.CostModel({"host": gflops}, "given")


def run(capsys, *argv) -> str:
    assert plan.main(list(argv)) == 0
    return capsys.readouterr().out


def fails(capsys, *argv) -> str:
    with pytest.raises(SystemExit):
        plan.main(list(argv))
    return capsys.readouterr().err


# ---- -f auto: hidden, or none --------------------------------------------------------------------

@pytest.fixture(scope="module")
def presets():
    pytest.importorskip("olmo_core")
    return {name: plan.preset(name) for name in plan.PRESETS}


def test_f_auto_never_reports_a_choice_not_hidden(presets):
    layouts = [(1, 1, "fsdp"), (1, 8, "fsdp"), (2, 4, "hsdp")]
    seen = Counter()
    for name, m in presets.items():
        sizes = plan.factors(m["shapes"], 2048, 2048)
        for nodes, gpus, parallel in layouts:
            rep = None if nodes * gpus == 1 else plan.replica_round(
                m["shapes"], "soap", nodes, gpus, parallel, 14, given())
            for rate, tokens, s, device in itertools.product(
                    (5.0, 20.0, 60.0), (65536, 524288), ("auto", 0, 5), (0, 1)):
                model = given(rate)
                if device:
                    model.base_gflops[Lane.DEVICE] = 2000.0
                step_s = m["flops_per_token"] * tokens / (0.4 * plan.H200_BF16_TFLOPS * 1e12)
                r = plan.row(model, name, sizes, "soap", 14, step_s, s, "auto", device, tokens,
                             fb_share=1.0, pcie_gbps=50.0,
                             owned=None if rep is None else rep["owner_factors"],
                             replicated=rep is not None and rep["replica_set_size"] > 1)
                if rep is not None:
                    r["replicas"] = rep
                line = plan.auto_line(r, type("A", (), {"parallel": parallel})())
                where = (name, nodes, gpus, rate, tokens, s, device)
                if r["auto_refused"]:
                    assert parallel == "hsdp" and "refuses" in line, where
                    seen["refused"] += 1
                elif r["auto_hidden"]:
                    # chosen: hidden on the round that runs (the slowest rank's)
                    assert r["fits"] and r["choice_round_s"] <= r["window_s"] + 1e-9, where
                    assert "-f auto chooses" in line and "hidden" in line, where
                    assert r["staleness"] <= r["frequency"], where
                    seen["chosen"] += 1
                else:
                    # only an S given can be too small, and then nothing is chosen
                    assert s != "auto" and not r["fits"], where
                    assert "no f hides a round at S=" in line, where
                    assert "-f auto chooses" not in line, where
                    assert r["choice_round_s"] > r["window_s"], where
                    seen["none"] += 1
                # S auto always hides
                assert s != "auto" or r["auto_hidden"] or r["auto_refused"], where
                # the policy's own choice is hidden by construction (d raised where needed)
                assert r["policy"]["hidden"], where
    assert seen["chosen"] and seen["none"] and seen["refused"]


def test_the_issue_command_prints_a_hidden_choice_and_the_policy(capsys, presets):
    for rate in (8, 14, 28, 50):
        out = run(capsys, "--preset", "olmo2-1b", "--tokens", "65536", "--gpus-per-node", "8",
                  "--parallel", "fsdp", "-f", "auto", "--gflops-per-core", str(rate))
        line = next(x for x in out.splitlines() if "-f auto" in x and "64k tokens" in x)
        assert "-f auto chooses f=" in line and ": hidden (" in line, line
        assert "slowest rank's" in line and "not hidden" not in out
        head = next(x for x in out.splitlines() if x.startswith("model") and "mean age" in x)
        for col in ("R", "budget", "d", "refreshes/factor/100 steps", "mean age", "max age",
                    "hidden"):
            assert col in head.split("  ") or col in head
        policy = out.splitlines()[out.splitlines().index(head) + 1].split()
        assert policy[0] == "olmo2-1b" and policy[2] == "8" and policy[-1] == "yes"


def test_f_auto_with_an_s_too_small_chooses_nothing(capsys):
    # 512 x 2048 in blocks of 512: 8 factors of 512 on 2 cores at 10 GFLOP/s, 4 x 63 ms =
    # 0.25 s a round; steps of 10 ms: S = 26 hides it, -S auto's 1.5x margin takes 38
    n512 = C.flops("soap_qr", 512) / 10e9
    hide, margin = math.ceil(4 * n512 / 0.01), math.ceil(1.5 * 4 * n512 / 0.01)
    assert (hide, margin) == (26, 38)
    base = ["--shape", "512x2048", "--block-size", "512", "--gflops-per-core", "10", "--cores",
            "2", "--step-time", "0.01", "--pcie-gbps", "0", "-f", "auto"]
    out = run(capsys, *base, "-S", "5")
    line = out.splitlines()[1]
    assert line.split()[-2:] == ["none", "5"] and " no " in line  # hidden at S: no
    assert f"no f hides a round at S=5" in out
    assert f"the smallest S that hides it is {hide} (-S auto: f = S = {margin})" in out
    assert "-f auto chooses" not in out
    # -S left out with -f auto: S is chosen with f, and hides
    out = run(capsys, *base)
    assert f"-f auto chooses f={margin}, S={margin}: hidden" in out


# ---- refresh_policy "drift": the derivation ------------------------------------------------------

@pytest.mark.parametrize("count,budget,delay", [
    (8, 1 / 4, 0), (8, 1 / 4, 1), (12, 1 / 4, 3), (24, 1 / 6, 5),   # budget x count integer
    (10, 1 / 4, 1), (10, 0.3, 0), (7, 1 / 3, 1), (3, 1 / 8, 1),     # not: floor, and >= 1
    (5, 1.0, 0)])
def test_steady_state_of_equal_factors_is_the_derivation(count, budget, delay):
    sim = plan.drift_steady_state(Counter({64: count}), budget, delay, 1.0, 1.0, given(),
                                  "soap", {Lane.HOST: 4})
    want = plan.expected_ages(count, budget, delay)
    assert sim["refreshes_per_100"] == pytest.approx(want["refreshes_per_100"])
    assert sim["mean_age"] == pytest.approx(want["mean_age"])
    assert sim["max_age"] == want["max_age"]
    assert sim["wait_s"] == 0.0
    k = round(1 / budget)
    if k * budget == 1 and count % k == 0:  # 1/b steps a factor: 100 b, d + (1/b - 1)/2
        assert want["refreshes_per_100"] == pytest.approx(100 * budget)
        assert want["mean_age"] == pytest.approx(delay + (1 / budget - 1) / 2)
        assert want["max_age"] == delay + round(1 / budget) - 1


def test_expected_ages_by_hand():
    # 10 factors at budget 1/4: 2 a step (floor 2.5), each every 5 steps: ages d..d+4
    assert plan.expected_ages(10, 0.25, 1) == {"refreshes_per_100": 20.0, "mean_age": 3.0,
                                               "max_age": 5}
    # 7 factors, 2 a step: intervals of 3 and 4 steps (p = 3.5, half of each)
    e = plan.expected_ages(7, 1 / 3, 0)
    assert e["mean_age"] == pytest.approx(((3 * 2 / 2) + (4 * 3 / 2)) / 7)
    assert e["max_age"] == 3
    # fewer factors than a step's budget: at least one a step
    assert plan.expected_ages(3, 1 / 8, 1)["refreshes_per_100"] == pytest.approx(100 / 3)


def test_unequal_factors_refresh_about_every_1_over_b_steps():
    # 7B's mix: 2048 and 768 factors; the budget is FLOPs, so the big ones take more of it
    sizes = Counter({2048: 49, 768: 3})
    for budget, delay in ((1 / 8, 1), (1 / 13, 2), (1 / 5, 0)):
        sim = plan.drift_steady_state(sizes, budget, delay, 1e6, 1e6, given(1e4), "soap",
                                      {Lane.HOST: 14})
        assert 100 * budget * 0.8 <= sim["refreshes_per_100"] <= 100 * budget * 1.05
        ideal = delay + (1 / budget - 1) / 2
        assert ideal - 0.5 <= sim["mean_age"] <= ideal + 2.5
        assert sim["max_age"] <= delay + math.ceil(1 / budget) + 2


def test_the_runtimes_budget_rule_by_hand():
    # the planner's (budget, d) are the runtime's: cost.choose_refresh_budget, with both free
    # a round within the forward and backward (1.5x): all of it every step, d = 0
    assert C.choose_refresh_budget(0.5, 1.0, 0.9, 0.1) == (1.0, 0)
    # R = 11.3: budget 1/17 (1.5 R = 16.9); a step's work 1.14 s, the largest factor 1.4 s:
    # 1.5 x 1.4 = 2.1 s needs 2 steps of 1.71 s
    b, d = C.choose_refresh_budget(19.3, 1.71, 1.71, 1.4)
    assert b == pytest.approx(1 / 17) and d == 2
    # the largest factor alone longer than a step: d covers it
    assert C.choose_refresh_budget(100.0, 1.0, None, 2.5) == (pytest.approx(1 / 150), 4)
    # a step's work within the forward and backward: d = 0
    assert C.choose_refresh_budget(30.0, 8.0, 8.0, 1.4) == (pytest.approx(1 / 6), 0)
    with pytest.raises(ValueError, match="step_s=0: allowed: seconds > 0"):
        C.choose_refresh_budget(1.0, 0, None, 0.1)


def test_d_is_raised_where_whole_factors_need_more_than_the_rule():
    # 75 factors of 0.55 s on 14 cores, steps of 1 s: the rule's budget 1/5 starts 15 a step,
    # 0.66 s of work by the round (x1.5 < 1 step: d = 1), but 15 whole factors on 14 cores
    # take two waves, 1.1 s: d = 2 hides it
    n = 64
    model = given(C.flops("soap_qr", n) / 0.55 / 1e9)
    sizes = Counter({n: 75})
    round_s = C.split_makespan(model, plan.round_jobs(sizes, "soap"), {Lane.HOST: 14})
    assert round_s == pytest.approx(6 * 0.55)
    p = plan.drift_plan(sizes, round_s, 1.0, None, model, "soap", {Lane.HOST: 14})
    assert p["budget"] == pytest.approx(1 / 5) and p["rule_delay"] == 1
    assert p["delay"] == 2 and p["hidden"]
    assert p["latency_s"] == pytest.approx(1.1)
    rule = plan.drift_steady_state(sizes, 1 / 5, 1, 1.0, None, model, "soap", {Lane.HOST: 14})
    assert rule["wait_s"] == pytest.approx(0.1)


# ---- the device lane's rate ----------------------------------------------------------------------

def test_the_device_prior_is_the_published_figure():
    m = C.CostModel()
    job = C.JobSpec("soap_qr", "float32", 2048, 1)
    assert m.entry_seconds(Lane.DEVICE, job) == pytest.approx(C.DEVICE_PRIOR_S)
    assert C.DEVICE_PRIOR_S == 0.010 and C.DEVICE_PRIOR_N == 2048
    assert "published H100 figure" in m.rate(Lane.DEVICE, "eigh", "float32", 1e9)[1]


def microbench(tmp_path, results, schema=C.GPU_MICROBENCH_SCHEMA, state="passed"):
    path = tmp_path / "gpu_microbench.json"
    path.write_text(json.dumps({"schema": schema, "state": state, "device_name": "GPU X",
                                "results": results}))
    return str(path)


def row_(op, n, batch, ms, precision="highest"):
    return {"op": op, "n": n, "batch": batch, "precision": precision, "ms": ms, "ms_min": ms,
            "reps": 3}


def test_gpu_json_prices_the_device_lane(tmp_path):
    path = microbench(tmp_path, [
        row_("qr_power_step", 2048, 1, 9.0), row_("qr_power_step", 2048, 16, 64.0),
        row_("qr_power_step", 2048, 16, 8.0, "tf32"), row_("linalg_eigh", 1024, 4, 36.0),
        row_("score_gemm", 2048, 1, 1.0), row_("qr", 2048, 1, 2.0)])
    m = C.CostModel()
    added = C.add_gpu_microbench(m, C.read_gpu_microbench(path))
    # the largest batch at "highest": 64 ms / 16 = 4 ms a factor; tf32 and other ops left out
    assert added == [("linalg_eigh", 1024, 4, pytest.approx(9e-3)),
                     ("qr_power_step", 2048, 16, pytest.approx(4e-3))]
    for op in ("soap_qr", "kl_qr"):
        assert m.entry_seconds(Lane.DEVICE, C.JobSpec(op, "float32", 2048, 1)) == \
            pytest.approx(4e-3)
    # an inverse root at eigh's FLOP rate: 11/9 of the eigh's 9 ms
    assert m.entry_seconds(Lane.DEVICE, C.JobSpec("inv_root", "float32", 1024, 1, p=4.0)) == \
        pytest.approx(9e-3 * 11 / 9)
    assert m.rate(Lane.DEVICE, "soap_qr", "float32", 1e9)[1] == "measured"


def test_gpu_json_on_the_cli_default_and_none(capsys, tmp_path, monkeypatch):
    res = os.path.join(tmp_path, "benchmarks", "results")
    os.makedirs(res)
    with open(os.path.join(res, "gpu_microbench.json"), "w") as fh:
        json.dump({"schema": C.GPU_MICROBENCH_SCHEMA, "state": "timed out",
                   "device_name": "GPU X", "results": [row_("qr_power_step", 2048, 1, 5.0)]}, fh)
    monkeypatch.chdir(tmp_path)
    base = ["--shape", "2048x2048", "--step-time", "1", "--gflops-per-core", "10"]
    out = run(capsys, *base)
    assert ("device executor's rate: measured on GPU X (benchmarks/results/gpu_microbench.json, "
            "state 'timed out'") in out
    assert "qr_power_step n=2048 5.0 ms (batch 1)" in out
    assert "on the device executor the round takes 0.0 s" in out  # 2 factors x 5 ms
    out = run(capsys, *base, "--gpu-json", "none")
    assert "device prior: a published H100 figure" in out
    assert "on the device executor the round takes 0.0 s" in out
    out = run(capsys, *base, "--device-gflops", "100")
    assert "given: 100 GFLOP/s (--device-gflops)" in out


def test_gpu_json_of_the_microbenchmark_itself(tmp_path, capsys):
    out = tmp_path / "m.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_microbench.py"),
                        "--device", "cpu", "--sizes", "16,32", "--batches", "1,2", "--ops",
                        "qr_power_step,linalg_eigh", "--precisions", "highest", "--max-reps", "1",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = run(capsys, "--shape", "32x32", "--step-time", "1", "--gflops-per-core", "10",
              "--gpu-json", str(out))
    assert f"({out}, float32 at precision 'highest'" in got
    assert "qr_power_step n=32" in got and "eigh n=16" in got


@pytest.mark.parametrize("content,msg", [
    ({"schema": "other/1", "results": []},
     "schema 'other/1'; allowed: 'asteria.gpu_microbench/1'"),
    ([1, 2], "schema None; allowed: 'asteria.gpu_microbench/1'"),
    ({"schema": C.GPU_MICROBENCH_SCHEMA}, "'results' is NoneType; allowed: a list"),
    ({"schema": C.GPU_MICROBENCH_SCHEMA, "results": [{"op": "linalg_eigh", "n": 0, "batch": 1,
                                                      "precision": "highest", "ms": 1.0}]},
     "results[0] = "),
    ({"schema": C.GPU_MICROBENCH_SCHEMA, "results": [row_("linalg_eigh", 64, 1, 1.0, "tf32")]},
     "no result of qr_power_step, linalg_eigh at precision 'highest'"),
])
def test_gpu_json_refused_with_a_clear_message(capsys, tmp_path, content, msg):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    err = fails(capsys, "--shape", "64x64", "--step-time", "1", "--gflops-per-core", "10",
                "--gpu-json", str(path))
    assert "argument --gpu-json: GPU microbenchmark JSON" in err and msg in err, err
    path.write_text("{not json")
    err = fails(capsys, "--shape", "64x64", "--step-time", "1", "--gflops-per-core", "10",
                "--gpu-json", str(path))
    assert "not JSON" in err


def test_gpu_json_missing_and_bad_precision(capsys, tmp_path):
    err = fails(capsys, "--shape", "64x64", "--step-time", "1", "--gpu-json",
                str(tmp_path / "absent.json"))
    assert "argument --gpu-json:" in err and "no such file" in err
    with pytest.raises(ValueError, match="cannot read it"):
        C.read_gpu_microbench(str(tmp_path / "absent.json"))
    with pytest.raises(ValueError, match="precision='fp8': allowed: highest, tf32"):
        C.add_gpu_microbench(C.CostModel(), {"results": []}, "fp8")


# ---- the tiers' bytes ----------------------------------------------------------------------------

def test_tier_bytes_are_libasterias_layout():
    from asteria import _C
    from asteria.config import TIER_QUANT_MIN_DIM

    for n in (7, 63, 64, 768, 2048):
        for qt, bits, block in (("int8", 8, 64), ("int4", 4, 64)):
            lay = _C.quant_layout(qt, n * n, block)
            # the runtime keeps a basis narrower than TIER_QUANT_MIN_DIM in its dtype
            want = lay["nbytes"] if n >= TIER_QUANT_MIN_DIM else 4 * n * n
            assert plan.stored_bytes(n, qt) == want
            # n^2 bits / 8 rounded up and padded to 4 bytes, then a float32 scale per block
            codes = -(-n * n * bits // 8)
            assert lay["nbytes"] == -(-codes // 4) * 4 + -(-n * n // block) * 4
        assert plan.stored_bytes(n, "float32") == 4 * n * n
        assert plan.stored_bytes(n, "bfloat16") == 2 * n * n
    # scales included: int8 (8 + 32 / 64) / 32 = 0.2656, int4 (4 + 32 / 64) / 32 = 0.1406
    assert plan.stored_bytes(2048, "int8") == 2048 * 2048 + 2048 * 2048 // 64 * 4
    assert plan.stored_bytes(2048, "int4") == 2048 * 2048 // 2 + 2048 * 2048 // 64 * 4
    assert plan.stored_bytes(2048, "int8") / (4 * 2048 ** 2) == 0.265625
    assert plan.stored_bytes(2048, "int4") / (4 * 2048 ** 2) == 0.140625
    with pytest.raises(ValueError, match="tiers store eigenbases only"):
        plan.stored_bytes(64, "int8", "roots")
    with pytest.raises(ValueError, match="tier_dtype='fp8': allowed: float32, bfloat16, int8"):
        plan.stored_bytes(64, "fp8")


def test_tier_bytes_per_gpu_and_installs():
    held = Counter({2048: 3, 768: 2})
    b = plan.tier_bytes(held, "soap", "int8")
    base = 3 * plan.stored_bytes(2048, "int8") + 2 * plan.stored_bytes(768, "int8")
    # every step widens each basis: TIER_RECTIFY_STEPS Bjorck steps of two n^3 products
    widen = TIER_RECTIFY_STEPS["int8"] * 4 * (3 * 2048 ** 3 + 2 * 768 ** 3)
    assert b == {"host": base, "step_h2d": base, "bases": 5, "widen_flops": widen,
                 "install_h2d": base + (3 * 2048 + 2 * 768) * 8}   # SOAP's sort order, int64
    assert plan.tier_bytes(held, "soap", "bfloat16")["widen_flops"] == 0
    assert plan.tier_bytes(Counter({63: 4}), "soap", "int4")["widen_flops"] == 0  # as it is
    assert plan.tier_bytes(held, "shampoo", "int4") is None        # roots: refused
    assert plan.tier_bytes(held, "shampoo", "bfloat16")["host"] == 2 * (3 * 2048 ** 2
                                                                        + 2 * 768 ** 2)
    # the installs' copies in the round shrink with the tier; the snapshots stay float32
    f32, i4 = (plan.transfer_bytes(held, "soap", t) for t in ("float32", "int4"))
    assert f32[0] == i4[0] and i4[1] < f32[1] / 6


def test_tier_table_on_the_cli(capsys):
    # 5 weights of 2048 x 8192: 4 blocks each, 8 factors of 2048 a weight
    shapes = ["--shape", "2048x8192"] * 5
    out = run(capsys, *shapes, "--step-time", "1", "--gflops-per-core", "10",
              "--tier-dtype", "int4")
    lines = out.splitlines()
    head = next(i for i, x in enumerate(lines) if x.startswith("model") and "tier_dtype" in x)
    rows = [x.split() for x in lines[head + 1:head + 5]]
    assert [r[3] for r in rows] == list(plan.TIER_DTYPES)
    for r in rows:
        host = 40 * plan.stored_bytes(2048, r[3])
        assert r[2] == "40" and r[4] == f"{host / 1e9:.2f}"
        assert r[5] == f"{(host + 40 * 2048 * 8) / 1e9:.2f}"   # with SOAP's sort order
        assert r[6] == f"{host / 50e9:.3f}"                    # the ring, every step
        flops = 40 * TIER_RECTIFY_STEPS.get(r[3], 0) * 4 * 2048 ** 3
        assert r[7] == f"{flops / 1e12:.1f}" and r[8] == f"{flops / 67e12:.3f}"
    assert "tier_dtype int4" in out and "widen s/step at 67 TFLOP/s" in out
    out = run(capsys, *shapes, "--step-time", "1", "--gflops-per-core", "10",
              "--fp32-tflops", "20")
    assert "widen s/step at 20 TFLOP/s" in out
    out = run(capsys, "--shape", "2048x2048", "--step-time", "1", "--gflops-per-core", "10",
              "--optimizer", "shampoo")
    assert "refused (roots)" in out


# ---- bad arguments name the option ---------------------------------------------------------------

@pytest.mark.parametrize("args,msg", [
    (["--tier-dtype", "fp8"], "argument --tier-dtype: invalid choice: 'fp8'"),
    (["--tier-dtype", "int8", "--optimizer", "shampoo"],
     "argument --tier-dtype: 'int8' with --optimizer shampoo (roots): only eigenbases are "
     "quantized; allowed: float32, bfloat16"),
    (["-S", "-1"], "argument -S/--staleness: '-1': allowed: an integer >= 0, or auto"),
    (["-f", "0"], "argument -f/--frequency: '0': allowed: an integer >= 1, or auto"),
    (["--fp32-tflops", "0"], "argument --fp32-tflops: '0': allowed: TFLOP/s > 0"),
    (["-S", "auto"], "-S auto needs -f auto"),
    (["--device-gflops", "10", "--gpu-json", "none"],
     "argument --gpu-json: not allowed with argument --device-gflops"),
])
def test_bad_arguments_name_the_option(capsys, args, msg):
    err = fails(capsys, "--shape", "64x64", "--step-time", "1", "--gflops-per-core", "10", *args)
    assert msg in err, err
