"""Every config.json field the z-lab reference drafter (2026) reads changes our drafts exactly as
it changes the reference's.

Each case writes a checkpoint carrying the field (config.json + model.safetensors), loads it with
`dflash.drafter.checkpoint.load_drafter`, and compares our logits -- through the training/eval block
machinery and through decoding's cached-context drafting -- with `_eager`, an independent
per-anchor implementation written here from the fields' definitions (raw tensors, no dflash
modules). Refusals: unknown architectures, a DFlash2 config without its fields, and DFlash2
fields under `DFlashDraftModel` never run as something else.
"""

import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from dflash.drafter.blocks import build_blocks, mask_rules
from dflash.drafter.checkpoint import load_drafter, save_drafter
from dflash.drafter.spec import DrafterSpec

H, NH, NKV, D, I, V, MASK = 32, 4, 2, 8, 48, 64, 63
T_LEN = 20


def _base_cfg(**over):
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": H,
        "intermediate_size": I,
        "num_hidden_layers": 2,
        "num_attention_heads": NH,
        "num_key_value_heads": NKV,
        "head_dim": D,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 64,
        "vocab_size": V,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 6,
        "use_sliding_window": True,
        "block_size": 4,
        "num_target_layers": 4,
        "dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": MASK},
    }
    dc = over.pop("dflash_config", {})
    cfg.update(over)
    cfg["dflash_config"] = {**cfg["dflash_config"], **dc}
    return cfg


