"""OLMo-core optimizer configs for the Asteria methods: ``AsteriaSOAPConfig``,
``AsteriaShampooConfig``, ``AsteriaKLShampooConfig``.

Owns: the config fields (each method's keyword names and defaults, plus ``runtime``, the Asteria
runtime dict), their registration with OLMo-core's ``OptimConfig`` registry, and the parameter
categorisation. Calls olmo_core (``MatrixAwareOptimConfig``), ``asteria.RuntimeConfig`` and
``asteria.olmo.optimizer``.

An OLMo-core script swaps its optimizer config and nothing else::

    optim=AsteriaSOAPConfig(lr=3e-3, runtime={"staleness": 5})     # was AdamWConfig(lr=3e-3)

and in a config dict ``{"_CLASS_": "asteria.olmo.AsteriaSOAPConfig", ...}`` or
``{"type": "asteria_soap", ...}`` selects it (``Config.from_dict``).

Categorisation follows OLMo-core's matrix-aware configs (Muon, Dion): ``categorize_parameters``
splits a Transformer into "matrix" (the 2-D weights of the blocks), "vector" (norms, biases),
"embed" and "lm_head"; the matrices get the Asteria method, the rest AdamW with the config's
lr and the method's first-moment / second-moment / epsilon settings, embeddings without weight
decay. Any other model: embeddings (``nn.Embedding``) and parameters of fewer than 2 dimensions
go to AdamW, the rest to the method.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch
from olmo_core.exceptions import OLMoConfigurationError
from olmo_core.nn.transformer import Transformer
from olmo_core.optim import MatrixAwareOptimConfig, OptimConfig

from asteria.config import RuntimeConfig
from asteria.olmo.optimizer import ADAMW, MatrixAwareAsteria
from asteria.optim import KLShampoo, SOAP, Shampoo

#: categories in group order (that of OLMo-core's Muon and Dion configs)
CATEGORIES = ("matrix", "vector", "embed", "lm_head")
#: OptimConfig fields that are not hyperparameters of the method
_NOT_HPARAMS = ("group_overrides", "compile", "fixed_fields", "runtime")


def categorize_generic(model: torch.nn.Module) -> Dict[str, List[str]]:
    """The categorisation of a model that is not an OLMo-core Transformer."""
    embed = {f"{mn}.{pn}" if mn else pn
             for mn, m in model.named_modules() if isinstance(m, torch.nn.Embedding)
             for pn, _ in m.named_parameters(recurse=False)}
    out: Dict[str, List[str]] = {c: [] for c in CATEGORIES}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        out["embed" if n in embed else "vector" if p.ndim < 2 else "matrix"].append(n)
    return out


@dataclass
class AsteriaOptimConfig(MatrixAwareOptimConfig):
    """Base of the Asteria configs (not registered itself). Subclasses declare the method's
    hyperparameters as fields, with the method's own names and defaults."""

    METHOD: ClassVar[type]
    NAME: ClassVar[str]  # the "algorithm" of the method's param groups

    runtime: Dict[str, Any] = field(default_factory=dict)
    """The Asteria runtime dict: mode, staleness, install, workers, placement,
    device_budget_bytes, host_budget_bytes, nvme_dir, trace (see ``asteria.RuntimeConfig``)."""

    @classmethod
    def optimizer(cls) -> type:
        return MatrixAwareAsteria

    def validate(self) -> None:
        """Raise ValueError naming a bad runtime key or value (``asteria.RuntimeConfig``)."""
        RuntimeConfig.from_user(self.runtime)

    def method_hparams(self) -> Dict[str, Any]:
        """The keyword arguments of the method, from this config's fields."""
        accepted = inspect.signature(self.METHOD).parameters
        out = {}
        for f in dataclasses.fields(self):
            if f.name in _NOT_HPARAMS or f.name.startswith("_") or not f.init:
                continue
            if f.name not in accepted:
                raise TypeError(f"{type(self).__name__}.{f.name} is not a keyword of "
                                f"{self.METHOD.__name__}")
            out[f.name] = getattr(self, f.name)
        return out

    def adamw_hparams(self) -> Dict[str, Any]:
        """lr, betas, eps, weight_decay of the AdamW groups: those the method gives its own
        1-D parameters."""
        return dict(lr=self.lr, betas=tuple(self.betas), eps=self.eps,
                    weight_decay=self.weight_decay)

    def categorize(self, model: torch.nn.Module) -> Dict[str, List[str]]:
        """{"matrix": [...], "vector": [...], "embed": [...], "lm_head": [...]} of parameter
        names."""
        if isinstance(model, Transformer):
            return self.categorize_parameters(model)
        return categorize_generic(model)

    def build_groups(self, model: torch.nn.Module, strict: bool = True) -> List[Dict[str, Any]]:
        """One param group per non-empty category, with its algorithm and hyperparameters."""
        del strict  # no patterns to match: the groups come from the categorisation
        if self.group_overrides is not None:
            raise OLMoConfigurationError(
                f"group_overrides are not supported by {type(self).__name__}: the parameter "
                f"groups come from the categorisation")
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        method = dict(self.method_hparams(), algorithm=self.NAME)
        adamw = dict(self.adamw_hparams(), algorithm=ADAMW)
        opts = {"matrix": method, "vector": adamw, "embed": dict(adamw, weight_decay=0.0),
                "lm_head": adamw}
        cats = self.categorize(model)
        groups = [dict(opts[c], params=[params[n] for n in cats.get(c, ()) if n in params])
                  for c in CATEGORIES]
        return [g for g in groups if g["params"]]

    def create_optimizer(self, model: torch.nn.Module, strict: bool = True,
                         **kwargs: Any) -> MatrixAwareAsteria:
        del kwargs  # the fields, which build() passes again; they are read from self
        self.validate()
        return MatrixAwareAsteria(self.build_groups(model, strict=strict), method=self.METHOD,
                                  method_name=self.NAME, runtime=self.runtime)


