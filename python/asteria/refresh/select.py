"""The choice of the REFRESH executor: the only place that names one.

May call: the executors' modules. Holds nothing.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from asteria.refresh.engine import Engine


def make_engine(cfg: Any, plan: Optional[Any] = None,
                params: Iterable[torch.Tensor] = ()) -> Engine:
    """The engine for a validated ``RuntimeConfig``: ``TorchEngine`` in sync mode, the C worker
    pool (``CEngine``, with a shadow for its snapshots sized by the placement ``plan``) in
    async mode; wrapped by a ``DistributedEngine`` when some of ``params`` are replicated over
    ranks (DDP / HSDP: one owner per block)."""
    if cfg.mode == "sync":
        from asteria.refresh.inline_torch import TorchEngine

        engine: Engine = TorchEngine()
    else:
        from asteria.refresh.host_pool import CEngine

        if plan is None:
            engine = CEngine(cfg)
        else:
            engine = CEngine(cfg, shadow="cuda" if plan.cuda else "host",
                             snapshot_ring_bytes=plan.snapshot_ring_bytes)
    from asteria.refresh.replicated import wrap_engine

    return wrap_engine(engine, list(params))


def add_params(engine: Engine, params: Iterable[torch.Tensor]) -> None:
    """A param group added after construction: a replicated engine learns its replica sets
    (collective over the default group, as at construction)."""
    if engine.replicated:
        from asteria.refresh.replicated import wrap_engine

        wrap_engine(engine, list(params))
