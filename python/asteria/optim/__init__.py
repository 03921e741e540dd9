"""The Asteria optimizers: torch.optim.Optimizer subclasses whose REFRESH work (eigh, QR,
inverse roots) runs on the Asteria engine under a bounded staleness budget. The step math is in
``asteria.optim.functional``; the scheduling in ``asteria.optim._base``."""

from asteria.optim.kl_shampoo import KLShampoo
from asteria.optim.one_sided_soap import OneSidedSOAP
from asteria.optim.shampoo import Shampoo
from asteria.optim.soap import SOAP

__all__ = ["SOAP", "OneSidedSOAP", "Shampoo", "KLShampoo"]
