"""The frozen target: loading, the clean forward that yields aux states and greedy labels
(packed rows, CUDA graphs, compiled layers), Gated-DeltaNet kernels, cache surgery and the
regeneration decoder."""

from .capture import Target, TargetOutput  # the clean forward: aux states + greedy labels
from .linear_attn import linear_attn_report  # which Gated-DeltaNet kernels a run uses
from .load import load_target, resolve_local_path, target_config_from_yaml  # load a target
from .regen import StaticGreedyDecoder  # the static-cache, graph-replayed greedy decoder
from .shape import Heads, TargetShape, check_layer_ids, default_layer_ids  # what the drafter reads
