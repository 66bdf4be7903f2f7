"""The drafter family: one registry line per variant.

A variant is its model class (architecture only: the modules, their weight names, the drafting
rule `propose` / `proposal`, and `check_spec` for its own fields), the `architectures` name of
its config.json and the dflash_config fields it adds. Everything else follows from the line:
`drafter.variant` picks it (dflash.drafter.spec.resolve_spec copies its fields from drafter.*),
config.json export and import (`DrafterSpec.to_hf_config` / `from_hf_config`) write and read its
architecture name and fields, `build_model` constructs it for training, loading and resume, and
decoding and evaluation draft with its `propose`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .dflash2 import FIELDS as DFLASH2_FIELDS
from .dflash2 import DFlash2Drafter
from .model import DFlashDrafter


@dataclass(frozen=True)
class Variant:
    name: str  # drafter.variant
    architecture: str  # config.json architectures[0]
    model: type  # DFlashDrafter or a subclass
    fields: tuple[str, ...] = ()  # its dflash_config fields = drafter.* keys of the same names


VARIANTS = {
    v.name: v
    for v in (
        Variant("dflash", "DFlashDraftModel", DFlashDrafter),
        Variant("dflash2", "DFlash2DraftModel", DFlash2Drafter, DFLASH2_FIELDS),
    )
}


def variant(name: str) -> Variant:
    if name not in VARIANTS:
        raise ValueError(f"drafter variant {name!r} is unknown; choose one of {list(VARIANTS)}")
    return VARIANTS[name]


def from_config_json(cfg: dict) -> Variant:
    """The variant a config.json describes; anything else is refused in one line, never run as
    another variant (e.g. DFlash2 fields beside `architectures: ["DFlashDraftModel"]`)."""
    archs = list(cfg.get("architectures") or [])
    known = {v.architecture: v for v in VARIANTS.values()}
    found = {a for a in archs if a in known}
    if len(found) != len(set(archs)) or len(found) > 1:
        raise ValueError(
            f"config.json architectures={archs}: one of {sorted(known)} is expected "
            "(dflash.drafter.variants lists the implemented drafters)"
        )
    v = known[found.pop()] if found else VARIANTS["dflash"]
    dc = cfg.get("dflash_config") or {}
    foreign = sorted(
        f
        for other in VARIANTS.values()
        for f in other.fields
        if f not in v.fields and (f in dc or f in cfg)
    )
    if foreign:
        raise ValueError(
            f"config.json: {v.architecture} (architectures={archs}) carries fields of another "
            f"drafter ({', '.join(foreign)}); refusing to run it as a plain {v.architecture}"
        )
    return v


def build_model(spec) -> nn.Module:
    """The drafter module of spec.variant (weights uninitialised: init_weights or a load)."""
    return variant(spec.variant).model(spec)
