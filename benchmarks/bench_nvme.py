"""NVMe tier bandwidth: batched moves through asteria._C.Store against a plain O_DIRECT loop.

For each block size B, TOTAL bytes of state are split into TOTAL / B host blocks of a
_C.Store whose nvme_dir is a fresh temporary directory (on the project's filesystem by default).
One round: the store moves every block to "nvme" (one batched move: O_DIRECT io_uring writes,
a CRC-32C'd record per block; the first round creates each record file (tmp + rename), later
rounds rewrite it in place) and back to "host" (O_DIRECT reads straight into the block's framed
memory, checksum verified over it; the record file stays, stale, for the next write); then the baseline writes the same bytes in
the same block sizes, one file per block, from an mmap-aligned buffer with os.pwrite on
os.O_DIRECT file descriptors (queue depth 1, one Python call per block), fdatasyncs every file
at the end, and reads them back with os.preadv. Rounds interleave the two, so each ratio
compares measurements adjacent in time.

Page cache: with O_DIRECT both sides bypass the guest's page cache (the store reports
nvme_direct; if it had to fall back to buffered I/O its reads may come from the cache and the
JSON flags that). On a virtual machine the host may still cache the virtual disk: the numbers
are this machine's "disk", whatever the hypervisor puts behind it; the JSON names the block
device and whether the kernel calls it rotational.

Writes benchmarks/results/bench_nvme.json and bench_nvme.png (MB/s per block size).

    python3 benchmarks/bench_nvme.py                      # default: about a minute
    python3 benchmarks/bench_nvme.py --quick --out-dir /tmp/x
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

from asteria import _C  # noqa: E402

NAME = "bench_nvme"
ALIGN = 4096
MB = 1e6


def round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def parse_size(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def random_bytes(n: int, seed: int) -> bytes:
    """Incompressible bytes (every block of a size gets the same ones)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()


def block_device(path: str) -> dict[str, Any]:
    """The filesystem and block device under ``path`` (from /proc/mounts and /sys/block)."""
    out: dict[str, Any] = {"path": os.path.abspath(path)}
    best = ""
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if out["path"].startswith(mnt.rstrip("/") + "/") or out["path"] == mnt:
                    if len(mnt) >= len(best):
                        best = mnt
                        out.update({"device": dev, "mount": mnt, "fstype": fstype})
    except OSError:
        pass
    dev = os.path.basename(out.get("device", ""))
    base = dev.rstrip("0123456789") if not dev.startswith("nvme") else dev.split("p")[0]
    for key, rel in (("rotational", "queue/rotational"), ("model", "device/model"),
                     ("logical_block_size", "queue/logical_block_size"),
                     ("scheduler", "queue/scheduler")):
        try:
            with open(f"/sys/block/{base}/{rel}", encoding="utf-8") as f:
                out[key] = f.read().strip()
        except OSError:
            pass
    return out


# ---- the two sides --------------------------------------------------------------------------------

class StoreSide:
    """nblocks host blocks of one size in a Store, filled once with random bytes."""

    def __init__(self, store: "_C.Store", block: int, nblocks: int, seed: int):
        self.store = store
        self.ids = [store.alloc("host", block) for _ in range(nblocks)]
        data = random_bytes(block, seed)
        for b in self.ids:
            m = memoryview(store.buffer(b))
            m[:] = data
            m.release()

    def _move(self, tier: str) -> dict[str, float]:
        st0 = self.store.stats()
        t0 = time.perf_counter()
        moved = self.store.move(self.ids, tier)
        wall = time.perf_counter() - t0
        st1 = self.store.stats()
        if moved != len(self.ids):
            raise RuntimeError(f"store moved {moved} of {len(self.ids)} blocks to {tier}")
        nbytes, ns = (("nvme_bytes_written", "nvme_write_ns") if tier == "nvme"
                      else ("nvme_bytes_read", "nvme_read_ns"))
        return {"wall_s": wall, "device_bytes": st1[nbytes] - st0[nbytes],
                "engine_s": (st1[ns] - st0[ns]) * 1e-9}

    def write(self) -> dict[str, float]:
        return self._move("nvme")

    def read(self) -> dict[str, float]:
        return self._move("host")

    def free(self) -> None:
        for b in self.ids:
            self.store.free(b)


