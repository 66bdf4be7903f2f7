"""Drafter semantics: reference computation, no future leak, block isolation, masks."""

import math

import pytest
import torch
from conftest import make_drafter

from dflash.drafter.blocks import block_attention_mask, build_blocks, candidate_anchors, mask_rules
from dflash.drafter.model import DFlashDrafter
from dflash.target.shape import TargetShape

torch.manual_seed(0)


def _row(T=24, vocab=512, F_=384, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab - 1, (1, T), generator=g)
    aux = torch.randn(1, T, F_, generator=g)
    pos = torch.arange(T)[None]
    seg = torch.zeros(1, T, dtype=torch.long)
    return ids, aux, pos, seg


def _forward(drafter, embed, ids, aux, pos, seg, anchors):
    spec = drafter.spec
    valid = torch.ones_like(anchors, dtype=torch.bool)
    blk = build_blocks(
        ids,
        pos,
        seg,
        anchors,
        valid,
        spec.block_size,
        spec.mask_token_id,
        mask_rules(spec),
    )
    h = drafter(embed(blk.block_ids_NQ), blk.block_pos_NQ, blk.masks, aux_NTF=aux, ctx_pos_NT=pos)
    return h.view(anchors.shape[1], spec.block_size, -1)


def _reference(drafter: DFlashDrafter, embed, ids, aux, anchors):
    """Plain per-anchor loop: each block alone, explicit key list and eager softmax attention."""
    spec = drafter.spec
    B, d = spec.block_size, spec.head_dim
    outs = []
    for a in anchors[0].tolist():
        ctx = drafter.hidden_norm(drafter.fc(aux[0, :a]))  # context strictly before a
        ctx_pos = torch.arange(a)
        x = embed(torch.tensor([ids[0, a].item()] + [spec.mask_token_id] * (B - 1)))
        qpos = a + torch.arange(B)
        for layer in drafter.layers:
            att = layer.self_attn
            hn = layer.input_layernorm(x)

            def heads(t, n):
                return t.view(t.shape[0], n, d).transpose(0, 1)

            def rope(t, p):
                inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2).float() / d))
                fr = p.float()[:, None] * inv
                cos, sin = torch.cat([fr, fr], -1).cos(), torch.cat([fr, fr], -1).sin()
                t1, t2 = t[..., : d // 2], t[..., d // 2 :]
                return t * cos + torch.cat([-t2, t1], -1) * sin

            q = rope(att.q_norm(heads(att.q_proj(hn), att.num_heads)), qpos)
            keys_src = torch.cat([ctx, hn])
            kpos = torch.cat([ctx_pos, qpos])
            k = rope(att.k_norm(heads(att.k_proj(keys_src), att.num_kv)), kpos)
            v = heads(att.v_proj(keys_src), att.num_kv)
            rep = att.num_heads // att.num_kv
            k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
            allowed = torch.ones(B, a + B, dtype=torch.bool)
            if layer.layer_type == "sliding_attention":
                allowed[:, a:] = torch.tril(torch.ones(B, B, dtype=torch.bool))
                allowed &= (qpos[:, None] - kpos[None, :]) < spec.sliding_window
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
            scores = scores.masked_fill(~allowed, float("-inf"))
            o = (scores.softmax(-1) @ v).transpose(0, 1).reshape(B, -1)
            x = x + att.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        outs.append(drafter.norm(x))
    return torch.stack(outs)


@pytest.mark.parametrize("window", [64, 5])
def test_forward_matches_reference(window):
    torch.manual_seed(1)
    drafter = _drafter(window=window)
    embed = torch.nn.Embedding(512, 128)
    ids, aux, pos, seg = _row()
    anchors = torch.tensor([[3, 7, 8, 15, 20]])
    got = _forward(drafter, embed, ids, aux, pos, seg, anchors)
    ref = _reference(drafter, embed, ids, aux, anchors)
    assert torch.allclose(got, ref, atol=2e-5), (got - ref).abs().max()


def _drafter(window=64, block_size=4):
    class T:  # minimal stand-in carrying what make_drafter reads
        layer_ids = [1, 3, 5]
        shape = TargetShape(8, 128, 512, 256, 4, 2, torch.float32, 511, (1, 3, 5))

    return make_drafter(T, block_size=block_size, window=window)


def test_no_future_leak_and_block_isolation():
    drafter = _drafter()
    embed = torch.nn.Embedding(512, 128)
    ids, aux, pos, seg = _row()
    anchors = torch.tensor([[5, 9, 14]])
    base = _forward(drafter, embed, ids, aux, pos, seg, anchors)
    a = 9
    # features at or after the anchor, and tokens after it, must not change block a (nor earlier)
    aux2, ids2 = aux.clone(), ids.clone()
    aux2[:, a:] += torch.randn_like(aux2[:, a:]) * 3
    ids2[:, a + 1 :] = (ids2[:, a + 1 :] + 7) % 500
    out = _forward(drafter, embed, ids2, aux2, pos, seg, anchors)
    assert torch.equal(out[0], base[0]) and torch.equal(out[1], base[1])
    assert not torch.allclose(out[2], base[2])  # the later block does see the changed context
    # changing one block's anchor token changes only that block
    ids3 = ids.clone()
    ids3[0, 14] = (ids3[0, 14] + 1) % 500
    out3 = _forward(drafter, embed, ids3, aux, pos, seg, anchors)
    assert torch.equal(out3[0], base[0]) and torch.equal(out3[1], base[1])
    assert not torch.allclose(out3[2], base[2])
    # the context just before the anchor is visible (a leak test that cannot pass vacuously)
    aux4 = aux.clone()
    aux4[:, a - 1] += 1.0
    assert not torch.allclose(_forward(drafter, embed, ids, aux4, pos, seg, anchors)[1], base[1])


def test_masks_rules():
    anchors = torch.tensor([[4, 6]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    T, B = 10, 3
    pos = torch.arange(T)[None]
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, -1]])
    full = block_attention_mask(anchors, valid, pos, seg, B, causal_in_block=False, window=None)[
        0, 0
    ]
    causal = block_attention_mask(anchors, valid, pos, seg, B, causal_in_block=True, window=None)[
        0, 0
    ]
    # query (anchor 4, i) sees context 3 only (same sample, < 4); anchor 6 sees 3,4,5
    assert full[0, :T].nonzero().flatten().tolist() == [3]
    assert full[B, :T].nonzero().flatten().tolist() == [3, 4, 5]
    # own block only; causal variant lower-triangular
    assert full[0, T:].tolist() == [True] * B + [False] * B
    assert causal[1, T:].tolist() == [True, True, False] + [False] * B
    win = block_attention_mask(anchors, valid, pos, seg, B, causal_in_block=True, window=2)[0, 0]
    # query pos 6+0 with window 2 sees context positions > 4 only: {5}
    assert win[B, :T].nonzero().flatten().tolist() == [5]


def test_candidate_anchors_respect_samples():
    seg = torch.tensor([[0, 0, 0, 0, 1, 1, 1, -1]])
    lm = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 0]], dtype=torch.bool)
    c = candidate_anchors(seg, lm)[0].nonzero().flatten().tolist()
    # a=1 is a prompt token (never an anchor at inference); a=2 -> 3; a=4 is a sample start; a=5 -> 6
    assert c == [2, 5]
