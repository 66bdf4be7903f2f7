"""What a trainer rank loads of the target: its shape, embedding and lm_head (read alone from
the safetensors files, or kept from a random target built the workers' way), and the
fingerprint check that trainers and workers hold the same heads."""

from __future__ import annotations

import gc
import glob
import os

import torch
from torch import nn

from ...config import RunConfig
from ...target.capture import resolve_mask_token_id
from ...target.load import resolve_dtype, resolve_local_path
from ...target.shape import TargetShape, check_layer_ids, default_layer_ids
from ..build import build_target


class HeadsOnlyTarget:
    """What a trainer rank holds of the target: its shape and the frozen input embedding +
    lm_head. It has no decoder layers and cannot run a forward."""

    backend = "none (trainer: embedding + lm_head only)"

    def __init__(self, shape: TargetShape, embed: nn.Embedding, lm_head: nn.Linear, tokenizer, how):
        self.shape, self.embed_tokens, self.lm_head = shape, embed, lm_head
        self.tokenizer, self.how = tokenizer, how

    # the few fields the evaluation reads of any target
    @property
    def layer_ids(self) -> list[int]:
        return list(self.shape.layer_ids)

    @property
    def mask_token_id(self) -> int:
        return self.shape.mask_token_id

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device


_NOT_TEXT_HEADS = ("mtp", "visual", "vision", "audio")


def read_head_weights(path: str, tied: bool) -> tuple[torch.Tensor, torch.Tensor, tuple[str, str]]:
    """The input embedding and lm_head from a HF safetensors checkpoint, reading only those two
    tensors. Names are matched by suffix (`...embed_tokens.weight`, `lm_head.weight`), skipping
    multi-token-prediction and vision towers; tied (or absent) lm_head = the embedding."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"{path}: no *.safetensors files; trainer ranks read the target's "
            "embedding and lm_head from them"
        )
    where = {}
    for fn in files:
        with safe_open(fn, framework="pt") as f:
            for k in f.keys():
                where[k] = fn

    def pick(suffix: str) -> str | None:
        cands = [
            k
            for k in where
            if k.endswith(suffix) and not any(p.startswith(_NOT_TEXT_HEADS) for p in k.split("."))
        ]
        return min(cands, key=lambda k: (len(k), k)) if cands else None

    def get(key: str) -> torch.Tensor:
        with safe_open(where[key], framework="pt") as f:
            return f.get_tensor(key)

    ek = pick("embed_tokens.weight")
    if ek is None:
        raise ValueError(f"{path}: no '*embed_tokens.weight' tensor in {len(where)} weights")
    lk = None if tied else pick("lm_head.weight")
    emb = get(ek)
    return emb, (get(lk) if lk else emb), (ek, lk or ek)


def read_head_bias(path: str) -> torch.Tensor | None:
    """The lm_head's bias, for the rare target whose head has one (the drafter's logits are
    lm_head(h), bias included, as the target's)."""
    from safetensors import safe_open

    for fn in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(fn, framework="pt") as f:
            for k in f.keys():
                if k.endswith("lm_head.bias"):
                    return f.get_tensor(k)
    return None


def load_heads_only(cfg: RunConfig, device: torch.device) -> HeadsOnlyTarget:
    """Trainer-side target: from target.path only config, tokenizer, embedding and lm_head are
    read. A random target (target.config) has no files, so it is built (same seed, same device
    type as the workers) and only its embedding and lm_head are kept; heads_fingerprint checks
    that they match the workers' either way."""
    mtid = (
        cfg.drafter.mask_token_id
        if cfg.drafter.mask_token_id is not None
        else cfg.target.mask_token_id
    )
    if cfg.target.config is not None:
        t = build_target(cfg, device)
        heads = HeadsOnlyTarget(
            t.shape,
            t.embed_tokens,
            t.lm_head,
            t.tokenizer,
            "built the random target from target.config, kept embedding + lm_head",
        )
        del t
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return heads
    from transformers import AutoConfig, AutoTokenizer

    path = resolve_local_path(cfg.target)
    full = AutoConfig.from_pretrained(path)
    text = full.get_text_config()
    tied = bool(getattr(text, "tie_word_embeddings", getattr(full, "tie_word_embeddings", False)))
    emb_w, lm_w, names = read_head_weights(path, tied)
    dtype = resolve_dtype(cfg.target.dtype, device)
    embed = nn.Embedding.from_pretrained(emb_w.to(device, dtype), freeze=True)
    lm_b = read_head_bias(path)
    lm_head = nn.Linear(lm_w.shape[1], lm_w.shape[0], bias=lm_b is not None, device="meta")
    lm_head.weight = nn.Parameter(lm_w.to(device, dtype), requires_grad=False)
    if lm_b is not None:
        lm_head.bias = nn.Parameter(lm_b.to(device, dtype), requires_grad=False)
    tok = AutoTokenizer.from_pretrained(path)
    n = int(text.num_hidden_layers)
    ids = cfg.drafter.target_layer_ids
    ids = list(ids) if ids is not None else default_layer_ids(n, cfg.drafter.num_aux_layers)
    shape = TargetShape.from_hf_config(
        text,
        vocab_size=lm_w.shape[0],
        dtype=dtype,
        mask_token_id=resolve_mask_token_id(tok, lm_w.shape[0], mtid),
        layer_ids=check_layer_ids(ids, n),
    )
    return HeadsOnlyTarget(shape, embed, lm_head, tok, f"read {names[0]} + {names[1]} from {path}")


def heads_fingerprint(embed_w: torch.Tensor, lm_w: torch.Tensor) -> list:
    out = []
    for w in (embed_w.detach(), lm_w.detach()):
        total = sum(
            float(w[i : i + 4096].sum(dtype=torch.float64)) for i in range(0, w.shape[0], 4096)
        )
        rows = torch.tensor([0, w.shape[0] // 2, w.shape[0] - 1], device=w.device)
        out.append(
            (tuple(w.shape), str(w.dtype), total, w[rows, :8].double().cpu().flatten().tolist())
        )
    return out


def check_heads(mine: list, theirs: list) -> None:
    for name, a, b in zip(("embedding", "lm_head"), mine, theirs):
        same = (
            a[0] == b[0]
            and a[1] == b[1]
            and a[3] == b[3]
            and abs(a[2] - b[2]) <= 1e-6 * max(1.0, abs(b[2]))
        )
        if not same:
            raise ValueError(
                f"the trainer's target {name} differs from the workers' ({a[:3]} vs {b[:3]}): "
                "trainers and workers must load the same target (same target.* config, "
                "same device type for random targets)"
            )
