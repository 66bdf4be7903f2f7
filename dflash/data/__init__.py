"""Training data: prompt and conversation sources (ShareGPT, OpenAI messages, plain prompts,
Hugging Face datasets, built-in corpora) read as one normalized form, mixtures, prompts through
the target's chat template, the target's own answers regenerated turn by turn (cached in
shards), packed batches, the resumable sample order. docs/data.md says what each key does."""

from .batch import Sample, TargetBatch, collate, target_forward  # samples -> packed target batches
from .conversations import Conversation  # one row of any format, normalized
from .dataset import load_or_build_dataset  # prompts -> the target's answers, cached
from .files import read_conversations, text_prompts  # files (jsonl, json, parquet, hf) and corpora
from .mix import training_conversations  # data.source or data.mix, at its weights
from .prompts import TokenTable, encode_prompts  # text -> token ids through the chat template
from .stream import SampleStream  # the deterministic, resumable sample order
