"""The names of an Asteria optimizer's per-parameter state: one typed key, one ``format``, one
``parse``, and the predicates the rest of ``asteria.optim`` asks of a name.

Owns the grammar of the state keys, as ``optimizer.state`` and ``state_dict()`` show them and
checkpoints store them; no other module builds or parses these strings. May call: nothing but
the standard library. No state; safe from any thread.

The names (the serialized form; checkpoints hold exactly these strings):
 - per parameter: ``step``; the AdamW path's ``exp_avg``, ``exp_avg_sq``; with S > 0 the refresh
   in flight ``pending.install_in``, ``pending.age``; with ``staleness="auto"``
   ``staleness.auto``; in a group with ``precondition_frequency="auto"`` ``frequency.auto``;
   with ``refresh_policy="drift"`` and "auto" values ``refresh_budget.auto``,
   ``install_delay.auto`` (constants below);
 - per block j (``Key``): ``b{j}.{field}`` (a block's moment: ``b0.exp_avg``, ``b0.momentum``),
   ``b{j}.{field}{i}`` (a per-dimension entry: factor ``b0.GG1``, basis ``b0.Q1``, root
   ``b0.Linv1``), ``b{j}.pending{i}.{n}`` (output n of the refresh in flight of dimension i;
   with ``refresh_policy="drift"`` its ``b{j}.pending_in{i}``, ``b{j}.pending_age{i}``, and the
   factor's ``b{j}.basis_age{i}``, ``b{j}.drift{i}``), and flags: ``b{j}.pending{i}_ok``
   (those outputs are a result), ``b{j}.Linv{i}_set`` (a root was installed);
 - a DTensor shard's copy of any key: ``{key}@shard{i}of{n}[_{i}of{n}...]`` (``tagged``);
 - the first key of a state under a shard's tag, ``LOCAL_ONLY`` tagged (below): a marker whose
   name states what a checkpoint of per-shard state can resume on, and the remedy.
Which fields a method has is the method's (soap.py, shampoo.py, kl_shampoo.py): this module
knows only how names are put together.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Callable, Optional

STEP = "step"
ADAMW_MOMENTS = ("exp_avg", "exp_avg_sq")  # the AdamW path's state besides the step
PENDING_IN = "pending.install_in"  # steps until the install of the refresh in flight
PENDING_AGE = "pending.age"        # steps since its snapshot
AUTO_S = "staleness.auto"          # the S that staleness="auto" chose (-1: not yet)
AUTO_F = "frequency.auto"          # the f that precondition_frequency="auto" chose (-1: not yet)
AUTO_BUDGET = "refresh_budget.auto"  # the budget refresh_budget="auto" chose (-1: not yet)
AUTO_DELAY = "install_delay.auto"    # the d install_delay="auto" chose (-1: not yet)
#: The marker that heads the state of a parameter sharded over several ranks with
#: fsdp_blocking="local" (value: the shard count). Its name is a sentence because a resume at
#: another world size shows it and nothing else: torch.distributed.checkpoint's load planner
#: names the first key of the loading state that the checkpoint lacks, and that is this
#: marker, tagged with the loading rank's shard. No "." in it: a dotted name is nested by DCP's
#: unflattening.
LOCAL_ONLY = ("fsdp_blocking=local(resumes_only_at_the_saved_world_size;"
              "use_fsdp_blocking=global_to_resume_at_another)")

PENDING = "pending"  # the field of a refresh in flight's outputs and their flag
PENDING_IN_FIELD = "pending_in"    # refresh_policy="drift": per factor, steps until its install
PENDING_AGE_FIELD = "pending_age"  # ... and steps since its snapshot
BASIS_AGE = "basis_age"  # refresh_policy="drift": steps since the installed basis's snapshot
DRIFT = "drift"          # refresh_policy="drift": the factor's probes at its last refresh start
OK = "_ok"           # flag: the pending outputs of (block, dimension) are a result
SET = "_set"         # flag: a root was installed (Shampoo's ``b{j}.Linv{i}_set``)
_FLAGS = (OK, SET)

TAG_SEP = "@"
_SHARD = "shard"

# b{j}.{field}[{dim}][.{output}][{flag}]; the field is the shortest prefix the rest fits, so
# that format(parse(s)) == s for every name this matches
_KEY = re.compile(r"b(0|[1-9]\d*)\.(.+?)(0|[1-9]\d*)?(?:\.(0|[1-9]\d*))?(_ok|_set)?")
_TAG = re.compile(r"@shard\d+of\d+(?:_\d+of\d+)*")


@dataclasses.dataclass(frozen=True)
class Key:
    """One block entry's name: block ``block``, field ``field``, the factor's dimension ``dim``
    (per-dimension fields), the output index ``output`` (a pending output) and ``flag``
    (``OK``, ``SET`` or "")."""

    block: int
    field: str
    dim: Optional[int] = None
    output: Optional[int] = None
    flag: str = ""

    def format(self) -> str:
        return _format(self.block, self.field, self.dim, self.output, self.flag)

    @staticmethod
    def parse(name) -> Optional["Key"]:
        """The Key a name is, or None (not a block entry: ``step``, ``pending.age``, ...)."""
        return _parse(name) if isinstance(name, str) else None

    @property
    def entry(self) -> bool:
        """A state tensor of the method's own (not a pending output, not a flag)?"""
        return self.output is None and not self.flag


