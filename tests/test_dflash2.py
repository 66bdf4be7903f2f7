"""DFlash2 as z-lab's reference (`DFlash2DraftModel`, 2026) runs it.

An exported DFlash2 checkpoint loads strictly into `RefDFlash2`, an independent implementation
written here from the reference's equations (transformers' Qwen3 pieces and raw tensors; no
dflash module), with the key mapping the reference's `from_pretrained` applies. Along real chain
decoding on a tiny target the two draft the same blocks at T=0 (100+ rounds) with logits within
1e-5 in fp32, and our `generate_chain` emits the reference loop's drafts and tokens. A published
DFlash2 directory (written here as z-lab ships them) is reported by eval.py.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, get_target, target_cfg
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from dflash.config import DrafterConfig
from dflash.decoding import generate_ar, generate_chain
from dflash.decoding.steps import DrafterState
from dflash.drafter.checkpoint import load_drafter, save_drafter
from dflash.drafter.spec import resolve_spec
from dflash.drafter.variants import build_model

BLOCK = 6


# ----------------------------------------------------------------------------- the reference
def _dv(c, name, default=None):
    """The reference's precedence: dflash_config first, then the top level."""
    return (getattr(c, "dflash_config", None) or {}).get(name, getattr(c, name, default))


class RefAttention(nn.Module):
    def __init__(self, c, i):
        super().__init__()
        self.d = c.head_dim
        b = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * self.d, bias=b)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * self.d, bias=b)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * self.d, bias=b)
        self.o_proj = nn.Linear(c.num_attention_heads * self.d, c.hidden_size, bias=b)
        self.q_norm = Qwen3RMSNorm(self.d, eps=c.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.d, eps=c.rms_norm_eps)
        kind = c.layer_types[i]
        forced = getattr(c, "is_causal", None)
        self.is_causal = kind == "sliding_attention" if forced is None else bool(forced)
        self.window = c.sliding_window if kind == "sliding_attention" else None

    def forward(self, x, ctx, cos, sin):
        Q, T = x.shape[1], ctx.shape[1]
        q = self.q_norm(self.q_proj(x).view(1, Q, -1, self.d)).transpose(1, 2)
        k = torch.cat([self.k_proj(ctx), self.k_proj(x)], 1).view(1, T + Q, -1, self.d)
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)], 1).view(1, T + Q, -1, self.d)
        k, v = self.k_norm(k).transpose(1, 2), v.transpose(1, 2)
        cq, sq = cos[:, None, -Q:], sin[:, None, -Q:]
        q = q * cq + rotate_half(q) * sq
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        qpos = T + torch.arange(Q)[:, None]  # the reference's _attention_mask
        kpos = torch.arange(T + Q)[None, :]
        see = torch.ones(Q, T + Q, dtype=torch.bool)
        if self.is_causal:
            see &= kpos <= qpos
        if self.window is not None:
            see &= qpos - kpos < self.window
            if not self.is_causal:
                see &= kpos - qpos < self.window
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = (q @ k.transpose(-1, -2)) * self.d**-0.5
        att = scores.masked_fill(~see, float("-inf")).softmax(-1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(1, Q, -1))


def _ref_convolve(hidden, dynamic, base, group_size):
    batch, length, hidden_size = hidden.shape
    groups = hidden_size // group_size
    blocks = hidden.view(batch, length, groups, group_size)
    dynamic = dynamic.reshape(batch, length, base.shape[0], groups, 1)
    out = torch.zeros_like(blocks)
    for offset in range(base.shape[0]):
        values = blocks if offset == 0 else F.pad(blocks[:, :-offset], (0, 0, 0, 0, offset, 0))
        out = out + base[offset].view(1, 1, groups, group_size) * values
        out = torch.addcmul(out, dynamic[:, :, offset], values)
    return out.view_as(hidden)