class DirectSide:
    """The baseline: one O_DIRECT file per block, written and read with os.pwrite / os.preadv
    from one page-aligned (mmap) buffer."""

    def __init__(self, dirpath: str, block: int, nblocks: int, seed: int):
        self.dir, self.block, self.nblocks = dirpath, block, nblocks
        self.length = round_up(block)
        self.buf = mmap.mmap(-1, self.length)  # anonymous mmap: page-aligned
        self.buf[:block] = random_bytes(block, seed)
        self.view = memoryview(self.buf)
        self.paths = [os.path.join(dirpath, f"direct-{i:06d}.bin") for i in range(nblocks)]

    def write(self) -> dict[str, float]:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC
        t0 = time.perf_counter()
        fds = []
        try:
            for p in self.paths:
                fd = os.open(p, flags, 0o600)
                fds.append(fd)
                done = 0
                while done < self.length:
                    done += os.pwrite(fd, self.view[done:], done)
            for fd in fds:
                os.fdatasync(fd)
        finally:
            for fd in fds:
                os.close(fd)
        return {"wall_s": time.perf_counter() - t0, "device_bytes": self.length * self.nblocks}

    def read(self) -> dict[str, float]:
        flags = os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC
        t0 = time.perf_counter()
        for p in self.paths:
            fd = os.open(p, flags)
            try:
                done = 0
                while done < self.length:
                    n = os.preadv(fd, [self.view[done:]], done)
                    if n <= 0:
                        raise OSError(f"{p}: short read at {done} of {self.length}")
                    done += n
            finally:
                os.close(fd)
        return {"wall_s": time.perf_counter() - t0, "device_bytes": self.length * self.nblocks}

    def remove(self) -> None:
        for p in self.paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.remove()
        self.view.release()
        self.buf.close()


# ---- measurement ---------------------------------------------------------------------------------

