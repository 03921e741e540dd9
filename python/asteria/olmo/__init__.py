"""Asteria for OLMo-core: optimizer configs an OLMo-core training script swaps in for its
``AdamWConfig``, with the Asteria runtime (staleness budget, workers, placement, ...) as a dict
field of the config. See docs/olmo.md.

    from asteria.olmo import AsteriaSOAPConfig
    optim = AsteriaSOAPConfig(lr=3e-3, runtime={"staleness": 5})

Importing this module registers the configs with OLMo-core (``"_CLASS_":
"asteria.olmo.AsteriaSOAPConfig"`` or ``"type": "asteria_soap"`` in a config dict). It needs
``ai2-olmo-core`` (``pip install asteria[olmo]``).
"""

try:
    import olmo_core  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("asteria.olmo needs OLMo-core: pip install 'asteria[olmo]' "
                      "(ai2-olmo-core)") from e

from asteria.olmo.config import CONFIG_CLASSES, AsteriaOptimConfig, categorize_generic
from asteria.olmo.optimizer import MatrixAwareAsteria

globals().update(CONFIG_CLASSES)  # AsteriaSOAPConfig, AsteriaShampooConfig, ...

__all__ = [*CONFIG_CLASSES, "AsteriaOptimConfig", "MatrixAwareAsteria", "categorize_generic"]