class RefConv(nn.Module):
    def __init__(self, hidden, kernel, group):
        super().__init__()
        self.kernel, self.group = kernel, group
        self.base_kernel = nn.Parameter(torch.empty(2, kernel, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * (hidden // group), bias=False)

    def prepare(self, x):
        dyn = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel, -1)
        y = _ref_convolve(x, dyn[..., 0, :, :], self.base_kernel[0], self.group)
        return y, dyn[..., 1, :, :]

    def finish(self, y, dyn):
        return _ref_convolve(y, dyn, self.base_kernel[1], self.group)


class RefLayer(nn.Module):
    def __init__(self, c, i):
        super().__init__()
        self.self_attn = RefAttention(c, i)
        self.mlp = Qwen3MLP(c)
        self.input_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        args = (c.hidden_size, int(_dv(c, "conv_kernel_size")), int(_dv(c, "conv_group_size")))
        self.attention_conv, self.mlp_conv = RefConv(*args), RefConv(*args)

    def forward(self, x, ctx, cos, sin):
        res = x
        x, dyn = self.attention_conv.prepare(self.input_layernorm(x))
        x = res + self.attention_conv.finish(self.self_attn(x, ctx, cos, sin), dyn)
        res = x
        x, dyn = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return res + self.mlp_conv.finish(self.mlp(x), dyn)


class RefSelector(nn.Module):
    def __init__(self, c):
        super().__init__()
        rank, self.top_k = int(_dv(c, "selector_rank")), int(_dv(c, "selector_top_k"))
        self.predecessor_codebook = nn.Embedding(c.vocab_size, rank)
        self.successor_codebook = nn.Embedding(c.vocab_size, rank)
        self.hidden_projection = nn.Linear(c.hidden_size, rank, bias=False)

    def select(self, hidden, logits, anchor_ids):  # temperature 0
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        hidden = self.hidden_projection(hidden)
        predecessor, path = anchor_ids, []
        for t in range(hidden.shape[1]):
            scores = unary[:, t] + torch.einsum(
                "br,bkr->bk",
                self.predecessor_codebook(predecessor) * hidden[:, t],
                self.successor_codebook(candidates[:, t]),
            )
            predecessor = candidates[:, t].gather(-1, scores.argmax(-1)[:, None])[:, 0]
            path.append(predecessor)
        return torch.stack(path, 1)


class RefDFlash2(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.layers = nn.ModuleList(RefLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(c)
        ids = _dv(c, "target_layer_ids")
        self.fc = nn.Linear(len(ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.candidate_selector = RefSelector(c)

    @classmethod
    def from_pretrained(cls, path):
        c = Qwen3Config(**json.load(open(os.path.join(path, "config.json"))))
        ref = cls(c)
        mapping = {
            f"candidate_selector.{n}": f"candidate_selector.{n}.weight"
            for n in ("predecessor_codebook", "successor_codebook")
        }
        sd = {
            mapping.get(k, k): v.float() for k, v in load_file(f"{path}/model.safetensors").items()
        }
        ref.load_state_dict(sd, strict=True)
        return ref

    def logits(self, hidden, W):
        logits = hidden @ W.t() * float(_dv(self.c, "output_multiplier", 1.0))
        cap = _dv(self.c, "final_logit_softcapping")
        return torch.tanh(logits / cap) * cap if cap is not None and cap > 0 else logits

    @torch.no_grad()
    def draft(self, embed, W, aux_TF, start, bonus):
        """One block of dflash_generate at T=0: (path [D], logits [D, V])."""
        B, mask = int(_dv(self.c, "block_size")), int(_dv(self.c, "mask_token_id"))
        ids = torch.tensor([[bonus] + [mask] * (B - 1)])
        x = embed(ids) * float(_dv(self.c, "input_embedding_scale", 1.0))
        ctx = self.hidden_norm(self.fc(aux_TF[None, :start]))
        cos, sin = self.rotary_emb(x, torch.arange(start + B)[None])
        for layer in self.layers:
            x = layer(x, ctx, cos, sin)
        h = self.norm(x)[:, 1:]
        logits = self.logits(h, W)
        return self.candidate_selector.select(h, logits, ids[:, 0])[0], logits[0]


# ----------------------------------------------------------------------------- helpers
def _dflash2(target, seed=0, **over):
    kw = dict(
        variant="dflash2",
        num_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        target_layer_ids=list(target.layer_ids),
        block_size=BLOCK,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=24,
        selector_top_k=5,
        input_embedding_scale=1.25,
        output_multiplier=0.8,
        final_logit_softcapping=20.0,
    )
    d = build_model(resolve_spec(DrafterConfig(**{**kw, **over}), target.shape))
    d.init_weights(0.05, torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # off the identity start: convolutions and selector must matter
        for n, p in d.named_parameters():
            if "_conv." in n or n.startswith("candidate_selector."):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return d


def _aux_and_greedy(target, ids):
    out = target.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i + 1][0] for i in target.layer_ids], -1)
    return aux, out.logits[0].argmax(-1)


# ----------------------------------------------------------------------------- tests
def test_export_loads_into_the_reference_and_drafts_the_same_blocks(tmp_path):
    target = get_target("tiny_llama")
    d = _dflash2(target)
    save_drafter(str(tmp_path), d, dtype=torch.float32)
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    dc = cfg["dflash_config"]
    assert {k: dc[k] for k in ("conv_kernel_size", "conv_group_size")} == {
        "conv_kernel_size": 2,
        "conv_group_size": 16,
    }
    assert (dc["selector_rank"], dc["selector_top_k"]) == (24, 5)
    stored = load_file(str(tmp_path / "model.safetensors"))
    H, V = target.hidden_size, target.vocab_size
    assert stored["candidate_selector.predecessor_codebook"].shape == (V, 24)  # no ".weight"
    assert stored["candidate_selector.hidden_projection.weight"].shape == (24, H)
    assert stored["layers.1.mlp_conv.base_kernel"].shape == (2, 2, H)
    assert stored["layers.0.attention_conv.kernel_projection.weight"].shape == (2 * 2 * H // 16, H)
    ref = RefDFlash2.from_pretrained(str(tmp_path))  # strict: same names, same shapes
    ours, rep = load_drafter(str(tmp_path))
    assert not rep["missing"] and not rep["skipped"]

    W, embed = target.lm_head.weight.float(), target.embed_tokens
    prompt = list(range(3, 19))
    n_new = 110
    ids, rounds, worst = list(prompt), [], 0.0
    aux, greedy = _aux_and_greedy(target, ids)
    ids.append(int(greedy[-1]))
    ds = DrafterState(target, ours)
    ds.append(aux)
    while len(ids) - len(prompt) < n_new:  # the reference's dflash_generate at T=0
        start, bonus = len(ids) - 1, ids[-1]
        path, ref_logits = ref.draft(embed, W, aux, start, bonus)
        our_logits = ds.draft_logits(start, bonus)
        worst = max(worst, (our_logits - ref_logits).abs().max().item())
        assert torch.equal(ds.draft(start, bonus)[0], path), len(rounds)
        block = ids + path.tolist()
        aux_all, greedy = _aux_and_greedy(target, block)
        acc = int((path == greedy[start : start + BLOCK - 1]).long().cumprod(0).sum())
        acc = min(acc, n_new - (len(ids) - len(prompt)))
        ids += path[:acc].tolist() + [int(greedy[start + acc])]
        aux = aux_all[: len(ids) - 1]
        ds.append(aux_all[start : start + acc + 1])
        rounds.append((path.tolist(), acc))
    assert len(rounds) >= 100 and worst < 1e-5, (len(rounds), worst)
    # what chain decoding does with the exported drafter: the reference loop's drafts and text
    res = generate_chain(target, ours, prompt, n_new)
    assert res.drafts == [r[0] for r in rounds] and res.accepted == [r[1] for r in rounds]
    assert res.tokens == ids[len(prompt) :] == generate_ar(target, prompt, n_new).tokens


def test_selector_path_is_not_the_per_position_argmax():
    """The T=0 draft follows the selector: with a strong pairwise term it differs from the
    logits' argmax (the test above would pass vacuously otherwise)."""
    target = get_target("tiny_llama")
    d = _dflash2(target)
    ds = DrafterState(target, d)
    aux, greedy = _aux_and_greedy(target, list(range(3, 40)))
    differ = 0
    for start in range(5, 35):
        ds.ctx_kv, ds.T = None, 0
        ds.append(aux[:start])
        differ += int(not torch.equal(ds.draft(start, 7)[0], ds.draft_logits(start, 7).argmax(-1)))
    assert differ > 0


def test_fresh_dflash2_drafts_as_dflash_with_the_same_seed():
    target = get_target("tiny_llama")
    over = dict(layer_types=["full_attention"], num_layers=1)
    dcfg = DrafterConfig(
        num_layers=1,
        layer_types=["full_attention"],
        target_layer_ids=list(target.layer_ids),
        block_size=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
    )
    plain = build_model(resolve_spec(dcfg, target.shape))
    plain.init_weights(0.05, torch.Generator().manual_seed(3))
    fresh = build_model(
        resolve_spec(DrafterConfig(**{**vars(dcfg), **over, "variant": "dflash2"}), target.shape)
    )
    fresh.init_weights(0.05, torch.Generator().manual_seed(3))
    for k, v in plain.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    prompt = list(range(5, 21))
    a, b = generate_chain(target, plain, prompt, 24), generate_chain(target, fresh, prompt, 24)
    assert a.drafts == b.drafts and a.tokens == b.tokens


def _published_dir(path, target, dtype=torch.bfloat16):
    """A DFlash2 directory as z-lab publishes them (tests/fixtures/dflash2-*.json of z-lab/dflash:
    top-level is_causal, softcapping and output multiplier in dflash_config, bf16 weights, codebooks
    without `.weight`), at the tiny target's size."""
    H, V, L = target.hidden_size, target.vocab_size, target.layer_ids
    cfg = {
        "architectures": ["DFlash2DraftModel"],
        "attention_bias": False,
        "is_causal": False,
        "dflash_config": {
            "block_size": 8,
            "conv_group_size": 16,
            "conv_kernel_size": 2,
            "final_logit_softcapping": 20.0,
            "mask_token_id": target.mask_token_id,
            "output_multiplier": 0.5,
            "selector_rank": 16,
            "selector_top_k": 8,
            "target_layer_ids": list(L),
        },
        "dtype": "bfloat16",
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": H,
        "intermediate_size": 96,
        "layer_types": ["sliding_attention", "sliding_attention"],
        "max_position_embeddings": 4096,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "num_target_layers": target.num_layers,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "sliding_window": 2048,
        "tie_word_embeddings": False,
        "use_cache": False,
        "use_sliding_window": True,
        "vocab_size": V,
    }
    ref = RefDFlash2(Qwen3Config(**cfg))
    g = torch.Generator().manual_seed(0)
    sd = {}
    for k, v in ref.state_dict().items():
        w = (
            1 + 0.05 * torch.randn(v.shape, generator=g)
            if "norm" in k
            else torch.randn(v.shape, generator=g) * 0.05
        )
        sd[k.removesuffix(".weight") if "_codebook" in k else k] = w.to(dtype).contiguous()
    os.makedirs(path, exist_ok=True)
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    save_file(sd, os.path.join(path, "model.safetensors"))
    return path


def test_published_dflash2_directory_loads_strictly(tmp_path):
    target = get_target("tiny_llama")
    path = _published_dir(str(tmp_path / "pub"), target)
    d, rep = load_drafter(path)
    assert type(d).__name__ == "DFlash2Drafter" and not rep["missing"] and not rep["skipped"]
    assert d.spec.is_causal is False and d.spec.final_logit_softcapping == 20.0
    # a transformers save of the reference names the codebooks ".weight": also read
    sd = load_file(os.path.join(path, "model.safetensors"))
    sd = {(k + ".weight" if k.endswith("_codebook") else k): v for k, v in sd.items()}
    save_file(sd, os.path.join(path, "model.safetensors"))
    d2, rep2 = load_drafter(path)
    assert not rep2["missing"] and not rep2["skipped"]
    assert torch.equal(
        d2.candidate_selector.successor_codebook, d.candidate_selector.successor_codebook
    )


def test_eval_cli_reports_a_published_dflash2_directory(tmp_path):
    target = get_target("tiny_llama")
    path = _published_dir(str(tmp_path / "pub"), target)
    out = tmp_path / "rep.json"
    r = subprocess.run(
        [
            sys.executable,
            "eval.py",
            f"ckpt={path}",
            "target=tiny_llama",
            f"out={out}",
            f"eval_dir={tmp_path}/ev",
            "logger=none",
            "eval=smoke",
            "eval.num_prompts=2",
            "eval.completion_len=24",
            "eval.budgets=[4,64]",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "DFlash2DraftModel" in r.stdout
    rep = json.load(open(out))
    assert {"tau", "dds@64", "acc_pos_1"} <= set(rep["summary"]) and rep["summary"]["tau"] >= 1.0


def test_packed_blocks_draft_as_blocks_alone():
    """The convolutions stay inside each block: the evaluation / training pass over every anchor
    at once (blocks packed side by side) drafts, per anchor, what decoding drafts for that block
    alone, selector path and tree rows included; the path is the tree's chain of best children."""
    from dflash.decoding.ddtree import TreeRows
    from dflash.eval.offline import draft_all_anchors
    from dflash.eval.sets import EvalItem
    from dflash.target.shape import Heads

    target = get_target("tiny_llama")
    d = _dflash2(target)
    ids = list(range(3, 33))
    aux, _ = _aux_and_greedy(target, ids)
    P = 10
    item = EvalItem(torch.tensor(ids[:P]), torch.tensor(ids[P:]), aux)
    heads = Heads(target.embed_tokens, target.lm_head)
    packed, rows, _ = draft_all_anchors(d, heads, item, top_k=4, anchor_chunk=7)
    assert isinstance(rows, TreeRows) and rows.cand.shape[:2] == packed.shape
    ds = DrafterState(target, d)
    for i in range(len(ids) - P):
        ds.ctx_kv, ds.T = None, 0
        ds.append(aux[: P + i])
        assert torch.equal(packed[i], ds.draft(P + i, ids[P + i])[0]), i
        with torch.no_grad():
            h = ds.draft_hidden(P + i, ids[P + i])[None]
            scored = d.tree_scores(
                h, d.logits(h, target.lm_head.weight), torch.tensor([ids[P + i]])
            )
        alone = TreeRows.from_scores(*scored)
        assert torch.equal(rows.cand[i], alone.cand[0]), i
        assert torch.allclose(rows.logprobs[i], alone.logprobs[0], atol=1e-5), i
        pc, best = 0, []
        for t in range(packed.shape[1]):
            pc = int(rows.order[i, t, pc, 0])
            best.append(int(rows.cand[i, t, pc]))
        assert best == packed[i].tolist(), i


def test_offline_tau_equals_real_chain_decoding():
    """eval's offline walk over the selector's paths is what chain decoding accepts, round by
    round (tiny target; the trained version of this is the slow train.py test)."""
    from dflash.eval.metrics import walk_chain
    from dflash.eval.offline import draft_all_anchors
    from dflash.eval.sets import EvalItem
    from dflash.target.shape import Heads

    target = get_target("tiny_llama")
    d = _dflash2(target)
    prompt = list(range(3, 19))
    ar = generate_ar(target, prompt, 48)
    aux, _ = _aux_and_greedy(target, prompt + ar.tokens)
    item = EvalItem(torch.tensor(prompt), torch.tensor(ar.tokens), aux)
    draft, _, _ = draft_all_anchors(d, Heads(target.embed_tokens, target.lm_head), item, top_k=0)
    walk = walk_chain(draft, item.completion_ids)
    real = generate_chain(target, d, prompt, 48)
    assert real.tokens == ar.tokens and walk.accepted == real.accepted


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen3_5"])
def test_offline_tree_equals_real_tree_decoding(name):
    """eval's DDTree over the selector's rows accepts what tree decoding (the same tree, built
    by DrafterState.draft_tree) accepts, round by round, at two budgets; the tokens are the
    target's greedy ones. A DFlash2 drafter pushed towards the truth (OracleDrafter: streaks,
    decoys that only a tree branch recovers, misses), so the trees accept."""
    from dflash.decoding import generate_tree
    from dflash.eval.offline import evaluate
    from dflash.eval.sets import consistent_greedy
    from dflash.target.shape import Heads
    from dflash.tools.testing import OracleDrafter

    target = get_target(name)
    heads = Heads(target.embed_tokens, target.lm_head)
    prompt = list(range(3, 19))
    ar = generate_ar(target, prompt, 40)
    item = consistent_greedy(target, prompt, ar.tokens)
    L = item.completion_ids.numel()
    truth = prompt + item.completion_ids.tolist()
    d = OracleDrafter(_dflash2(target), target.lm_head.weight, truth, pattern="mixed", seed=3)
    reps, summary = evaluate(d, heads, [item], [4, 16])
    for b in (4, 16):
        real = generate_tree(target, d, prompt, L, b)
        assert real.tokens == item.completion_ids.tolist()
        assert real.accepted == reps[0].trees[b].accepted, (b, real.accepted)
    assert sum(reps[0].trees[16].accepted) > sum(reps[0].chain.accepted) > 0


def test_sampled_decoding_at_t0_is_chain_decoding():
    from dflash.decoding import Sampling, sample_chain

    target = get_target("tiny_llama")
    d = _dflash2(target)
    prompt = list(range(7, 20))
    ch = generate_chain(target, d, prompt, 30)
    sc = sample_chain(target, d, prompt, 30, Sampling(0.0, top_p=0.5, seed=3))
    assert sc.tokens == ch.tokens and sc.accepted == ch.accepted and sc.drafts == ch.drafts


def test_sampled_path_is_drawn_from_its_q_rows():
    """At T > 0 the path's token k is a draw from q_k = softmax(scores / T) over position k's
    candidates given the token drawn before it (the rows rejection sampling divides by): q_k
    equals the teacher-forced proposal at the drawn prefix, and the first position's draws
    follow q_1 (total variation within a bound a correct sampler exceeds w.p. <= 1e-5)."""
    from collections import Counter

    from dflash.decoding import Sampling

    target = get_target("tiny_llama")
    d = _dflash2(target, selector_top_k=4)
    ds = DrafterState(target, d)
    aux, _ = _aux_and_greedy(target, list(range(3, 25)))
    ds.append(aux[:20])
    with torch.no_grad():
        s = Sampling(1.5)
        h = ds.draft_hidden(20, 9)[None]
        logits = d.logits(h, target.lm_head.weight)
        gen = torch.Generator().manual_seed(0)
        firsts = Counter()
        n = 1500
        for _ in range(n):
            path, q = d.propose(h, logits, torch.tensor([9]), s, gen)
            prev = torch.cat([torch.tensor([[9]]), path[:, :-1]], 1)
            assert torch.allclose(q, d.proposal(h, logits, prev, s), atol=1e-6)
            assert (q.gather(-1, path[..., None]) > 0).all() and torch.allclose(
                q.sum(-1), torch.ones(1)
            )
            firsts[int(path[0, 0])] += 1
        q1 = {i: float(p) for i, p in enumerate(q[0, 0]) if p > 0}
        tv = 0.5 * sum(abs(q1.get(k, 0) - firsts.get(k, 0) / n) for k in set(q1) | set(firsts))
        bound = 0.5 * sum((p * (1 - p) / n) ** 0.5 for p in q1.values()) + (11.5 / (2 * n)) ** 0.5
    assert len(q1) == 4 and tv < bound, (tv, bound)


def test_eval_tau_t_follows_the_selector(tiny_qwen):
    """tau_t{T} of a DFlash2 drafter: 1 + mean over the greedy walk's rounds of
    sum_k prod_{i<=k} sum_x min(p_i, q_i), q_i the selector's softmax(scores / T) on position i's
    top-K candidates with the completion's token before it, computed here by hand."""
    from dflash.decoding.rejection import overlap, warp
    from dflash.eval.metrics import walk_chain
    from dflash.eval.offline import draft_all_anchors, evaluate
    from dflash.eval.sets import consistent_greedy
    from dflash.target.shape import Heads

    d = _dflash2(tiny_qwen, selector_top_k=6)
    heads = Heads(tiny_qwen.embed_tokens, tiny_qwen.lm_head)
    prompt = list(range(40, 48))
    comp = generate_ar(tiny_qwen, prompt, 14).tokens
    item = consistent_greedy(tiny_qwen, prompt, comp)
    _, summary = evaluate(d, heads, [item], [], temperatures=[0.0, 0.8])
    assert summary["tau_t0"] == summary["tau"]
    draft, _, _ = draft_all_anchors(d, heads, item, top_k=0)
    walk = walk_chain(draft, item.completion_ids)
    P, c = len(prompt), item.completion_ids
    ids = torch.cat([item.prompt_ids, c])
    sel = d.candidate_selector
    with torch.no_grad():
        p_logits = tiny_qwen.model(ids[None]).logits[0].float()
        total = 0.0
        for s, avail in zip(walk.anchors, walk.available):
            ds = DrafterState(tiny_qwen, d)
            ds.append(item.aux_TF[: P + s])
            h = ds.draft_hidden(P + s, int(c[s]))
            logits = d.logits(h, heads.lm_head.weight)
            survive = 1.0
            for k in range(1, avail + 1):
                unary, cand = logits[k - 1].topk(6)
                gate = sel.predecessor_codebook[int(c[s + k - 1])] * (
                    sel.hidden_projection.weight @ h[k - 1]
                )
                scores = unary + sel.successor_codebook[cand] @ gate
                q = torch.zeros_like(logits[k - 1]).scatter(0, cand, (scores / 0.8).softmax(0))
                survive *= float(overlap(warp(p_logits[P + s + k - 1], 0.8), q))
                total += survive
    ref = 1 + total / len(walk.anchors)
    assert summary["tau_t0.8"] == pytest.approx(ref, rel=1e-4)


def _train(tmp_path, name, *over):
    r = subprocess.run(
        [sys.executable, "train.py", f"out_root={tmp_path}", f"run_name={name}", "logger=none"]
        + list(over),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return [x for x in map(json.loads, open(tmp_path / name / "metrics.jsonl")) if "eval/tau" in x]


@pytest.mark.slow
def test_default_job_learns_dflash2_and_its_offline_tau_is_chain_decoding(tmp_path, default_job):
    """`python train.py drafter.variant=dflash2` (the default 200 steps on the tiny target): tau
    rises from 1 at least as much as the DFlash default does; eval.py's offline tau on the final
    checkpoint is what real chain decoding accepts, prompt by prompt."""
    metrics = open(default_job / "metrics.jsonl")
    dflash = [x for x in map(json.loads, metrics) if "eval/tau" in x]
    dflash2 = _train(tmp_path, "d2", "drafter.variant=dflash2")
    assert dflash2[0]["step"] == 0 and dflash2[0]["eval/tau"] < 1.2
    assert dflash2[-1]["step"] == 200 and dflash2[-1]["eval/tau"] >= dflash[-1]["eval/tau"], (
        dflash2[-1]["eval/tau"],
        dflash[-1]["eval/tau"],
    )
    out = tmp_path / "rep.json"
    ck = tmp_path / "d2" / "checkpoints" / "step_00000200"
    r = subprocess.run(
        [
            sys.executable,
            "eval.py",
            f"ckpt={ck}",
            f"out={out}",
            f"eval_dir={tmp_path}/ev",
            "logger=none",
            "eval.real_decode_prompts=8",
            "eval.decode_tree_budgets=[4]",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.load(open(out))["summary"]
    assert s["tau"] == pytest.approx(dflash2[-1]["eval/tau"], abs=1e-9)  # in-loop == eval.py
    assert s["decode_identical_chain"] == 8 and s["tau"] > 2
    assert s["decode_tau_chain"] == pytest.approx(s["decode_offline_tau_chain"], abs=1e-12)


def test_the_variant_names_are_one_list():
    from dflash.config.model import DRAFTER_VARIANTS
    from dflash.drafter.variants import VARIANTS

    assert tuple(VARIANTS) == DRAFTER_VARIANTS


@pytest.mark.parametrize(
    "group,over,match",
    [
        ("drafter", dict(variant="dflash3"), r"drafter.variant='dflash3' is not allowed"),
        ("drafter", dict(selector_top_k=0), "drafter.selector_top_k must be >= 1"),
        ("spec", dict(variant="dflash2", conv_group_size=48), "conv_group_size=48"),
        ("run", dict(loss="variable_prefix", prefix_min=8), "train.prefix_min=8"),
        ("train", dict(loss="dpace", label_sampling="by_weight"), "label_sampling=by_weight"),
        ("train", dict(dpace_alpha=1.5), "train.dpace_alpha"),
        ("trainer", dict(loss="soft_kl", allow_soft_loss=True), "soft_kl with drafter.variant"),
    ],
)
def test_bad_family_settings_are_refused_by_name(group, over, match):
    from dflash.config import RunConfig, TrainConfig
    from dflash.target.shape import Heads
    from dflash.train.step import DrafterTrainer

    target = get_target("tiny_llama")
    with pytest.raises(ValueError, match=match) as e:
        if group == "drafter":
            DrafterConfig(**over).validate()
        elif group == "spec":
            resolve_spec(DrafterConfig(**over), target.shape)
        elif group == "train":
            TrainConfig(**over).validate()
        elif group == "run":
            tc, dc = target_cfg("tiny_llama"), DrafterConfig(block_size=8)
            RunConfig(target=tc, drafter=dc, train=TrainConfig(**over)).validate()
        else:
            heads = Heads(target.embed_tokens, target.lm_head)
            d = _dflash2(target)
            DrafterTrainer(d, heads, TrainConfig(**over), torch.device("cpu"))
    assert "\n" not in str(e.value)
