"""The DFlash drafters: the model and its variants (DFlash2), their spec (read from a config or a
checkpoint), blocks and masks (their input format in training and evaluation alike), attention
kernels, the warm start from the target and the serving-format checkpoint."""

from .blocks import Blocks, build_blocks, sample_anchors  # anchors, blocks and their masks
from .checkpoint import load_drafter, save_drafter  # serving-format drafter directories
from .dflash2 import DFlash2Drafter  # z-lab's DFlash2DraftModel: in-block convs + path selector
from .model import DFlashDrafter  # the model (reference semantics of z-lab's DFlashDraftModel)
from .spec import DrafterSpec, resolve_spec  # the drafter's shape and attention rules
from .variants import VARIANTS, build_model  # the family: one registry line per variant
from .warmstart import warm_start  # starting weights copied from the target
