"""Schema of the `eval` config group (conf/eval/): the in-loop and eval.py evaluation."""

from __future__ import annotations

from dataclasses import dataclass, field

from .checks import check_at_least_one, check_choice
from .data import FORMATS

EVAL_SET_SOURCES = ("humaneval", "jsonl", "parquet", "hf", "stdlib", "selfgen")
# evaluation-time only, or display: they do not change an eval set (nor its cache's name); every
# other eval key does, so runs that differ in one score different text
EVAL_NOT_IN_SET_KEY = (
    "temperatures",
    "top_p",
    "top_k",
    "real_decode_prompts",
    "decode_tree_budgets",
    "show_rounds",
    "enabled",
    "tree_rules",  # which trees are scored on the set, not the set
)
# the value every run and eval set had before a key existed, where the key's default differs:
# eval.py restores it for a run config saved before the key (it scores the set the in-loop eval
# scored), and an eval set's cache name holds the key only when set otherwise
EVAL_BEFORE_THE_KEY = {"near_tie_rounds": 0}


@dataclass(frozen=True)
class TreeRule:
    """How a tree's node scores are built, for an offline A/B of trees (``eval.tree_rules``);
    the drafter's own rule is ``TreeRule()`` (its scores at its ``tree_temperature``: DFlash 1,
    DFlash2 1.5). Parsed from a name of ``_``-joined parts: ``t<T>`` puts the drafter's scores
    at temperature T before the softmax (a lower T spends the budget deeper along the likeliest
    tokens, a higher T wider), and ``coverage`` (DFlash2) scales each depth's candidate rows by
    the share of softmax(logits) its K candidates hold, which makes the selector's rows a
    distribution over the whole vocabulary. E.g. ``t1``, ``coverage_t1.5``."""

    name: str = ""
    temperature: float | None = None  # None: the drafter's own tree_temperature
    coverage: bool = False

    @classmethod
    def parse(cls, name: str) -> TreeRule:
        temperature, coverage = None, False
        for part in str(name).split("_"):
            if part == "coverage" and not coverage:
                coverage = True
                continue
            try:
                temperature = float(part[1:]) if part.startswith("t") else float("nan")
            except ValueError:
                temperature = float("nan")
            if not temperature > 0 or temperature == float("inf"):
                raise ValueError(
                    f"tree rule {name!r}: unknown part {part!r}; a rule is '_'-joined parts "
                    "t<T> (T > 0, the scores' temperature) and coverage, e.g. t0.7 or "
                    "coverage_t1.5"
                )
        return cls(str(name), temperature, coverage)


@dataclass
class EvalSetConfig:
    name: str = ""  # the set's figures: eval/<name>/tau, ... (console, metrics.jsonl, wandb, plot)
    source: str = "humaneval"  # humaneval | jsonl | parquet | hf (a prompt or conversation file) | stdlib | selfgen
    paths: list[str] = field(default_factory=list)  # the set's files (jsonl / parquet / hf)
    format: str = "auto"  # as data.format
    # false: the rows as given (refused at start when one is also a training conversation, by id
    # or content hash); true: the rows of this source that training does not use (a held-out slice)
    heldout: bool = False
    # first: the first user turn of each conversation | each: every user turn, each after the
    # target's own greedy answers to the earlier ones
    turns: str = "first"
    num_prompts: int | None = None  # prompts of this set (None: eval.num_prompts)
    # first | last: the set is the source's first or last rows (of those training does not use,
    # when heldout). last, which skips rows repeating an earlier row: the same rows for runs that
    # train on different shares of the file (read from its start); it reads the whole file
    rows: str = "first"
    # eval.py: real decoding on this set's first N prompts (None: eval.real_decode_prompts), so
    # one call can decode HumanEval for real and only score a held-out set offline
    real_decode_prompts: int | None = None


