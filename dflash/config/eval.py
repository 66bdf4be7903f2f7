"""Schema of the `eval` config group (conf/eval/): the in-loop and eval.py evaluation."""

from __future__ import annotations

from dataclasses import dataclass, field


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

    def validate(self) -> None:
        if self.real_decode_prompts < 0:
            raise ValueError(
                f"eval.real_decode_prompts must be >= 0, got {self.real_decode_prompts}"
            )
        for key in ("budgets", "decode_tree_budgets"):
            bad = [b for b in getattr(self, key) if b < 1]
            if bad:
                raise ValueError(f"eval.{key} must all be >= 1 (DDTree node budgets); got {bad}")
        if any(t < 0 for t in self.temperatures):
            raise ValueError(f"eval.temperatures must be >= 0, got {list(self.temperatures)}")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(
                f"eval.top_p={self.top_p} must be in (0, 1] and eval.top_k={self.top_k} >= 0"
            )
