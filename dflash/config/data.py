"""Schema of the `data` config group (conf/data/): where prompts come from and how the target
regenerates them."""

from __future__ import annotations

from dataclasses import dataclass, field

from .checks import check_choice, check_positive

DATA_SOURCES = ("selfgen", "jsonl", "parquet", "stdlib", "humaneval")


@dataclass
class DataConfig:
    # selfgen: random prompts, the target's own greedy responses (tiny targets, smoke runs).
    # jsonl / parquet: prompts from local files (`prompt` or `messages` field).
    # stdlib: functions/classes of the CPython standard library turned into completion prompts.
    source: str = "selfgen"
    paths: list[str] = field(default_factory=list)  # jsonl/parquet files (globs)
    code_dirs: list[str] = field(default_factory=list)  # stdlib: more *.py dirs, `site-packages`
    prompt_field: str = "prompt"  # row field with the prompt
    num_samples: int = 256  # samples to (re)generate
    prompt_len: int = 16  # selfgen prompt tokens
    response_len: int = 64  # max response tokens
    max_length: int = 256  # max tokens per sample
    too_long: str = "truncate"  # truncate | drop
    regen_batch_size: int = 32  # prompts per regen batch
    regen_temperature: float = 0.0  # 0: greedy responses
    regen_compact: bool = False  # CUDA static regen: ended rows leave the batch (GPU: unmeasured)
    regen_compile: bool = False  # CUDA static regen: torch.compile the one-token step, then graph
    # Minutes, then train on the samples done (batches in a seeded random order: a random subset)
    regen_time_limit_min: float | None = None
    seed: int = 1234  # data and order seed
    cache_dir: str | None = None  # default: <run_dir>/data
    # Pack samples first-fit into rows of this many tokens (None: one sample per row, padded).
    # The drafter's masks keep samples apart; the target packs its own (packed_capture).
    pack_to: int | None = None

    def validate(self) -> None:
        check_choice("data.source", self.source, DATA_SOURCES)
        check_choice("data.too_long", self.too_long, ("truncate", "drop"))
        if self.source in ("jsonl", "parquet") and not self.paths:
            raise ValueError(
                f"data.paths is empty for data.source={self.source}: set "
                "data.paths=[/path/prompts.jsonl] (rows with a 'prompt' or 'messages' "
                "field), or data=selfgen for the target's own text on random prompts"
            )
        check_positive(
            "data.regen_time_limit_min", self.regen_time_limit_min, " minutes (null: all)"
        )
        if self.pack_to is not None and self.pack_to < self.max_length:
            raise ValueError(
                f"data.pack_to={self.pack_to} is shorter than data.max_length="
                f"{self.max_length}: a full-length sample would not fit in a row; "
                "set data.pack_to >= data.max_length or null (no packing)"
            )
