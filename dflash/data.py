"""Training data: prompt sources, target regeneration (the target's own responses), the
deterministic resumable sample stream.

Samples are token ids (prompt + response) with a loss mask on the response. Responses are the
target's own outputs, so the sequence's tokens and the target's greedy labels agree.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable, Optional

import torch
from tqdm.auto import tqdm

from .batch import Sample
from .config import DataConfig, TargetConfig


# ----------------------------------------------------------------------------- prompts
def random_prompts(num: int, length: int, vocab_size: int, exclude: Iterable[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    bad = torch.tensor(sorted(set(exclude)), dtype=torch.long)
    out = []
    for _ in range(num):
        p = torch.randint(0, vocab_size, (length,), generator=g)
        while bad.numel() and bool(torch.isin(p, bad).any()):
            m = torch.isin(p, bad)
            p[m] = torch.randint(0, vocab_size, (int(m.sum()),), generator=g)
        out.append(p.tolist())
    return out


def text_prompts(cfg: DataConfig) -> list:
    """Prompt strings or chat message lists from local jsonl/parquet files, or built-in corpora."""
    if cfg.source == "stdlib":
        from .corpora import stdlib_prompts
        return stdlib_prompts(cfg.num_samples, seed=cfg.seed)
    if cfg.source == "humaneval":
        from .corpora import humaneval_prompts
        return humaneval_prompts(cfg.paths[0] if cfg.paths else None)
    if not cfg.paths:
        raise ValueError(f"data.source={cfg.source} needs data.paths=[file, ...]")
    import datasets

    missing = [p for p in cfg.paths if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"data.paths: {missing} not found")
    kind = "json" if cfg.source == "jsonl" else "parquet"
    ds = datasets.load_dataset(kind, data_files=list(cfg.paths), split="train")
    field = cfg.prompt_field if cfg.prompt_field in ds.column_names else "messages"
    if field not in ds.column_names:
        raise ValueError(f"data rows need a {cfg.prompt_field!r} or 'messages' field; "
                         f"found {ds.column_names} (set data.prompt_field)")
    rows = ds[field][: cfg.num_samples]
    if not rows:
        raise ValueError(f"data.paths {list(cfg.paths)} hold no rows")
    return rows


def encode_prompts(prompts: list, tokenizer, tcfg: TargetConfig) -> list[list[int]]:
    """Apply the target's chat template exactly as configured (pitfall 6: the same function
    builds eval prompts)."""
    out = []
    for p in prompts:
        if tcfg.chat_template:
            if getattr(tokenizer, "chat_template", None) is None:
                raise ValueError("target.chat_template=true but the tokenizer has no chat template; "
                                 "set target.chat_template=false to use raw prompts")
            msgs = p if isinstance(p, list) else [{"role": "user", "content": p}]
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                enable_thinking=tcfg.enable_thinking)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            out.append(list(ids))
        else:
            text = p if isinstance(p, str) else "\n".join(m["content"] for m in p)
            out.append(tokenizer(text)["input_ids"])
    return out


# ----------------------------------------------------------------------------- regeneration
@torch.no_grad()
def generate_greedy(target, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
                    temperature: float = 0.0, desc: str = "regenerate", seed: int = 0,
                    partial_path: Optional[str] = None) -> list[list[int]]:
    """Batched generation with the target (left padding); resumable through `partial_path`."""
    model = target.model
    tok = target.tokenizer
    pad = (tok.pad_token_id if tok is not None and tok.pad_token_id is not None else
           (tok.eos_token_id if tok is not None else target.mask_token_id))
    eos = tok.eos_token_id if tok is not None else None
    done: list[list[int]] = []
    if partial_path and os.path.exists(partial_path):
        done = torch.load(partial_path)
    bar = tqdm(total=len(prompts), initial=len(done), desc=desc, unit="seq", leave=False,
               disable=os.environ.get("DFLASH_NO_PROGRESS") == "1")
    for i in range(len(done), len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        L = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), L), pad, dtype=torch.long)
        att = torch.zeros(len(chunk), L, dtype=torch.long)
        for r, p in enumerate(chunk):
            ids[r, L - len(p):] = torch.tensor(p)
            att[r, L - len(p):] = 1
        kw = dict(do_sample=False) if temperature <= 0 else dict(do_sample=True, temperature=temperature)
        torch.manual_seed(seed + i)
        out = model.generate(input_ids=ids.to(target.device), attention_mask=att.to(target.device),
                             max_new_tokens=max_new_tokens, min_new_tokens=1 if eos is None else 0,
                             pad_token_id=pad, eos_token_id=eos, **kw)
        for r in range(len(chunk)):
            resp = out[r, L:].tolist()
            if eos is not None and eos in resp:
                resp = resp[: resp.index(eos) + 1]
            done.append(resp)
        bar.update(len(chunk))
        if partial_path:
            _atomic_torch_save(done, partial_path)
    bar.close()
    return done


def _atomic_torch_save(obj, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def build_samples(prompts: list[list[int]], responses: list[list[int]], max_length: int,
                  too_long: str, id_offset: int = 0) -> tuple[list[Sample], dict]:
    samples, stats = [], {"truncated": 0, "dropped": 0, "empty_response": 0}
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids = list(p) + list(r)
        mask = [False] * len(p) + [True] * len(r)
        if not r:
            stats["empty_response"] += 1
            continue
        if len(ids) > max_length:
            if too_long == "drop":
                stats["dropped"] += 1
                continue
            stats["truncated"] += 1
            ids, mask = ids[:max_length], mask[:max_length]
            if not any(mask):
                stats["dropped"] += 1
                continue
        samples.append(Sample(id_offset + i, torch.tensor(ids, dtype=torch.long),
                              torch.tensor(mask, dtype=torch.bool)))
    if not samples:
        raise ValueError(f"the dataset is empty after filtering ({stats}); check data.paths, "
                         "data.max_length and data.too_long")
    return samples, stats


def data_fingerprint(dcfg: DataConfig, tcfg: TargetConfig, extra: str = "") -> str:
    key = json.dumps({"data": {k: v for k, v in vars(dcfg).items() if k != "cache_dir"},
                      "target": {k: v for k, v in vars(tcfg).items() if k not in ("device",)},
                      "extra": extra}, sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def load_or_build_dataset(dcfg: DataConfig, tcfg: TargetConfig, target, cache_dir: str,
                          log=print) -> list[Sample]:
    """Prompts -> the target's own responses -> samples; cached by a fingerprint of the configs."""
    os.makedirs(cache_dir, exist_ok=True)
    fp = data_fingerprint(dcfg, tcfg)
    path = os.path.join(cache_dir, f"train-{fp}.pt")
    if os.path.exists(path):
        samples = [Sample(**s) for s in torch.load(path)]
        log(f"data: {len(samples)} samples from cache {path}")
        return samples
    if dcfg.source == "selfgen":
        prompts = random_prompts(dcfg.num_samples, dcfg.prompt_len, target.vocab_size,
                                 [target.mask_token_id], dcfg.seed)
    else:
        if target.tokenizer is None:
            raise ValueError(f"data.source={dcfg.source} needs a target with a tokenizer")
        prompts = encode_prompts(text_prompts(dcfg), target.tokenizer, tcfg)
    responses = generate_greedy(target, prompts, dcfg.response_len, dcfg.regen_batch_size,
                                dcfg.regen_temperature, partial_path=path + ".partial", seed=dcfg.seed)
    samples, stats = build_samples(prompts, responses, dcfg.max_length, dcfg.too_long)
    log(f"data: {len(samples)} samples regenerated by the target ({stats})")
    _atomic_torch_save([vars(s) for s in samples], path)
    if os.path.exists(path + ".partial"):
        os.remove(path + ".partial")
    return samples


# ----------------------------------------------------------------------------- stream
class SampleStream:
    """Deterministic order (a fresh permutation per epoch) with a resumable position: the
    checkpoint stores how many samples were consumed, so a resumed run continues exactly."""

    def __init__(self, num_samples: int, seed: int):
        if num_samples < 1:
            raise ValueError("the dataset is empty")
        self.num_samples, self.seed, self.position = num_samples, seed, 0
        self._perm_epoch, self._perm = -1, None

    def _index(self, pos: int) -> int:
        epoch = pos // self.num_samples
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.num_samples, generator=g), epoch
        return int(self._perm[pos % self.num_samples])

    def take(self, n: int) -> list[int]:
        out = [self._index(self.position + i) for i in range(n)]
        self.position += n
        return out

    @property
    def epoch(self) -> float:
        return self.position / self.num_samples

    def state_dict(self) -> dict:
        return {"position": self.position, "num_samples": self.num_samples, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["num_samples"] != self.num_samples:
            raise ValueError(f"resume: the checkpoint's stream had {state['num_samples']} samples, "
                             f"this run's data has {self.num_samples}; resume with the same data config")
        self.position = int(state["position"])
