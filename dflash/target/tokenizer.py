"""A byte-level tokenizer built in code, for targets built from a config (random weights).

It lets every text data source (jsonl, stdlib, parquet) and chat templates run offline on the
tiny targets: ids 0..255 are the bytes of UTF-8 text, then ChatML special tokens, reserved
special tokens up to the model's vocab size, and the drafter's mask token as the last id (the
id tokenizer-less random targets reserve, so checkpoints keep their mask token). Nothing is
downloaded.
"""

from __future__ import annotations

# Qwen-style ChatML; `enable_thinking=false` adds the empty think block as Qwen3 templates do,
# so the enable_thinking switch of the data config is exercised on tiny targets too.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
MASK = "<|mask|>"
NUM_BYTES = 256
MIN_VOCAB = NUM_BYTES + len(SPECIALS) + 1


def byte_tokenizer(vocab_size: int):
    """A PreTrainedTokenizerFast with exactly `vocab_size` ids (bytes, specials, reserved, mask)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB:
        raise ValueError(
            f"target.tokenizer=bytes needs target.config.vocab_size >= {MIN_VOCAB} (256 bytes + "
            f"{len(SPECIALS) + 1} special tokens), got {vocab_size}; raise the vocab size or set "
            "target.tokenizer=null"
        )
    # ByteLevel maps every byte to one printable character; a BPE without merges then gives one
    # token per byte, in byte order.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - MIN_VOCAB)]
    tok.add_special_tokens([*SPECIALS, *reserved, MASK])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        mask_token=MASK,
        chat_template=CHAT_TEMPLATE,
    )
    if len(fast) != vocab_size or fast.mask_token_id != vocab_size - 1:
        raise AssertionError(f"byte tokenizer has {len(fast)} ids, expected {vocab_size}")
    return fast


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to
    256 + their rank among the non-printable bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += list(range(ord("®"), ord("ÿ") + 1))
    o = ord(ch)
    if o in printable:
        return o
    rest = [b for b in range(256) if b not in printable]
    return rest[o - 256]


def make_tokenizer(kind: str | None, vocab_size: int):
    """target.tokenizer for config-built targets: None (no tokenizer) or "bytes"."""
    if kind is None:
        return None
    if kind == "bytes":
        return byte_tokenizer(vocab_size)
    raise ValueError(
        f"target.tokenizer={kind!r} is not allowed; choose bytes (the built-in byte-level "
        "tokenizer) or null (none; data.source=selfgen only)"
    )
