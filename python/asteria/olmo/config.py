"""OLMo-core optimizer configs for the Asteria methods: one per optimizer of
``asteria.optim.METHODS``, made from its signature (``AsteriaSOAPConfig``,
``AsteriaOneSidedSOAPConfig``, ``AsteriaShampooConfig``, ``AsteriaKLShampooConfig``).

Owns: the config fields (each method's keyword names and defaults, plus ``runtime``, the Asteria
runtime dict), their registration with OLMo-core's ``OptimConfig`` registry
(``asteria_<method name>``), and the parameter categorisation. Calls olmo_core
(``MatrixAwareOptimConfig``), ``asteria.RuntimeConfig`` and
``asteria.olmo.optimizer``.

An OLMo-core script swaps its optimizer config and nothing else::

    optim=AsteriaSOAPConfig(lr=3e-3, runtime={"staleness": 5})     # was AdamWConfig(lr=3e-3)

and in a config dict ``{"_CLASS_": "asteria.olmo.AsteriaSOAPConfig", ...}`` or
``{"type": "asteria_soap", ...}`` selects it (``Config.from_dict``).

Categorisation follows OLMo-core's matrix-aware configs (Muon, Dion): ``categorize_parameters``
splits a Transformer into "matrix" (the 2-D weights of the blocks), "vector" (norms, biases),
"embed" and "lm_head"; the matrices get the Asteria method (the expert weights of an MoE layer
in a group of their own with its ``num_experts``, so each expert is preconditioned on its own),
the rest AdamW with the config's
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
from asteria.optim.method import METHODS, method_defaults

#: categories in group order (that of OLMo-core's Muon and Dion configs)
CATEGORIES = ("matrix", "vector", "embed", "lm_head")
#: OptimConfig fields that are not hyperparameters of the method
_NOT_HPARAMS = ("group_overrides", "compile", "fixed_fields", "runtime")


def expert_weights(model: torch.nn.Module) -> Dict[str, int]:
    """{parameter name: num_experts} of the expert weights of OLMo-core's MoE layers
    (``olmo_core.nn.moe.mlp.MoEMLPBase``: w1, w2, w3 of shape (num_experts * rows, cols), every
    ``rows`` rows one expert): a param group with ``num_experts`` gives each expert its own
    preconditioner (``asteria.optim._blocking``)."""
    from olmo_core.nn.moe.mlp import MoEMLPBase

    out: Dict[str, int] = {}
    for mn, m in model.named_modules():
        if isinstance(m, MoEMLPBase):
            for pn, p in m.named_parameters(recurse=False):
                if p.dim() >= 2:
                    out[f"{mn}.{pn}" if mn else pn] = int(m.num_experts)
    return out


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
        group = self.method_hparams()
        beta1, beta2, eps = self.METHOD.METHOD().adamw_hparams(group)
        return dict(lr=self.lr, betas=(beta1, beta2), eps=eps, weight_decay=self.weight_decay)

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
        experts = expert_weights(model)  # name -> num_experts of an MoE layer's expert weight
        groups = []
        for c in CATEGORIES:
            names = [n for n in cats.get(c, ()) if n in params]
            if c == "matrix":  # each MoE layer's experts preconditioned on their own
                for e in sorted({experts[n] for n in names if n in experts}):
                    groups.append(dict(method, num_experts=e, params=[
                        params[n] for n in names if experts.get(n) == e]))
                names = [n for n in names if n not in experts]
                groups.insert(0, dict(opts[c], params=[params[n] for n in names]))
                continue
            groups.append(dict(opts[c], params=[params[n] for n in names]))
        return [g for g in groups if g["params"]]

    def create_optimizer(self, model: torch.nn.Module, strict: bool = True,
                         **kwargs: Any) -> MatrixAwareAsteria:
        del kwargs  # the fields, which build() passes again; they are read from self
        self.validate()
        return MatrixAwareAsteria(self.build_groups(model, strict=strict), method=self.METHOD,
                                  method_name=self.NAME, runtime=self.runtime)


def _field_type(name: str, default: Any, annotation: Any) -> Any:
    """The config field type of a keyword: its annotation where that is a plain type name,
    else from its default (OLMo-core's configs go through OmegaConf, which takes no Union)."""
    ann = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    if isinstance(default, torch.dtype):
        return str  # dtypes by name (torch.distributed.checkpoint saves no torch.dtype)
    if ann in ("bool", "int", "float", "str"):
        return {"bool": bool, "int": int, "float": float, "str": str}[ann]
    if isinstance(default, tuple):
        return Tuple[tuple(type(v) for v in default)]
    if default is None:
        return (Optional[int] if "int" in ann else Optional[float] if "float" in ann
                else Optional[Any])
    return type(default)


def config_class(optimizer: type) -> type:
    """The OLMo-core config of an Asteria optimizer class: one field per keyword, with its name
    and default (a torch.dtype by name), registered as ``asteria_<method name>``."""
    name = optimizer.METHOD.NAME
    sig = inspect.signature(optimizer).parameters
    fields = []
    for key, default in method_defaults(optimizer).items():
        typ = _field_type(key, default, sig[key].annotation)
        if isinstance(default, torch.dtype):
            default = str(default).removeprefix("torch.")
        fields.append((key, typ, field(default=default)))
    doc = (f"``asteria.{optimizer.__name__}`` on the matrices; AdamW on the rest, with the lr, "
           f"weight_decay and the first-moment / second-moment / epsilon settings "
           f"{optimizer.__name__} gives its own 1-D parameters.")
    cls = dataclasses.make_dataclass(
        f"Asteria{optimizer.__name__}Config", fields, bases=(AsteriaOptimConfig,),
        namespace={"METHOD": optimizer, "NAME": name, "__doc__": doc})
    cls.__module__ = __name__  # found as asteria.olmo.config.<name> (OLMo-core's _CLASS_)
    return OptimConfig.register(f"asteria_{name}")(cls)


#: config class name -> config class, one per Asteria optimizer (``asteria.optim.METHODS``)
CONFIG_CLASSES = {c.__name__: c for c in map(config_class, METHODS.values())}
globals().update(CONFIG_CLASSES)
