"""The models the planner prices: the OLMo-2 presets' weight shapes, the factors of a set of
weight shapes and the jobs of a round of them.

Owns: the presets (``PRESETS``, ``preset``: OLMo-2 1B and 7B, read from OLMo-core's model
configs: built on the meta device, no memory allocated, and their 2-D weights listed;
embeddings and the output head take AdamW, as asteria.olmo routes them; and the training FLOPs
per token), the factor list of a set of shapes (``factors``: the optimizers' own blocking,
``asteria.optim._blocking.make_layout``, and their rule of which dimensions get a factor), a
round's jobs (``round_jobs``). May call: ``asteria.optim._blocking``, ``asteria.optim.method``,
``asteria.refresh.cost`` (JobSpec), olmo_core (presets only), torch.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

import torch

from asteria.optim._blocking import make_layout
from asteria.optim.method import method_of
from asteria.refresh import cost as C

PRESETS = {"olmo2-1b": "olmo2_1B", "olmo2-7b": "olmo2_7B"}
VOCAB = 100352            # OLMo-2's padded dolma2 vocabulary


def preset(name: str, seq_len: int = 4096) -> dict:
    """{"shapes": [2-D weight shapes given to the method], "flops_per_token": training FLOPs
    per token, "params": all parameters} of an OLMo-2 preset, from OLMo-core's config."""
    import logging
    import warnings

    logging.getLogger("olmo_core").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from olmo_core.nn.transformer import TransformerConfig

        cfg = getattr(TransformerConfig, PRESETS[name])(vocab_size=VOCAB)
        model = cfg.build(init_device="meta")
    shapes = [tuple(p.shape) for n, p in model.named_parameters()
              if p.dim() == 2 and "embeddings" not in n and "lm_head" not in n]
    # 6 FLOPs per parameter of the matmuls (forward + backward), plus attention's scores
    # and values: 12 n_layers d_model seq_len
    fpt = 6.0 * cfg.num_non_embedding_params + 12.0 * cfg.n_layers * cfg.d_model * seq_len
    return {"shapes": shapes, "flops_per_token": fpt, "params": cfg.num_params}


def factors(shapes: Sequence[tuple], max_dim: int, block_size: Optional[int],
            optimizer: str = "soap") -> Counter:
    """{factor size: count} of these weights under the optimizer's blocking and its rule of
    which dimensions of a block get a factor (``Method.has_factor``)."""
    method = method_of(optimizer).METHOD()
    group = {"block_size": block_size, "max_precond_dim": max_dim,
             "max_preconditioner_dim": max_dim, "merge_dims": False}
    out: Counter = Counter()
    for shape in shapes:
        for block in make_layout(torch.Size(shape), block_size, False, max_dim).block_shapes:
            for d, has in zip(block, method.has_factor(block, group)):
                if has:
                    out[d] += 1
    return out


def round_jobs(sizes: Counter, optimizer: str) -> list:
    op, p = method_of(optimizer).METHOD.REFRESH_OP
    return [C.JobSpec(op, torch.float32, n, k, p=p) for n, k in sorted(sizes.items())]