def _tensors(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.3  # noqa: E731
    ones = lambda n: 1 + 0.1 * torch.randn(n, generator=g)  # noqa: E731
    t = {"fc.weight": r(H, 2 * H), "hidden_norm.weight": ones(H), "norm.weight": ones(H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes = {"q_proj": (NH * D, H), "k_proj": (NKV * D, H), "v_proj": (NKV * D, H)}
        shapes["o_proj"] = (H, NH * D)
        for n, s in shapes.items():
            t[p + f"self_attn.{n}.weight"] = r(*s)
            if cfg.get("attention_bias"):
                t[p + f"self_attn.{n}.bias"] = r(s[0])
        t[p + "self_attn.q_norm.weight"] = ones(D)
        t[p + "self_attn.k_norm.weight"] = ones(D)
        t[p + "mlp.gate_proj.weight"] = r(I, H)
        t[p + "mlp.up_proj.weight"] = r(I, H)
        t[p + "mlp.down_proj.weight"] = r(H, I)
        t[p + "input_layernorm.weight"] = ones(H)
        t[p + "post_attention_layernorm.weight"] = ones(H)
    return t


def _write(path, cfg, tensors):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return str(path)


# ----------------------------------------------------------------------------- the eager reference
def _inv_freq(cfg):
    """(inv_freq [D/2], attention factor) from the rope fields' definitions."""
    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    base = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = rp.get("rope_type", rp.get("type", "default"))
    inv = 1.0 / base ** (torch.arange(0, D, 2).double() / D)
    if kind in ("default", "dynamic"):  # dynamic: unchanged below max_position_embeddings
        return inv, 1.0
    factor = rp["factor"]
    if kind == "linear":  # positions / factor
        return inv / factor, 1.0
    if kind == "llama3":
        old, lo, hi = (
            rp["original_max_position_embeddings"],
            rp["low_freq_factor"],
            rp["high_freq_factor"],
        )
        out = []
        for f in inv.tolist():
            wl = 2 * math.pi / f
            if wl < old / hi:
                out.append(f)
            elif wl > old / lo:
                out.append(f / factor)
            else:
                s = (old / wl - lo) / (hi - lo)
                out.append((1 - s) * f / factor + s * f)
        return torch.tensor(out, dtype=torch.float64), 1.0
    assert kind == "yarn"
    orig = rp["original_max_position_embeddings"]

    def dim_for(rot):  # the rotary dim whose wavelength makes `rot` turns over `orig` tokens
        return D * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(dim_for(32)), 0), min(math.ceil(dim_for(1)), D - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(D // 2).double() - low) / (high - low)).clamp(0, 1)
    extrap = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    return inv / factor * (1 - extrap) + inv * extrap, 0.1 * math.log(factor) + 1.0


_ACT = {
    "silu": F.silu,
    "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),
    "relu": torch.relu,
}


def _eager(cfg, t, embed_W, lm_W, ids, aux, anchors, lm_b=None):
    """Per anchor, one block alone: logits [A, B-1, V] from config.json's definitions: the block
    embeddings are rows of the target's table, the logits the target's head (with its bias)."""
    dc = cfg["dflash_config"]
    knob = lambda k, d=None: dc.get(k, cfg.get(k, d))  # noqa: E731
    B = int(knob("block_size", 16))
    eps = cfg["rms_norm_eps"]
    inv, att = _inv_freq(cfg)
    window = cfg["sliding_window"] if cfg.get("use_sliding_window") else None
    act = _ACT[cfg.get("hidden_act", "silu")]
    t = {k: v.double() for k, v in t.items()}

    def lin(x, name):
        y = x @ t[name + ".weight"].t()
        return y + t[name + ".bias"] if name + ".bias" in t else y

    def rms(x, w):
        return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rope(x, pos):  # x [L, heads, D]
        ang = pos.double()[:, None] * inv
        cos, sin = torch.cat([ang, ang], -1).cos() * att, torch.cat([ang, ang], -1).sin() * att
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]

    out = []
    for a in anchors:
        ctx = rms(aux[:a].double() @ t["fc.weight"].t(), t["hidden_norm.weight"])
        x = embed_W[[ids[a]] + [knob("mask_token_id")] * (B - 1)].double()
        x = x * float(knob("input_embedding_scale", 1.0))
        qpos, kpos = a + torch.arange(B), torch.cat([torch.arange(a), a + torch.arange(B)])
        for i, typ in enumerate(cfg["layer_types"]):
            p = f"layers.{i}."
            hn = rms(x, t[p + "input_layernorm.weight"])
            q = rope(
                rms(
                    lin(hn, p + "self_attn.q_proj").view(B, NH, D), t[p + "self_attn.q_norm.weight"]
                ),
                qpos,
            )
            src = torch.cat([ctx, hn])
            k = rope(
                rms(
                    lin(src, p + "self_attn.k_proj").view(-1, NKV, D),
                    t[p + "self_attn.k_norm.weight"],
                ),
                kpos,
            )
            v = lin(src, p + "self_attn.v_proj").view(-1, NKV, D)
            k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
            causal = (
                typ == "sliding_attention" if cfg.get("is_causal") is None else cfg["is_causal"]
            )
            w = window if typ == "sliding_attention" else None
            ok = torch.ones(B, a + B, dtype=torch.bool)
            dq = qpos[:, None] - kpos[None, :]
            if causal:
                ok &= dq >= 0
            if w is not None:
                ok &= dq < w
                if not causal:
                    ok &= -dq < w
            s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
            o = torch.einsum("hqk,khd->qhd", s.masked_fill(~ok, -math.inf).softmax(-1), v)
            x = x + lin(o.reshape(B, -1), p + "self_attn.o_proj")
            h2 = rms(x, t[p + "post_attention_layernorm.weight"])
            x = x + lin(
                act(lin(h2, p + "mlp.gate_proj")) * lin(h2, p + "mlp.up_proj"), p + "mlp.down_proj"
            )
        logits = rms(x, t["norm.weight"])[1:] @ lm_W.double().t()
        logits = logits + lm_b.double() if lm_b is not None else logits
        logits = logits * float(knob("output_multiplier", 1.0))
        c = knob("final_logit_softcapping")
        if c is not None and c > 0:
            logits = c * torch.tanh(logits / c)
        out.append(logits)
    return torch.stack(out).float()


# ----------------------------------------------------------------------------- our paths
def _ours_blocks(drafter, embed_W, lm_W, ids, aux, anchors):
    spec = drafter.spec
    anchors_NA = torch.tensor([anchors])
    pos = torch.arange(T_LEN)[None]
    blk = build_blocks(
        ids[None],
        pos,
        torch.zeros(1, T_LEN, dtype=torch.long),
        anchors_NA,
        torch.ones_like(anchors_NA, dtype=torch.bool),
        spec.block_size,
        spec.mask_token_id,
        mask_rules(spec),
    )
    with torch.no_grad():
        h = drafter(
            F.embedding(blk.block_ids_NQ, embed_W),
            blk.block_pos_NQ,
            blk.masks,
            aux_NTF=aux[None],
            ctx_pos_NT=pos,
        )
        h = h.view(len(anchors), spec.block_size, -1)[:, 1:]
        return drafter.logits(h, lm_W)


def _ours_decoding(drafter, embed_W, lm_W, ids, aux, a, heads=None):
    from dflash.decoding.steps import DrafterState

    heads = heads or _heads(embed_W, lm_W)
    target = SimpleNamespace(
        embed_tokens=heads.embed, lm_head=heads.lm_head, device=torch.device("cpu")
    )
    st = DrafterState(target, drafter)
    st.append(aux[: a - 3])  # context arrives in two pieces, as rounds append it
    st.append(aux[a - 3 : a])
    return st.draft_logits(a, int(ids[a]))


def _heads(embed_W, lm_W, lm_b=None, embed_scale=None):
    """The target's heads as modules: a Gemma-style embedding that scales its output (the
    reference reads the table, not the module), a head with a bias (the reference calls it)."""
    from dflash.target.shape import Heads

    class ScaledEmbedding(torch.nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * embed_scale

    embed = (ScaledEmbedding if embed_scale else torch.nn.Embedding)(V, H)
    head = torch.nn.Linear(H, V, bias=lm_b is not None)
    with torch.no_grad():
        embed.weight.copy_(embed_W)
        head.weight.copy_(lm_W)
        if lm_b is not None:
            head.bias.copy_(lm_b)
    return Heads(embed, head)


CASES = {
    "rope_parameters_yarn": dict(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    ),
    "rope_scaling_linear_legacy": dict(
        rope_theta=5000.0, rope_scaling={"type": "linear", "factor": 3.0}
    ),
    "rope_scaling_llama3": dict(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "rope_scaling_dynamic": dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "is_causal_true": dict(is_causal=True),
    "is_causal_false_window_both_sides": dict(is_causal=False, sliding_window=3),
    "input_embedding_scale": dict(dflash_config={"input_embedding_scale": 2.5}),
    "output_multiplier": dict(dflash_config={"output_multiplier": 0.4}),
    "final_logit_softcapping": dict(dflash_config={"final_logit_softcapping": 0.5}),
    "dflash_config_block_size_first": dict(block_size=6, dflash_config={"block_size": 4}),
    "attention_bias": dict(attention_bias=True),
    "hidden_act": dict(hidden_act="gelu"),
    "no_use_sliding_window": dict(use_sliding_window=False, sliding_window=3),
    "all_at_once": dict(
        is_causal=False,
        attention_bias=True,
        hidden_act="relu",
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "original_max_position_embeddings": 16,
        },
        dflash_config={
            "input_embedding_scale": 1.7,
            "output_multiplier": 1.3,
            "final_logit_softcapping": 0.8,
            "block_size": 4,
        },
    ),
}


def _setup(tmp_path, over, seed=0):
    cfg = _base_cfg(**json.loads(json.dumps(over)))
    t = _tensors(cfg, seed)
    g = torch.Generator().manual_seed(seed + 1)
    embed_W, lm_W = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 0.5
    ids = torch.randint(0, V - 1, (T_LEN + 8,), generator=g)
    aux = torch.randn(T_LEN + 8, 2 * H, generator=g)
    drafter, report = load_drafter(_write(tmp_path / "ck", cfg, t))
    assert not report["missing"] and not report["skipped"], report
    return cfg, t, drafter, embed_W, lm_W, ids, aux


@pytest.mark.parametrize("case", list(CASES))
def test_field_matches_eager_reference(case, tmp_path):
    cfg, t, drafter, embed_W, lm_W, ids, aux = _setup(tmp_path, CASES[case])
    anchors = [2, 5, 9, 13, 16]
    ref = _eager(cfg, t, embed_W, lm_W, ids.tolist(), aux, anchors)
    got = _ours_blocks(drafter, embed_W, lm_W, ids[:T_LEN], aux[:T_LEN], anchors)
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, atol=2e-4, rtol=1e-4), (got - ref).abs().max()
    dec = _ours_decoding(drafter, embed_W, lm_W, ids, aux, 16)
    assert torch.allclose(dec, ref[-1], atol=2e-4, rtol=1e-4), (dec - ref[-1]).abs().max()
    # the field matters: ignoring it (base config; top-level block_size 6) changes the drafts
    if case != "rope_scaling_dynamic":
        ignored = _base_cfg(block_size=6) if "block_size" in case else _base_cfg()
        t_ign = {k: v for k, v in t.items() if not k.endswith(".bias")}  # bias tensors skipped
        base = _eager(ignored, t_ign, embed_W, lm_W, ids.tolist(), aux, anchors)
        assert base.shape != ref.shape or not torch.allclose(base, ref, atol=1e-3)


def test_dynamic_rope_refuses_positions_past_its_static_range(tmp_path):
    _, _, drafter, *_ = _setup(tmp_path, CASES["rope_scaling_dynamic"])
    with pytest.raises(ValueError, match="dynamic"):
        drafter.rotary.cos_sin(torch.arange(70)[None], torch.float32)


def test_fields_survive_export_and_reload(tmp_path):
    _, _, drafter, *_ = _setup(tmp_path, CASES["all_at_once"])
    save_drafter(str(tmp_path / "export"), drafter)
    again, _ = load_drafter(str(tmp_path / "export"))
    assert again.spec == drafter.spec
    cfg = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (
        cfg["is_causal"] is False and cfg["attention_bias"] is True and cfg["hidden_act"] == "relu"
    )
    assert cfg["rope_parameters"]["rope_type"] == "yarn" and cfg["rope_scaling"]["factor"] == 2.0
    assert cfg["dflash_config"]["final_logit_softcapping"] == 0.8
    assert cfg["dflash_config"]["input_embedding_scale"] == 1.7
    for k, v in drafter.state_dict().items():
        assert torch.allclose(v.bfloat16().float(), again.state_dict()[k])


def test_training_loss_uses_the_fields(tmp_path):
    """The trainer's chunked CE sees the same logits (embedding scale, rope, masks, multiplier,
    softcapping) as the eager reference."""
    from dflash.train.step import Heads

    cfg, t, drafter, embed_W, lm_W, ids, aux = _setup(tmp_path, CASES["all_at_once"])
    heads = Heads(torch.nn.Embedding.from_pretrained(embed_W), torch.nn.Linear(H, V, bias=False))
    heads.lm_head.weight.data.copy_(lm_W)
    _check_training_loss(cfg, t, drafter, heads, embed_W, lm_W, ids, aux)


def _check_training_loss(cfg, t, drafter, heads, embed_W, lm_W, ids, aux, lm_b=None):
    from dflash.config import TrainConfig
    from dflash.data.batch import TargetBatch
    from dflash.train.step import DrafterTrainer

    tr = DrafterTrainer(
        drafter,
        heads,
        TrainConfig(max_anchors=6, dtype="float32", lm_head_chunk=7),
        torch.device("cpu"),
    )
    ids_T = ids[:T_LEN]
    tb = TargetBatch(
        ids_T[None],
        torch.arange(T_LEN)[None],
        torch.zeros(1, T_LEN, dtype=torch.long),
        (torch.arange(T_LEN) >= 3)[None],
        torch.tensor([0]),
        [0],
        aux_NTF=aux[None, :T_LEN],
        next_token_NT=torch.randint(0, V, (1, T_LEN), generator=torch.Generator().manual_seed(5)),
    )
    prep = tr.prepare(tb, 0)
    blocks, labels, weights = prep.blocks, prep.labels_NAK, prep.weights_NAK
    loss, _ = tr.forward_sums(tb, prep)
    anchors = blocks.anchors_NA[0][blocks.valid_NA[0]].tolist()
    ref_logits = _eager(cfg, t, embed_W, lm_W, ids_T.tolist(), aux, anchors, lm_b)
    n = len(anchors)
    ce = F.cross_entropy(ref_logits.reshape(-1, V), labels[0, :n].reshape(-1), reduction="none")
    ref = (ce * weights[0, :n].reshape(-1)).sum()
    assert torch.allclose(loss, ref, rtol=1e-4), (loss, ref)


def test_the_targets_heads_are_used_as_the_reference_uses_them(tmp_path):
    """A target whose embedding module scales its output (Gemma: x sqrt(H)) and whose lm_head
    has a bias: the reference drafts from the raw table and through lm_head(h), bias included;
    so do training's loss, the eval's drafts and its target distributions, and decoding."""
    from dflash.eval.offline import draft_all_anchors
    from dflash.eval.sets import EvalItem

    cfg, t, drafter, embed_W, lm_W, ids, aux = _setup(tmp_path, CASES["all_at_once"])
    lm_b = torch.randn(V, generator=torch.Generator().manual_seed(9)) * 2
    heads = _heads(embed_W, lm_W, lm_b, embed_scale=math.sqrt(H))
    _check_training_loss(cfg, t, drafter, heads, embed_W, lm_W, ids, aux, lm_b)
    P = 8
    anchors = list(range(P, T_LEN))
    ref = _eager(cfg, t, embed_W, lm_W, ids.tolist(), aux, anchors, lm_b)
    item = EvalItem(ids[:P], ids[P:T_LEN], aux[:T_LEN])
    _, lp, top = draft_all_anchors(drafter, heads, item, top_k=V)
    got = torch.full_like(ref, float("nan")).scatter(-1, top, lp)
    torch.testing.assert_close(got, torch.log_softmax(ref, -1), atol=2e-4, rtol=1e-4)
    dec = _ours_decoding(drafter, embed_W, lm_W, ids, aux, 16, heads)
    torch.testing.assert_close(dec, ref[16 - P], atol=2e-4, rtol=1e-4)
    # the eval's target distributions at T > 0: lm_head(final hidden), bias included
    from dflash.decoding.rejection import overlap
    from dflash.eval.offline import _overlaps

    g = torch.Generator().manual_seed(3)
    final, q_logits = torch.randn(T_LEN - P, H, generator=g), torch.randn(4, 3, V, generator=g)
    item = EvalItem(ids[:P], ids[P:T_LEN], aux[:T_LEN], final)
    draft = q_logits.argmax(-1)  # the DFlash drafter's proposal is its logits' distribution
    h = torch.zeros(4, 3, H)
    alpha = _overlaps(drafter, heads, h, q_logits, draft, item, 0, [1.0], 1.0, 0)[..., 0, 0]
    rows = torch.arange(4)[:, None] + torch.arange(1, 4)[None]  # completion index of each draft
    p = (final[rows] @ lm_W.t() + lm_b).softmax(-1)
    torch.testing.assert_close(alpha, overlap(p, q_logits.softmax(-1)), atol=1e-5, rtol=1e-5)


def test_the_split_trainers_read_the_heads_bias(tmp_path):
    from safetensors.torch import save_file as save

    from dflash.train.split.heads import read_head_bias

    save({"model.embed_tokens.weight": torch.zeros(4, 2)}, str(tmp_path / "a.safetensors"))
    assert read_head_bias(str(tmp_path)) is None
    save({"lm_head.bias": torch.arange(4.0)}, str(tmp_path / "b.safetensors"))
    assert torch.equal(read_head_bias(str(tmp_path)), torch.arange(4.0))


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(architectures=["DFlash2DraftModel"]), "DFlash2DraftModel"),
        (dict(dflash_config={"conv_kernel_size": 2}), "conv_kernel_size"),
        (dict(dflash_config={"selector_top_k": 16, "selector_rank": 256}), "selector_rank"),
        (dict(conv_group_size=16), "conv_group_size"),
        (dict(architectures=["LlamaForCausalLM"]), "architectures"),
        (dict(hidden_act="no_such_act"), "hidden_act"),
        (
            dict(
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.5,
                }
            ),
            None,
        ),
        (
            dict(
                rope_scaling={
                    "rope_type": "yarn",
                    "factor": 2.0,
                    "partial_rotary_factor": 0.5,
                    "original_max_position_embeddings": 8,
                }
            ),
            "partial rotary",
        ),
    ],
)
def test_unsupported_configs_are_refused(over, match, tmp_path):
    cfg = _base_cfg(**over)
    path = _write(tmp_path / "ck", cfg, _tensors(cfg))
    if match is None:  # the reference's default rope ignores partial_rotary_factor: so do we
        spec = load_drafter(path)[0].spec
        assert spec.rope_scaling is None or spec.rope_scaling.get("rope_type") == "default"
        return
    with pytest.raises(ValueError, match=match) as e:
        load_drafter(path)
    assert "\n" not in str(e.value)


