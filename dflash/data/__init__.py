"""Training data: prompt files and built-in corpora, prompts through the target's chat template,
the target's own answers (regenerated and cached in shards), packed batches, the resumable
sample order."""

from .batch import Sample, TargetBatch, collate, target_forward  # samples -> packed target batches
from .dataset import load_or_build_dataset  # prompts -> the target's answers, cached
from .files import text_prompts  # prompt files (jsonl, parquet) and built-in sources
from .prompts import encode_prompts  # text -> token ids through the chat template
from .stream import SampleStream  # the deterministic, resumable sample order
