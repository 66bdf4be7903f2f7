"""On-disk formats for regenerated data: responses streamed in shards, samples as flat arrays.

A partial regeneration is a directory: `key` (the prompts/settings fingerprint) and one
`shard_NNNNNN.npz` per finished batch (flat tokens + lengths), each written atomically. Appending
a batch writes only that batch (the old format re-pickled every response so far after every
batch). A finished dataset is a few flat tensors (tokens, masks, lengths, ids) in one torch
file instead of a pickled list of per-sample dicts of tiny tensors.
"""

from __future__ import annotations

import contextlib
import os
import shutil

import numpy as np
import torch

from ..common.storage import writing


class ResponseShards:
    def __init__(self, path: str):
        self.path = path

    def load(self, key: str | None, log=None) -> list[list[int]]:
        """The responses of finished batches, in order; [] (and the directory is cleared) when
        it was written for other prompts or settings, or has no key (a regeneration killed as it
        started). A shard that cannot be read ends the batches kept: it and the ones after it
        are regenerated. key=None: whatever is there."""
        say = log or (lambda *_: None)
        if not os.path.isdir(self.path):
            return []
        try:
            with open(os.path.join(self.path, "key")) as f:
                found = f.read().strip()
        except OSError:
            found = None
        if found is None or (key is not None and found != key):
            why = "written for other prompts or settings" if found else "it has no key file"
            say(f"data: starting over instead of resuming {self.path}: {why}")
            shutil.rmtree(self.path)
            return []
        out: list[list[int]] = []
        names = sorted(n for n in os.listdir(self.path) if n.endswith(".npz"))
        for index, name in enumerate(names):
            try:
                if name != f"shard_{index:06d}.npz":
                    raise ValueError(f"shard {index} is missing")
                with np.load(os.path.join(self.path, name)) as z:
                    ends = np.cumsum(z["lengths"])
                    out += (
                        [a.tolist() for a in np.split(z["tokens"], ends[:-1])] if len(ends) else []
                    )
            except Exception as e:  # noqa: BLE001 - numpy/zipfile raise many types
                say(
                    f"data: {self.path}/{name} is unreadable ({e}): regenerating from batch {index}"
                )
                for later in names[index:]:
                    os.remove(os.path.join(self.path, later))
                break
        return out

    def append(self, key: str, index: int, responses: list[list[int]]) -> None:
        os.makedirs(self.path, exist_ok=True)
        kpath = os.path.join(self.path, "key")
        if not os.path.exists(kpath):
            _atomic_write(kpath, lambda f: f.write(key.encode()))
        tokens = np.array([t for r in responses for t in r], dtype=np.int64)
        lengths = np.array([len(r) for r in responses], dtype=np.int64)
        _atomic_write(
            os.path.join(self.path, f"shard_{index:06d}.npz"),
            lambda f: np.savez(f, tokens=tokens, lengths=lengths),
        )

    def adopt_legacy_file(self, key: str, log=None) -> list[list[int]]:
        """A partial file of the older single-file format: its responses (when written for this
        key) become shard 0, and the file goes."""
        try:
            state = torch.load(self.path)
        except Exception:  # noqa: BLE001 - a damaged file: start over
            state = None
        os.remove(self.path)
        if not isinstance(state, dict) or state.get("key") != key:
            if log:
                log(f"data: ignoring {self.path}: written for other prompts or settings")
            return []
        done = list(state["responses"])
        if log:
            log(f"data: resuming regeneration at {len(done)} responses from {self.path}")
        if done:
            self.append(key, 0, done)
        return done

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _atomic_write(path: str, write) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with writing(path), open(tmp, "wb") as f:
            write(f)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    os.replace(tmp, path)


def pack_samples(samples: list) -> dict:
    """Samples -> flat tensors (one torch.save of a few arrays)."""
    out = {
        "format": "flat-v1",
        "sample_ids": torch.tensor([s.sample_id for s in samples], dtype=torch.long),
        "lengths": torch.tensor([s.input_ids.numel() for s in samples], dtype=torch.long),
        "input_ids": torch.cat([s.input_ids for s in samples]),
        "loss_mask": torch.cat([s.loss_mask for s in samples]),
    }
    if any(s.source for s in samples):  # data.mix: each sample's source
        out["sources"] = torch.tensor([s.source for s in samples], dtype=torch.long)
    return out


def unpack_samples(obj) -> list:
    from .batch import Sample

    if not (isinstance(obj, dict) and obj.get("format") == "flat-v1"):
        return [Sample(**s) for s in obj]  # the older list-of-dicts files
    lens = obj["lengths"].tolist()
    ids = torch.split(obj["input_ids"], lens)
    masks = torch.split(obj["loss_mask"], lens)
    sources = obj["sources"].tolist() if "sources" in obj else [0] * len(lens)
    return [
        Sample(int(i), a.clone(), m.clone(), src)
        for i, a, m, src in zip(obj["sample_ids"], ids, masks, sources)
    ]


def atomic_torch_save(obj, path: str) -> None:
    _atomic_write(path, lambda f: torch.save(obj, f))