def test_mask_rule_is_one_function():
    from dflash.drafter.spec import MaskRule, attention_rule

    spec = DrafterSpec.from_hf_config(_base_cfg())
    assert attention_rule(spec, "sliding_attention") == MaskRule(True, 6, False)
    assert attention_rule(spec, "full_attention") == MaskRule(False, None, False)
    spec.is_causal = False
    assert attention_rule(spec, "sliding_attention") == MaskRule(False, 6, True)
    spec.is_causal = True
    assert attention_rule(spec, "full_attention") == MaskRule(True, None, False)


@pytest.mark.parametrize(
    "over",
    [
        dict(layer_types=["full_attention", "full_attention"]),
        dict(layer_types=["sliding_attention", "sliding_attention"], sliding_window=None),
        dict(rope_scaling={"rope_type": "linear", "factor": 2.0}, is_causal=True),
        dict(
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        ),
        dict(final_logit_softcapping=3.0, output_multiplier=0.5, hidden_act="gelu"),
    ],
)
def test_spec_round_trips_through_config_json(over):
    """to_hf_config -> from_hf_config is the identity (resume compares specs this way)."""
    base = DrafterSpec.from_hf_config(_base_cfg())
    spec = DrafterSpec(**{**base.as_dict(), **over})
    assert DrafterSpec.from_hf_config(json.loads(json.dumps(spec.to_hf_config()))) == spec