@functools.lru_cache(maxsize=65536)
def _format(block: int, field: str, dim: Optional[int], output: Optional[int],
            flag: str) -> str:
    # cached: the step names its blocks' entries every step
    name = f"b{block}.{field}"
    if dim is not None:
        name += str(dim)
    if output is not None:
        name += f".{output}"
    return name + flag


@functools.lru_cache(maxsize=65536)
def _parse(name: str) -> Optional[Key]:
    m = _KEY.fullmatch(name)
    if m is None:
        return None
    block, field, dim, output, flag = m.groups()
    return Key(int(block), field, None if dim is None else int(dim),
               None if output is None else int(output), flag or "")


# ---- the names callers build ---------------------------------------------------------------
def key(block: int, field: str, dim: Optional[int] = None) -> str:
    """``b{block}.{field}`` or, per dimension, ``b{block}.{field}{dim}``."""
    return _format(block, field, dim, None, "")


def pending_output(block: int, dim: int, output: int) -> str:
    """``b{block}.pending{dim}.{output}``: output ``output`` of the refresh in flight."""
    return _format(block, PENDING, dim, output, "")


def pending_ok(block: int, dim: int) -> str:
    """``b{block}.pending{dim}_ok``: 1 if the pending outputs of (block, dim) are a result."""
    return _format(block, PENDING, dim, None, OK)


def pending_in(block: int, dim: int) -> str:
    """``b{block}.pending_in{dim}``: steps until the install of this factor's refresh in flight
    (refresh_policy="drift": factors of one parameter in flight with their own install steps)."""
    return _format(block, PENDING_IN_FIELD, dim, None, "")


def pending_age(block: int, dim: int) -> str:
    """``b{block}.pending_age{dim}``: steps since the snapshot of that refresh."""
    return _format(block, PENDING_AGE_FIELD, dim, None, "")


def basis_age(block: int, dim: int) -> str:
    """``b{block}.basis_age{dim}``: steps since the snapshot of the factor's installed basis."""
    return _format(block, BASIS_AGE, dim, None, "")


def drift(block: int, dim: int) -> str:
    """``b{block}.drift{dim}``: the factor times the drift probes at its last refresh start."""
    return _format(block, DRIFT, dim, None, "")


def set_flag(block: int, field: str, dim: int) -> str:
    """``b{block}.{field}{dim}_set``: 1 once a refresh was installed there."""
    return _format(block, field, dim, None, SET)


# ---- what callers ask of a name ------------------------------------------------------------
def is_factor(name, field: str) -> bool:
    """Is name a per-dimension entry ``b{j}.{field}{i}`` (``is_factor(k, "GG")``)?"""
    k = Key.parse(name)
    return k is not None and k.field == field and k.dim is not None and k.entry


def is_moment(name, field: str) -> bool:
    """Is name a block's entry ``b{j}.{field}`` without a dimension (``b0.momentum``)?"""
    k = Key.parse(name)
    return k is not None and k.field == field and k.dim is None and k.entry


def is_pending_output(name) -> bool:
    """Is name an output of a refresh in flight (``b{j}.pending{i}.{n}``)?"""
    k = Key.parse(name)
    return k is not None and k.field == PENDING and k.output is not None and not k.flag


def is_pending_ok(name) -> bool:
    k = Key.parse(name)
    return (k is not None and k.field == PENDING and k.dim is not None and k.output is None
            and k.flag == OK)


def block_of(name) -> Optional[int]:
    """The block index of a block entry's name, else None."""
    k = Key.parse(name)
    return None if k is None else k.block


def renumber(name, block: Callable[[int], Optional[int]]):
    """name with its block index j replaced by ``block(j)``; None where that is None; a name
    that is not a block entry's unchanged."""
    k = Key.parse(name)
    if k is None:
        return name
    j = block(k.block)
    return None if j is None else dataclasses.replace(k, block=j).format()


# ---- shard tags ----------------------------------------------------------------------------
def shard_tag(parts) -> Optional[str]:
    """The tag of a shard from its (index, count) per sharding mesh dimension: ``shard0of2``,
    ``shard1of2_0of4``; None for no part."""
    return _SHARD + "_".join(f"{i}of{n}" for i, n in parts) if parts else None


def shard_count(tag: str) -> int:
    """How many shards a tag's layout has: ``shard1of2_0of4`` -> 8."""
    count = 1
    for part in tag[len(_SHARD):].split("_"):
        count *= int(part.partition("of")[2])
    return count


def tagged(name: str, tag: str) -> str:
    """A shard's copy of a key: ``{name}@{tag}``."""
    return f"{name}{TAG_SEP}{tag}"


def split_tag(name) -> tuple:
    """(the name without its shard tag, the tag or None): ``b0.exp_avg@shard1of2`` ->
    (``b0.exp_avg``, ``shard1of2``). A name that is not a string is returned as it is."""
    m = _TAG.search(name) if isinstance(name, str) else None
    if m is None or m.end() != len(name):
        return name, None
    return name[:m.start()], m.group(0)[len(TAG_SEP):]


def untagged(name, tag: str):
    """name without the suffix of this tag (a lookup under the shard's name)."""
    suffix = TAG_SEP + tag
    return name[:-len(suffix)] if name.endswith(suffix) else name


def shard_words(tag: Optional[str]) -> str:
    """``shard1of2`` -> "shard 1 of 2 (fsdp_blocking='local')"; None -> an unsharded one."""
    if tag is None:
        return "an unsharded parameter (one rank, or no FSDP)"
    return f"shard {tag[len(_SHARD):].replace('of', ' of ')} (fsdp_blocking='local')"
