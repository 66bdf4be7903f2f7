"""Schema of the `data` config group (conf/data/): where prompts come from and how the target
regenerates them."""

from __future__ import annotations

from dataclasses import dataclass, field

from .checks import check_at_least_one, check_choice, check_positive

DATA_SOURCES = ("selfgen", "jsonl", "parquet", "hf", "stdlib", "humaneval", "mix")
FILE_SOURCES = ("jsonl", "parquet", "hf")  # rows read from data.paths
FORMATS = ("auto", "sharegpt", "openai", "prompt")
TURNS = ("all", "first", "last")
ANSWERS = ("regenerate", "given")


@dataclass
class MixSourceConfig:
    name: str = ""  # the source's name in the log and run config (its share of samples and tokens)
    weight: float = 1.0  # share of the samples (weights are normalised over data.mix)
    source: str = "jsonl"  # as data.source: jsonl | parquet | hf | stdlib
    paths: list[str] = field(default_factory=list)  # as data.paths
    format: str = "auto"  # as data.format
    prompt_field: str = "prompt"  # as data.prompt_field
    code_dirs: list[str] = field(default_factory=list)  # as data.code_dirs (source=stdlib)


@dataclass
class DataConfig:
    # selfgen: random prompts, the target's own greedy responses (tiny targets, smoke runs).
    # jsonl / parquet / hf: prompts or conversations from local files (docs/data.md: ShareGPT,
    # OpenAI messages, plain prompts; hf: a `save_to_disk` directory, json/jsonl/parquet/arrow
    # files read by `datasets`, or a hub name). stdlib: functions/classes of the CPython standard
    # library turned into completion prompts. mix: the named sources of data.mix.
    source: str = "selfgen"
    paths: list[str] = field(default_factory=list)  # jsonl/parquet/hf files (globs) or directories
    code_dirs: list[str] = field(default_factory=list)  # stdlib: more *.py dirs, `site-packages`
    prompt_field: str = "prompt"  # row field with the prompt
    # Row format: auto (each row by its fields: `conversations` ShareGPT, `messages` OpenAI,
    # data.prompt_field a plain prompt) | sharegpt | openai | prompt (every row must be that one)
    format: str = "auto"
    # Conversations with several user turns: all (the target answers every user turn in order,
    # each after its own earlier answers; one sample per conversation, cut at turn boundaries to
    # data.max_length) | first (the first user turn only) | last (the last user turn, after the
    # row's own earlier turns)
    turns: str = "all"
    # turns=all: answer at most this many user turns of a conversation (null: every one that fits
    # data.max_length); the later turns' rounds are small batches that each pay a whole decode
    max_turns: int | None = None
    # regenerate: the target answers every user turn itself | given: the rows' own assistant
    # turns are the answers, for data the target already answered elsewhere (vLLM, SGLang: same
    # chat template, greedy); a row without them (a bare prompt, a stdlib stub, a conversation
    # whose first user turn has no answer) is regenerated. train/greedy_agreement says how many
    # response tokens are the target's own greedy tokens (docs/data.md)
    answers: str = "regenerate"
    # data.source=mix: named sources and their weights (shares of data.num_samples), e.g.
    # [{name: sharegpt, weight: 0.7, source: jsonl, paths: [...]}, {name: code, weight: 0.3, source: stdlib}]
    mix: list[MixSourceConfig] = field(default_factory=list)
    hf_split: str = "train"  # data.source=hf: the split of a hub dataset or a saved DatasetDict
    num_samples: int = 256  # samples to (re)generate
    prompt_len: int = 16  # selfgen prompt tokens
    response_len: int = 64  # max response tokens
    max_length: int = 256  # max tokens per sample
    too_long: str = "truncate"  # truncate | drop
    regen_batch_size: int = 32  # prompts per regen batch
    regen_temperature: float = 0.0  # 0: greedy responses
    # CUDA static regen: ended rows leave the batch (H200 bench: 0.92x with random weights,
    # 1.20-1.34x with Qwen2.5's real weights on random prompts; not in a real run yet)
    regen_compact: bool = False
    regen_compile: bool = False  # CUDA static regen: torch.compile the one-token step, then graph
    # CUDA static regen: the target's RMSNorm / RoPE / SiLU-gate chains one compiled kernel each
    # (a small model's decode step is mostly such short kernels; H200 bench, Qwen2.5-0.5B:
    # 1.32x at batch 512, 1.26x at 1024; eager's bf16 rounding since, and each chain's first
    # call checked against eager; not in a real run yet)
    regen_fuse: bool = False
    # Minutes, then train on the samples done (batches in a seeded random order: a random subset)
    regen_time_limit_min: float | None = None
    seed: int = 1234  # data and order seed
    cache_dir: str | None = None  # default: <run_dir>/data
    # Pack samples first-fit into rows of this many tokens (None: one sample per row, padded).
    # The drafter's masks keep samples apart; the target packs its own (packed_capture).
    pack_to: int | None = None

    def __post_init__(self) -> None:
        # a run config read back from JSON (eval.py) or Hydra's containers hold plain dicts
        self.mix = [MixSourceConfig(**m) if isinstance(m, dict) else m for m in self.mix]

    def validate(self) -> None:
        check_choice("data.source", self.source, DATA_SOURCES)
        check_choice("data.too_long", self.too_long, ("truncate", "drop"))
        check_choice("data.format", self.format, FORMATS)
        check_choice("data.turns", self.turns, TURNS)
        check_choice("data.answers", self.answers, ANSWERS)
        if self.answers == "given" and self.source in ("selfgen", "stdlib", "humaneval"):
            raise ValueError(
                f"data.answers=given takes the answers from the rows of data.paths, and "
                f"data.source={self.source} has no answers: use data.source=jsonl|parquet|hf|mix "
                "or data.answers=regenerate"
            )
        if self.answers == "given" and self.regen_temperature > 0:
            raise ValueError(
                "data.answers=given stands for the target's greedy answers; "
                f"data.regen_temperature={self.regen_temperature} asks for sampled ones: set "
                "data.regen_temperature=0 or data.answers=regenerate"
            )
        if self.source in FILE_SOURCES and not self.paths:
            raise ValueError(
                f"data.paths is empty for data.source={self.source}: set "
                "data.paths=[/path/prompts.jsonl] (ShareGPT, OpenAI messages or prompt rows: "
                "docs/data.md), or data=selfgen for the target's own text on random prompts"
            )
        if (self.source == "mix") != bool(self.mix):
            raise ValueError(
                "data.mix needs data.source=mix and data.source=mix needs data.mix: set both "
                "(data.source=mix data.mix=[{name: a, weight: 0.7, source: jsonl, paths: [...]}, "
                "...]) or neither"
            )
        self._validate_mix()
        check_at_least_one("data", self, "num_samples response_len max_length regen_batch_size")
        check_positive(
            "data.regen_time_limit_min", self.regen_time_limit_min, " minutes (null: all)"
        )
        if self.max_turns is not None and (
            int(self.max_turns) != self.max_turns or self.max_turns < 1
        ):
            raise ValueError(
                f"data.max_turns must be a whole number >= 1 or null (every turn), got {self.max_turns}"
            )
        if self.pack_to is not None and self.pack_to < self.max_length:
            raise ValueError(
                f"data.pack_to={self.pack_to} is shorter than data.max_length="
                f"{self.max_length}: a full-length sample would not fit in a row; "
                "set data.pack_to >= data.max_length or null (no packing)"
            )

    def _validate_mix(self) -> None:
        names = [m.name for m in self.mix]
        for i, m in enumerate(self.mix):
            key = f"data.mix[{i}]"
            if not m.name or not m.name.replace("_", "").replace("-", "").isalnum():
                raise ValueError(
                    f"{key}.name={m.name!r}: give each source a name of letters, digits, _ or -"
                )
            if m.name in names[:i]:
                raise ValueError(f"{key}.name={m.name!r} is used twice; names must be unique")
            check_choice(f"{key}.source", m.source, ("jsonl", "parquet", "hf", "stdlib"))
            check_choice(f"{key}.format", m.format, FORMATS)
            if not m.weight > 0:
                raise ValueError(
                    f"{key}.weight must be > 0 (a share of the samples), got {m.weight}"
                )
            if m.source in FILE_SOURCES and not m.paths:
                raise ValueError(f"{key}.paths is empty for source={m.source}: name its files")
