"""The choice of the REFRESH executor: the only place that names one.

May call: the executors' modules. Holds nothing.

Which executor:
 - ``mode="sync"``: ``InlineTorchEngine`` (inline, the native reference).
 - ``mode="async"``, parameters in host memory: ``HostPoolEngine`` (the C pool; one job per (op,
   size, dtype), each on one worker).
 - ``mode="async"``, parameters on a CUDA device: ``SplitEngine`` over the C pool and a
   ``DeviceEngine`` on that device (every round divided among the host workers and the device
   by the cost model). The runtime key ``refresh_device=False`` leaves the device out (the
   split among host workers stays): how a run measures host-only against hybrid.
 - wrapped by ``ReplicatedEngine`` when some parameters are replicated over ranks, with the
   config's coherence_topology, ranks_per_node and coherence_timeout_s.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from asteria.refresh.engine import Engine


def make_engine(cfg: Any, plan: Optional[Any] = None,
                params: Iterable[torch.Tensor] = ()) -> Engine:
    """The engine for a validated ``RuntimeConfig``: ``InlineTorchEngine`` in sync mode, the C
    worker pool (``HostPoolEngine``, with a shadow for its snapshots sized by the placement
    ``plan``) in async mode; wrapped by a ``ReplicatedEngine`` when some of ``params`` are
    replicated over ranks (DDP / HSDP: one owner per block)."""
    if cfg.mode == "sync":
        from asteria.refresh.inline_torch import InlineTorchEngine

        engine: Engine = InlineTorchEngine()
    else:
        from asteria.refresh.host_pool import HostPoolEngine

        params = list(params)
        cuda = device_for(params)
        if plan is None:
            engine = HostPoolEngine(cfg)
        else:
            engine = HostPoolEngine(cfg, shadow="cuda" if plan.cuda else "host",
                             snapshot_ring_bytes=plan.snapshot_ring_bytes,
                             device=-1 if cuda is None or cuda.index is None else cuda.index)
        if cuda is not None:
            from asteria.refresh.split import SplitEngine

            device = None
            if cfg.refresh_device:
                from asteria.refresh.device import DeviceEngine

                device = DeviceEngine(cuda)
            engine = SplitEngine(engine, device, tracer=engine.tracer)
    from asteria.refresh.replicated import wrap_engine

    # the tracer the C pool built over its runtime (NO_TRACE in sync mode), handed to the
    # executors that wrap it
    return wrap_engine(engine, list(params), hierarchical=cfg.coherence_topology == "hier",
                       ranks_per_node=cfg.ranks_per_node, timeout_s=cfg.coherence_timeout_s,
                       tracer=engine.tracer)


def device_for(params: Iterable[torch.Tensor]) -> Optional[torch.device]:
    """The CUDA device of the parameters (the first one's), or None: no device executor."""
    for p in params:
        dev = getattr(p, "device", None)
        if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
            return dev
    return None


def add_params(engine: Engine, params: Iterable[torch.Tensor]) -> None:
    """A param group added after construction: a replicated engine learns its replica sets
    (collective over the default group, as at construction)."""
    if engine.replicated:
        from asteria.refresh.replicated import wrap_engine

        wrap_engine(engine, list(params))
