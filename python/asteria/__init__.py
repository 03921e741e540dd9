"""Asteria: second-order optimizers (SOAP, one-sided SOAP, Shampoo, KL-Shampoo) with their
expensive REFRESH
work moved off the training critical path, onto libasteria's C worker pool.

Swap ``torch.optim.AdamW`` for ``asteria.SOAP`` (or ``Shampoo``, ``KLShampoo``) and tune the
staleness budget through ``runtime={"staleness": 5, ...}``.
"""

from asteria.config import RuntimeConfig
from asteria.hooks import attach, detach
from asteria import optim as _optim

__version__ = "0.1.0"

globals().update({name: getattr(_optim, name) for name in _optim.__all__})  # the optimizers

__all__ = [*_optim.__all__, "RuntimeConfig", "attach", "detach", "__version__"]