def measure_size(block: int, args, store, dirpath: str, log: common.Progress) -> dict[str, Any]:
    nblocks = max(1, args.total // block)
    payload = nblocks * block
    st = StoreSide(store, block, nblocks, args.seed)
    od = DirectSide(dirpath, block, nblocks, args.seed)
    rounds: list[dict[str, Any]] = []
    try:
        for r in range(args.rounds):
            c0 = common.cpu_snapshot()
            sw = st.write()
            sr = st.read()
            ow = od.write()
            orr = od.read()
            od.remove()
            cpu = common.cpu_delta(c0, common.cpu_snapshot())
            rounds.append({
                "store_write_MBps": payload / sw["wall_s"] / MB,
                "store_read_MBps": payload / sr["wall_s"] / MB,
                "direct_write_MBps": payload / ow["wall_s"] / MB,
                "direct_read_MBps": payload / orr["wall_s"] / MB,
                "store_engine_write_MBps": (payload / sw["engine_s"] / MB
                                            if sw["engine_s"] > 0 else None),
                "store_engine_read_MBps": (payload / sr["engine_s"] / MB
                                           if sr["engine_s"] > 0 else None),
                "store_device_bytes_written": sw["device_bytes"],
                "store_device_bytes_read": sr["device_bytes"],
                "direct_device_bytes": ow["device_bytes"],
                "wall_s": {"store_write": sw["wall_s"], "store_read": sr["wall_s"],
                           "direct_write": ow["wall_s"], "direct_read": orr["wall_s"]},
                "foreign_cores_avg": cpu.get("foreign_cores_avg"),
            })
    finally:
        od.close()
        st.free()

    def med(key: str) -> Optional[float]:
        vals = [x[key] for x in rounds if x[key] is not None]
        return statistics.median(vals) if vals else None

    def ratio(a: str, b: str) -> float:
        return statistics.median(x[a] / x[b] for x in rounds)

    out = {"block_bytes": block, "blocks": nblocks, "payload_bytes": payload,
           "rounds": rounds}
    for key in ("store_write_MBps", "store_read_MBps", "direct_write_MBps", "direct_read_MBps",
                "store_engine_write_MBps", "store_engine_read_MBps"):
        out[key] = med(key)
    out["ratio_write_store_direct"] = ratio("store_write_MBps", "direct_write_MBps")
    out["ratio_read_store_direct"] = ratio("store_read_MBps", "direct_read_MBps")
    for side in ("write", "read"):  # the spread of the per-round ratios (the disk is erratic)
        rs = [x[f"store_{side}_MBps"] / x[f"direct_{side}_MBps"] for x in rounds]
        out[f"ratio_{side}_min_max"] = [min(rs), max(rs)]
    log(f"block {block >> 10:>6} KiB x {nblocks:<5} write MB/s store {out['store_write_MBps']:8.1f} "
        f"direct {out['direct_write_MBps']:8.1f} (x{out['ratio_write_store_direct']:.2f})  "
        f"read MB/s store {out['store_read_MBps']:8.1f} direct {out['direct_read_MBps']:8.1f} "
        f"(x{out['ratio_read_store_direct']:.2f})")
    return out


def open_store(dirpath: str, queue_depth: int) -> tuple[Any, str]:
    """A Store on ``dirpath`` with O_DIRECT required; where the filesystem refuses it, the
    buffered fallback (and the caller records that its reads may hit the page cache)."""
    try:
        return _C.Store(nvme_dir=dirpath, direct="require", queue_depth=queue_depth), "require"
    except (_C.AsteriaError, OSError):
        return _C.Store(nvme_dir=dirpath, direct="fallback", queue_depth=queue_depth), "fallback"


def run(args, argv) -> dict[str, Any]:
    log, meta = common.start_run(NAME, __file__, argv)
    os.makedirs(args.dir_parent, exist_ok=True)
    dirpath = tempfile.mkdtemp(prefix="asteria-nvme-bench-", dir=args.dir_parent)
    dev = block_device(dirpath)
    log(f"nvme_dir {dirpath} ({dev.get('fstype')} on {dev.get('device')}); block sizes "
        f"{[b >> 10 for b in args.block_sizes]} KiB; {args.total / 2**20:.0f} MiB per size; "
        f"{args.rounds} rounds; load {common.loadavg()}")
    results = []
    try:
        store, policy = open_store(dirpath, args.queue_depth)
        try:
            for b in args.block_sizes:
                results.append(measure_size(b, args, store, dirpath, log))
            sstats = store.stats()
        finally:
            store.close()
    finally:
        shutil.rmtree(dirpath, ignore_errors=True)
    direct = sstats["nvme_direct"]
    meta["machine"]["loadavg1_end"] = common.loadavg()
    meta["machine"]["loadavg_end"] = list(os.getloadavg())
    data = {
        **meta,
        "settings": {"block_sizes": args.block_sizes, "total_bytes_per_size": args.total,
                     "rounds": args.rounds, "queue_depth": args.queue_depth or "store default",
                     "direct_policy": policy, "seed": args.seed, "quick": args.quick,
                     "dir_parent": os.path.abspath(args.dir_parent),
                     "MBps": "payload bytes (block bytes x blocks) / wall seconds / 1e6; "
                             "store_engine_*: payload / the store's own nvme_*_ns",
                     "store_side": "Store.move(all blocks, 'nvme') then ('host'): batched "
                                   "io_uring in two alternating groups, one record file per "
                                   "block (64-byte header, CRC-32C, 4 KiB padding) created in "
                                   "round 1 and rewritten in place after; reads straight into "
                                   "fresh framed host memory (its page faults included)",
                     "direct_side": "Python os.open(O_DIRECT), one file per block, os.pwrite "
                                    "of the block rounded up to 4 KiB from an anonymous mmap "
                                    "buffer (queue depth 1), fdatasync of every file at the "
                                    "end; read back with os.preadv; files removed each round"},
        "filesystem": dev,
        "store_nvme_direct": direct,
        "page_cache": ("both sides use O_DIRECT: the guest page cache is bypassed; a "
                       "hypervisor may still cache the virtual disk" if direct else
                       "the store fell back to buffered I/O: its reads may come from the page "
                       "cache, so store_read_MBps overstates the device"),
        "results": results,
    }
    return common.finish(data, NAME, args.out_dir, args.no_plot, print_table, plot, log)


def plot(data: dict, path: str) -> None:
    plt = common.pyplot()
    rs = data["results"]
    fig, ax = plt.subplots(figsize=(9, 5))
    series = (("store_write_MBps", "Store write (io_uring)", "tab:blue"),
              ("direct_write_MBps", "O_DIRECT pwrite", "lightsteelblue"),
              ("store_read_MBps", "Store read (io_uring)", "tab:green"),
              ("direct_read_MBps", "O_DIRECT pread", "darkseagreen"))
    w = 0.2
    for j, (key, label, color) in enumerate(series):
        xs = [i + (j - 1.5) * w for i in range(len(rs))]
        bars = ax.bar(xs, [r[key] for r in rs], w, label=label, color=color)
        if key.startswith("store"):
            rk = "ratio_write_store_direct" if "write" in key else "ratio_read_store_direct"
            ax.bar_label(bars, labels=[f"x{r[rk]:.2f}" for r in rs], fontsize=7)
    ax.set_xticks(range(len(rs)), [f"{r['block_bytes'] >> 10} KiB x {r['blocks']}" for r in rs])
    fs = data["filesystem"]
    ax.set(ylabel="MB/s", xlabel="block size x blocks",
           title=f"NVMe tier vs O_DIRECT baseline ({fs.get('fstype')} on {fs.get('device')}, "
                 f"O_DIRECT store: {data['store_nvme_direct']})")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    common.write_png(fig, path)


def print_table(data: dict) -> None:
    hdr = (f"{'block':>9}{'blocks':>8}{'st write':>10}{'od write':>10}{'w ratio':>9}"
           f"{'st read':>10}{'od read':>10}{'r ratio':>9}   (MB/s)")
    common.print_header(hdr)
    for r in data["results"]:
        print(f"{r['block_bytes'] >> 10:>6}KiB{r['blocks']:>8}{r['store_write_MBps']:>10.1f}"
              f"{r['direct_write_MBps']:>10.1f}{r['ratio_write_store_direct']:>9.2f}"
              f"{r['store_read_MBps']:>10.1f}{r['direct_read_MBps']:>10.1f}"
              f"{r['ratio_read_store_direct']:>9.2f}")
    print(f"page cache: {data['page_cache']}")


def parse_args(argv: Optional[Sequence[str]]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block-sizes", default=None,
                    help="comma-separated block sizes, k/m suffixes (default 64k,1m,4m; "
                         "--quick 64k,1m)")
    ap.add_argument("--total", default=None,
                    help="bytes of state per block size (default 256m; --quick 8m)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (9; --quick 1)")
    ap.add_argument("--queue-depth", type=int, default=0, help="store queue depth (0: its default)")
    ap.add_argument("--dir-parent", default=os.path.join(common.RESULTS_DIR, "tmp"),
                    help="where the temporary nvme_dir is made (default benchmarks/results/tmp, "
                         "on the project's filesystem; /dev/shm or tmpfs refuse O_DIRECT)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    q = args.quick
    common.fill_defaults(args, dict(block_sizes="64k,1m" if q else "64k,1m,4m",
                                    total="8m" if q else "256m",
                                    rounds=1 if q else 9,
                                    out_dir=os.path.join(common.RESULTS_DIR, "tmp") if q
                                    else common.RESULTS_DIR))
    try:
        args.block_sizes = [parse_size(s) for s in args.block_sizes.split(",") if s.strip()]
        args.total = parse_size(args.total)
    except ValueError:
        ap.error("--block-sizes / --total: sizes like 65536, 64k, 1m")
    if any(b <= 0 for b in args.block_sizes) or args.total <= 0 or args.rounds < 1:
        ap.error("sizes and --rounds must be positive")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    return run(parse_args(argv), argv)


if __name__ == "__main__":
    main()
