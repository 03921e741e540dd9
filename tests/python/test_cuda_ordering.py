"""Stream ordering of the CUDA paths, on a GPU (skipped without one; the GPU check runs them):

 - a UVM block is read in place by kernels queued on the current stream; a host write of the
   block right after (an install from host tensors) waits for those reads, so they see the old
   value whole, never the new one or a mix (asteria.tiers.residency: stream ordering);
 - a staged (host_pinned) block's slot view is on the parameter's device, and a host write
   right after its use waits for the queued reads too;
 - the device executor's result equals torch.linalg's on the caller's stream, through its
   blocking end event.

The device's own queue is held back by torch.cuda._sleep so that the reads are still queued
when the host writes."""

import pytest
import torch

from asteria.config import RuntimeConfig
from asteria.tiers.plan import Capabilities, StateEntry, make_plan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

N = 512
KEY = (0, "b0.Q0")
HOLD_CYCLES = int(2e9)  # about a second of the device's clock


def _residency(tier):
    from asteria import _C
    from asteria.tiers.residency import Residency

    if not _C.HAVE_CUDA:
        pytest.skip("libasteria was built without CUDA")
    caps = Capabilities.probe(True)
    if tier == "uvm" and not caps.uvm:
        pytest.skip(f"no coherent managed memory here: {caps.uvm_reason}")
    if not caps.pinned:
        pytest.skip(f"libasteria reaches no device: {caps.pinned_reason}")
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = RuntimeConfig.from_user({"mode": "async", "placement": {"eigenbases": tier}})
    plan = make_plan(cfg, [StateEntry(0, "b0.Q0", "eigenbases", N * N * 4, dev,
                                      torch.float32)], caps)
    assert plan.block_tier[KEY] == tier
    return Residency(plan, cfg)


@pytest.mark.parametrize("tier", ["uvm", "host_pinned"])
def test_host_write_waits_for_the_reads_queued_on_the_block(tier):
    res = _residency(tier)
    try:
        old = torch.full((N, N), 1.0)
        res.write(KEY, old)
        res.prefetch([KEY])
        (view,) = res.borrow([KEY])
        assert view.device == torch.device("cuda", torch.cuda.current_device())
        torch.cuda._sleep(HOLD_CYCLES)     # the read below waits behind this
        stacked = torch.stack([view])      # queued, not run yet
        del view
        res.give_back([KEY])
        res.write(KEY, torch.full((N, N), 2.0))  # an install from host tensors, at once
        torch.cuda.synchronize()
        assert torch.equal(stacked[0].cpu(), old), "the queued read saw the later write"
        (view,) = res.borrow([KEY])
        assert float(view.float().mean()) == 2.0
        del view
        res.give_back([KEY])
    finally:
        res.end_step()
        res.close()


def test_device_executor_on_the_gpu_matches_torch():
    from asteria.refresh.device import DeviceEngine

    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 64, 64, generator=g, dtype=torch.float64)
    f = (a @ a.transpose(-1, -2) / 64 + torch.eye(64, dtype=torch.float64)).cuda()
    eng = DeviceEngine("cuda")
    try:
        res = eng.wait(eng.submit("eigh", f, block=1, version=1, deadline=1, snapshot_step=0))
        assert res.status == 0
        lam = torch.linalg.eigvalsh(f).flip(-1)  # eigh's w: descending (refresh/ops.py)
        torch.testing.assert_close(res.outputs[1], lam, rtol=1e-10, atol=1e-12)
        q = res.outputs[0]
        torch.testing.assert_close(q @ torch.diag_embed(res.outputs[1]) @ q.transpose(-1, -2),
                                   f, rtol=1e-10, atol=1e-10)
    finally:
        eng.close()
