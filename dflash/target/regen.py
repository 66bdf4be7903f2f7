"""Batched greedy regeneration without HF `generate`: a static KV cache and the whole one-token
step (forward, argmax, cache/mask/position update) captured once in a CUDA graph and replayed.

Legend: B rows, P prompt length (left padded), L = P + new tokens (the static cache length).

HF `generate` at batch 256 on a small target is bound by Python and kernel launches (a fresh
mask, cache bookkeeping and logits processors per token); a replayed graph costs one launch per
token. Same greedy tokens as `generate` (same left padding, positions and masking); rows are
cut after their first EOS exactly as data._generate_batch does. Rows that have ended leave the
batch as it goes (compaction, see StaticGreedyDecoder), so late steps decode fewer rows.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .fused import fused_decoding

PACKED_GQA = "dflash_sdpa_packed_gqa"


def supports_static(model) -> bool:
    """Attention-only decoders (Llama, Qwen2, Qwen3...): every layer's cache is a plain KV cache.
    Hybrid targets (Gated DeltaNet) keep HF `generate`."""
    types = getattr(model.config, "layer_types", None) or ["full_attention"]
    return all(t == "full_attention" for t in types) and not hasattr(
        model.config, "linear_num_key_heads"
    )


def packed_gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
    """SDPA for one query token with grouped KV heads, without `repeat_kv`: the G query heads that
    share a KV head become G query rows of that head ([B, Hq, 1, D] -> [B, Hkv, G, D]), so the
    kernel reads the cache once. transformers 5.17 (the GPU machine's) copies every layer's
    whole cache G times per decoded token when a mask is given, and a left-padded batch always
    has one: ~1.4 GB per layer per token for Qwen2.5-0.5B at batch 512 and 768 positions
    (transformers 5.24 packs the same way). Anything else goes to HF's sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    one_mask = attention_mask is None or (
        attention_mask.dim() == 4 and attention_mask.shape[1] == 1
    )
    if query.shape[2] != 1 or groups == 1 or not one_mask or kw.get("position_bias") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw
        )
    B, Hq, _, D = query.shape
    out = F.scaled_dot_product_attention(
        query.reshape(B, Hq // groups, groups, D),
        key,
        value,
        attn_mask=attention_mask,  # [B, 1, 1, L]: the same row for every head and group
        dropout_p=dropout,
        scale=scaling,
    )
    return out.reshape(B, Hq, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def packed_gqa_decoding(model):
    """Within: a sdpa model's one-token steps run `packed_gqa_sdpa` (prefill is unchanged)."""
    cfg = model.config
    if getattr(cfg, "_attn_implementation", None) != "sdpa":
        yield
        return
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    # looked up per call, so a test can spy on it
    AttentionInterface.register(PACKED_GQA, lambda *a, **kw: packed_gqa_sdpa(*a, **kw))
    AttentionMaskInterface.register(PACKED_GQA, sdpa_mask)
    cfg._attn_implementation = PACKED_GQA
    try:
        yield
    finally:
        cfg._attn_implementation = "sdpa"


class StaticGreedyDecoder:
    """`run` decodes one left-padded batch (B rows).

    compact: ended rows leave the batch. At every EOS check (each `check_every` steps, one host
    sync), once at most `shrink` of the current batch is still decoding and the batch has more
    than `min_rows` rows, the live rows are gathered into a smaller batch: the static cache's K/V of
    every layer, the per-row state (token, position, mask) and the token rows; finished rows'
    tokens go to the output first. On CUDA a new graph is captured for the smaller batch (the
    old one is dropped). A row attends only to its own cache row, so the tokens are the same.
    Below ~min_rows rows a step is bound by reading the weights, not the rows' cache, so a
    smaller batch would not pay for its capture. shrink 3/4 rather than 1/2: when many rows run
    to max_new (a geometric or capped length distribution), 1/2 is reached late or never; a
    capture costs about two eager steps. `stretches`: [rows, steps] per batch size.
    """

    def __init__(
        self,
        model,
        use_graph: bool = True,
        compile: bool = False,
        compact: bool = False,
        check_every: int = 32,
        min_rows: int = 64,
        shrink: float = 0.75,
        fuse: bool = False,
    ):
        # compile: torch.compile the step first (fuses the norms / RoPE / SiLU kernels that bound
        # a small model's decode step), then capture the compiled step in the graph.
        self.model, self.use_graph, self.compile = model, use_graph, compile
        self.compact, self.check_every, self.min_rows = compact, check_every, min_rows
        self.shrink, self.fuse = shrink, fuse  # fuse: fused_decoding (prefill and every step)
        self.stretches: list[list[int]] = []
        self.graph_used = False

    @torch.no_grad()
    def run(self, ids_BP: torch.Tensor, att_BP: torch.Tensor, max_new: int, eos: int | None):
        with packed_gqa_decoding(self.model), fused_decoding(self.model, self.fuse):
            return self._run(ids_BP, att_BP, max_new, eos)

    def _run(self, ids_BP: torch.Tensor, att_BP: torch.Tensor, max_new: int, eos: int | None):
        from transformers import StaticCache

        from .cache import cache_kw

        model, dev = self.model, ids_BP.device
        B, P = ids_BP.shape
        L = P + max_new
        cache = StaticCache(config=model.config, max_cache_len=L)
        ckw = {cache_kw(model): cache}  # `cache` (transformers >= 5.24) or `past_key_values`
        valid = torch.zeros(B, L, dtype=torch.bool, device=dev)
        valid[:, :P] = att_BP.bool()
        # Prefill: causal over real tokens; a padding query sees itself so its (unused) row of
        # attention stays finite.
        k_L = torch.arange(L, device=dev)
        q_P = torch.arange(P, device=dev)
        causal = k_L[None, :] <= q_P[:, None]
        mask = (causal[None] & valid[:, None, :]) | (k_L[None, None, :] == q_P[None, :, None])
        pos = (att_BP.long().cumsum(-1) - 1).masked_fill(att_BP == 0, 1)
        out = model(
            input_ids=ids_BP,
            attention_mask=mask[:, None],
            position_ids=pos,
            **ckw,
            cache_position=q_P,
            use_cache=True,
            logits_to_keep=1,
        )
        # -1, never a token id: the EOS check below reads whole rows, and an empty buffer can
        # hold an earlier batch's tokens (a reused allocator block), EOS included
        tokens_BT = torch.full((B, max_new), -1, dtype=torch.long, device=dev)
        st = {  # per-row state (rows of the current batch) and shared counters
            "tokens": tokens_BT,  # the current batch's token rows (tokens_BT until compacted)
            "rows": torch.arange(B, device=dev),  # current row -> row of tokens_BT
            "tok": out.logits[:, -1].argmax(-1)[:, None].clone(),
            "pos": pos[:, -1:] + 1,
            "valid": valid,
            "cpos": torch.full((1,), P, dtype=torch.long, device=dev),
            "t": torch.zeros(1, dtype=torch.long, device=dev),
        }
        tokens_BT[:, 0] = st["tok"][:, 0]
        st["valid"][:, P] = True

        def step():
            o = model(
                input_ids=st["tok"],
                attention_mask=st["valid"][:, None, None, :],
                position_ids=st["pos"],
                **ckw,
                cache_position=st["cpos"],
                use_cache=True,
            )
            nxt = o.logits[:, -1].argmax(-1)
            st["t"] += 1
            st["tokens"].index_copy_(1, st["t"], nxt[:, None])
            st["tok"].copy_(nxt[:, None])
            st["pos"] += 1
            st["cpos"] += 1
            st["valid"].index_fill_(1, st["cpos"], True)

        if self.compile:
            step = _compiled(step)
        self.graph_used, self.stretches = False, []
        done, replay = 1, None  # tokens decoded per row; the step for the current batch
        while done < max_new:
            if replay is None:
                replay, warm = self._replay(step, dev, max_new - done)
                done += warm
                self.stretches.append([len(st["rows"]), warm])
            replay()
            done += 1
            self.stretches[-1][1] += 1
            if eos is None or (done - 1) % self.check_every or done == max_new:
                continue
            live = ~(st["tokens"] == eos).any(-1)
            n_live = int(live.sum())
            if n_live == 0:
                break  # every row has ended: the rest would be cut anyway
            if self.compact and len(live) > self.min_rows and n_live <= self.shrink * len(live):
                self._compact(cache, st, tokens_BT, live.nonzero()[:, 0])
                replay = None  # dropping the old graph frees its memory pool
        _write_back(st, tokens_BT)
        return tokens_BT

    def _replay(self, step, dev, n_steps: int):
        """(the step to repeat for the current batch, steps already run): on CUDA a captured
        graph, after one eager warm-up step (it decodes a token; on the first batch it also sizes
        the cache and compiles a compiled step)."""
        if not (self.use_graph and dev.type == "cuda" and n_steps > 1):
            return step, 0
        step()
        try:
            replay = self._capture(step)
            self.graph_used = True
            return replay, 1
        except RuntimeError as e:  # a model whose step cannot be captured runs eagerly
            print(f"warning: CUDA graph capture failed ({e}); decoding eagerly", flush=True)
            torch.cuda.synchronize()
            return step, 1

    @staticmethod
    def _compact(cache, st: dict, tokens_BT: torch.Tensor, keep: torch.Tensor) -> None:
        """Keep only rows `keep` of the batch (ended rows' tokens are written out first)."""
        _write_back(st, tokens_BT)
        for k in ("tokens", "rows", "tok", "pos", "valid"):
            st[k] = st[k].index_select(0, keep)
        for layer in cache.layers:  # one layer at a time: the old K/V go before the next
            if getattr(layer, "is_initialized", False):
                layer.keys = layer.keys.index_select(0, keep)
                layer.values = layer.values.index_select(0, keep)
                layer.batch_size = len(keep)

    @staticmethod
    def _capture(step):
        """Capture one step (recording does not run it), so replays continue the decode."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        return graph.replay


def _write_back(st: dict, tokens_BT: torch.Tensor) -> None:
    """The current batch's token rows into their rows of the output (once compacted)."""
    if st["tokens"] is not tokens_BT:
        tokens_BT.index_copy_(0, st["rows"], st["tokens"])


def _compiled(step):
    """The step compiled once for every batch size B and cache length L: dynamic shapes, without
    duck sizing (which would tie B to L or to max_new when they happen to be equal in the first
    batch, and recompile at the next batch or compaction)."""
    from torch.fx.experimental import _config as fx_config

    fn = torch.compile(step, dynamic=True)

    def run():
        with fx_config.patch(use_duck_shape=False):
            fn()

    return run


def left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad, dtype=torch.long)
    att = torch.zeros(len(prompts), P, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, P - len(p) :] = torch.tensor(p)
        att[r, P - len(p) :] = 1
    return ids, att


def cut_at_eos(tokens_BT: torch.Tensor, eos: int | None) -> list[list[int]]:
    out = []
    for resp in tokens_BT.tolist():
        if eos is not None and eos in resp:
            resp = resp[: resp.index(eos) + 1]
        out.append(resp)
    return out


def static_greedy_batch(
    target, chunk: list[list[int]], max_new_tokens: int, pad: int, eos, **decoder_kw
):
    """Greedy responses for one batch of prompts (the static-cache path of data._generate_batch)."""
    ids, att = left_pad(chunk, pad)
    dec = StaticGreedyDecoder(target.model, **decoder_kw)
    toks = dec.run(ids.to(target.device), att.to(target.device), max_new_tokens, eos)
    return cut_at_eos(toks, eos)


def hf_generate_batch(
    target, chunk: list[list[int]], max_new_tokens: int, pad: int, eos, temperature: float = 0.0
):
    """The same batch through HF `generate` (the reference the static path is checked against);
    temperature > 0 samples instead (seeded by the caller)."""
    ids, att = left_pad(chunk, pad)
    how = dict(do_sample=True, temperature=temperature) if temperature > 0 else {"do_sample": False}
    out = target.model.generate(
        input_ids=ids.to(target.device),
        attention_mask=att.to(target.device),
        max_new_tokens=max_new_tokens,
        min_new_tokens=1 if eos is None else 0,
        pad_token_id=pad,
        eos_token_id=eos,
        **how,
    )
    return cut_at_eos(out[:, ids.shape[1] :], eos)