@dataclass
class EvalConfig:
    enabled: bool = True  # in-loop eval on/off
    num_prompts: int = 8  # eval prompts
    completion_len: int = 96  # greedy tokens per prompt
    budgets: list[int] = field(default_factory=lambda: [4, 8, 16, 32, 64])  # DDTree node budgets
    batch_size: int = 4  # prompts per batch
    seed: int = 4321  # eval prompt seed
    source: str | None = None  # None: the training source, rows training does not use
    paths: list[str] = field(default_factory=list)  # eval prompt files
    show_rounds: int = 2  # rounds printed per prompt in the table
    # eval/tau_t{T} (upper estimate) and tau_t{T}_lower (greedy-path lower bound) when sampling as
    # the reference does (dflash.decoding.rejection); top_p/top_k: target and drafter
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    top_p: float = 1.0  # nucleus (1.0: off)
    top_k: int = 0  # top-k (0: off)
    # eval.py: also decode the first N eval prompts for real: greedy AR / chain / tree speed and
    # == AR (dflash.eval.speed), and sampled at each temperature (dflash.eval.decode)
    real_decode_prompts: int = 0
    decode_tree_budgets: list[int] = field(default_factory=lambda: [64])  # its DDTree budgets
    # an offline A/B of how DDTree's trees are built: each rule's trees walked beside the
    # drafter's own (eval/rule/<name>/tau@<b>); names as TreeRule (above) parses
    # them: t<T> (the tree's scores at temperature T), coverage (DFlash2), e.g. [t0.7, coverage]
    tree_rules: list[str] = field(default_factory=list)
    # bf16 near-ties: a greedy completion is kept up to the first token where a one-shot forward
    # of the target parts from the batched decode. N > 0: a cut completion goes on from the
    # one-shot token, the rest generated again and checked again, up to N times (whole
    # completions, not mostly their early tokens; docs/evaluation.md#bf16-near-ties). 0: cut
    # there (every figure before 2026-12-07, afternoon; a run config without the key ran with 0).
    # Names the eval sets' cache when > 0.
    near_tie_rounds: int = 4
    # Named eval sets, each evaluated and reported on its own (eval/<name>/tau ...), e.g.
    # [{name: humaneval, source: humaneval}, {name: chat, source: jsonl, paths: [...], heldout: true}].
    # Empty: one set from eval.source / eval.paths (eval/tau ...)
    sets: list[EvalSetConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        # a run config read back from JSON (eval.py) or Hydra's containers hold plain dicts
        self.sets = [EvalSetConfig(**s) if isinstance(s, dict) else s for s in self.sets]

    def validate(self) -> None:
        self._validate_sets()
        off = {"num_prompts": " (eval.enabled=false turns the eval off)"}
        check_at_least_one("eval", self, "num_prompts completion_len batch_size", off)
        if self.near_tie_rounds < 0:
            raise ValueError(f"eval.near_tie_rounds must be >= 0, got {self.near_tie_rounds}")
        if self.real_decode_prompts < 0:
            raise ValueError(
                f"eval.real_decode_prompts must be >= 0, got {self.real_decode_prompts}"
            )
        for key in ("budgets", "decode_tree_budgets"):
            bad = [b for b in getattr(self, key) if b < 1]
            if bad:
                raise ValueError(f"eval.{key} must all be >= 1 (DDTree node budgets); got {bad}")
        rules = [TreeRule.parse(r).name for r in self.tree_rules]  # ValueError naming a bad one
        if len(set(rules)) < len(rules):
            raise ValueError(f"eval.tree_rules names a rule twice: {rules}")
        if any(t < 0 for t in self.temperatures):
            raise ValueError(f"eval.temperatures must be >= 0, got {list(self.temperatures)}")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(
                f"eval.top_p={self.top_p} must be in (0, 1] and eval.top_k={self.top_k} >= 0"
            )

    def _validate_sets(self) -> None:
        names = [s.name for s in self.sets]
        for i, s in enumerate(self.sets):
            key = f"eval.sets[{i}]"
            if not s.name or not s.name.replace("_", "").replace("-", "").isalnum():
                raise ValueError(
                    f"{key}.name={s.name!r}: name each eval set with letters, digits, _ or - "
                    "(its figures are eval/<name>/tau, ...)"
                )
            if s.name in names[:i]:
                raise ValueError(f"{key}.name={s.name!r} is used twice; names must be unique")
            check_choice(f"{key}.source", s.source, EVAL_SET_SOURCES)
            check_choice(f"{key}.format", s.format, FORMATS)
            check_choice(f"{key}.turns", s.turns, ("first", "each"))
            check_choice(f"{key}.rows", s.rows, ("first", "last"))
            if s.source in ("jsonl", "parquet", "hf") and not s.paths:
                raise ValueError(f"{key}.paths is empty for source={s.source}: name its files")
            if s.num_prompts is not None and s.num_prompts < 1:
                raise ValueError(f"{key}.num_prompts must be >= 1 or null, got {s.num_prompts}")
            if s.real_decode_prompts is not None and s.real_decode_prompts < 0:
                raise ValueError(
                    f"{key}.real_decode_prompts must be >= 0 or null (eval.real_decode_prompts), "
                    f"got {s.real_decode_prompts}"
                )
