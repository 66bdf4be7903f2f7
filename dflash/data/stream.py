"""The order in which training reads samples: deterministic and resumable."""

from __future__ import annotations

import torch


class SampleStream:
    """Deterministic order (a fresh permutation per epoch) with a resumable position: the
    checkpoint stores how many samples were consumed, so a resumed run continues exactly."""

    def __init__(self, num_samples: int, seed: int, digest: str | None = None, origin: str = ""):
        """digest: an identity of the samples themselves (saved with the position, so a resume
        on a regenerated or edited dataset of the same size is refused); origin: where they are
        cached, for that message."""
        if num_samples < 1:
            raise ValueError("the dataset is empty")
        self.num_samples, self.seed, self.position = num_samples, seed, 0
        self.digest, self.origin = digest, origin
        self._perm_epoch, self._perm = -1, None

    def _index(self, pos: int) -> int:
        epoch = pos // self.num_samples
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.num_samples, generator=g), epoch
        return int(self._perm[pos % self.num_samples])

    def take(self, n: int) -> list[int]:
        out = self.peek(n)
        self.position += n
        return out

    def peek(self, n: int) -> list[int]:
        """The next n indices, without consuming them."""
        return [self._index(self.position + i) for i in range(n)]

    @property
    def epoch(self) -> float:
        return self.position / self.num_samples

    def state_dict(self) -> dict:
        return {
            "position": self.position,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "digest": self.digest,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["num_samples"] != self.num_samples:
            raise ValueError(
                f"resume: the checkpoint's stream had {state['num_samples']} samples, "
                f"this run's data has {self.num_samples}; resume with the same data config"
            )
        saved = state.get("digest")  # absent in checkpoints of older runs: nothing to compare
        if saved and self.digest and saved != self.digest:
            where = f" in {self.origin}" if self.origin else ""
            raise ValueError(
                f"resume: the samples{where} are not the ones the checkpoint trained on (digest "
                f"{self.digest}, saved {saved}): the dataset was regenerated or edited since; "
                "resume with the run's own data cache, or start a new run on this data"
            )
        self.position = int(state["position"])
