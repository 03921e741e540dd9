"""Asteria: second-order optimizers (SOAP, one-sided SOAP, Shampoo, KL-Shampoo) with their
expensive REFRESH work moved off the training critical path, onto libasteria's C worker pool.

Swap ``torch.optim.AdamW`` for ``asteria.SOAP`` (or ``Shampoo``, ``KLShampoo``) and tune the
staleness budget through ``runtime={"staleness": 5, ...}``.
"""

from asteria.config import RuntimeConfig
from asteria.hooks import attach, detach
from asteria.optim import SOAP, KLShampoo, OneSidedSOAP, Shampoo

__version__ = "0.1.0"

__all__ = ["SOAP", "OneSidedSOAP", "Shampoo", "KLShampoo", "RuntimeConfig", "attach", "detach",
           "__version__"]