@OptimConfig.register("asteria_soap")
@dataclass
class AsteriaSOAPConfig(AsteriaOptimConfig):
    """SOAP (``asteria.SOAP``) on the matrices, AdamW (betas, eps, weight_decay) on the rest."""

    METHOD: ClassVar[type] = SOAP
    NAME: ClassVar[str] = "soap"

    lr: float = 3e-3
    betas: Tuple[float, float] = (0.95, 0.95)
    shampoo_beta: float = -1
    eps: float = 1e-8
    weight_decay: float = 0.01
    precondition_frequency: int = 10
    max_precond_dim: int = 10000
    merge_dims: bool = False
    normalize_grads: bool = False
    correct_bias: bool = True
    block_size: Optional[int] = None


@OptimConfig.register("asteria_shampoo")
@dataclass
class AsteriaShampooConfig(AsteriaOptimConfig):
    """Shampoo with Adam grafting (``asteria.Shampoo``) on the matrices; AdamW on the rest with
    betas (betas[0], grafting_beta2) and eps grafting_epsilon, as Shampoo treats 1-D
    parameters."""

    METHOD: ClassVar[type] = Shampoo
    NAME: ClassVar[str] = "shampoo"

    lr: float = 1e-3
    betas: Tuple[float, float] = (0.9, 0.999)
    epsilon: float = 1e-12
    grafting_beta2: float = 0.999
    grafting_epsilon: float = 1e-8
    weight_decay: float = 0.0
    precondition_frequency: int = 10
    start_preconditioning_step: int = -1
    max_preconditioner_dim: int = 1024
    inverse_exponent_override: Optional[float] = None
    block_size: Optional[int] = None

    def adamw_hparams(self) -> Dict[str, Any]:
        return dict(lr=self.lr, betas=(self.betas[0], self.grafting_beta2),
                    eps=self.grafting_epsilon, weight_decay=self.weight_decay)


@OptimConfig.register("asteria_kl_shampoo")
@dataclass
class AsteriaKLShampooConfig(AsteriaOptimConfig):
    """KL-Shampoo (``asteria.KLShampoo``) on the matrices, AdamW (betas, eps, weight_decay) on
    the rest."""

    METHOD: ClassVar[type] = KLShampoo
    NAME: ClassVar[str] = "kl_shampoo"

    lr: float = 1e-4
    betas: Tuple[float, float] = (0.9, 0.98)
    shampoo_beta: float = -1
    eps: float = 1e-8
    weight_decay: float = 0.01
    precondition_frequency: int = 10
    normalize_grads: bool = False
    init_factor: float = 0.1
    using_clamping: bool = True
    max_clamp_value: int = 4000
    compute_dtype: str = "float32"
    """A torch floating-point dtype by name: "float32", "float64", "bfloat16", ..."""
    max_precond_dim: int = 10000
    block_size: Optional[int] = None

    def method_hparams(self) -> Dict[str, Any]:
        out = super().method_hparams()
        dtype = getattr(torch, str(self.compute_dtype), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"invalid compute_dtype: {self.compute_dtype!r}; allowed: the name "
                             f"of a floating-point torch dtype, e.g. 'float32', 'float64'")
        out["compute_dtype"] = dtype
        return out
