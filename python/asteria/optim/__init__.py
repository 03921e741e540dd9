"""The Asteria optimizers: torch.optim.Optimizer subclasses whose REFRESH work (eigh, QR,
inverse roots) runs on the Asteria engine under a bounded staleness budget. Each is a thin class
over a ``method.Method`` (its math); ``optimizer.AsteriaOptimizer`` composes it with the
schedule, the placement and the checkpoint part (docs/architecture.md). ``METHODS``: every
optimizer by method name; importing a method's module registers it."""

from asteria.optim.kl_shampoo import KLShampoo
from asteria.optim.method import METHODS
from asteria.optim.one_sided_soap import OneSidedSOAP
from asteria.optim.shampoo import Shampoo
from asteria.optim.soap import SOAP

__all__ = ["SOAP", "OneSidedSOAP", "Shampoo", "KLShampoo"]
