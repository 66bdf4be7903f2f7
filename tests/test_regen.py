"""The static-cache greedy decoder gives HF `generate`'s tokens (CPU: eager steps; the CUDA
graph path is in the GPU tier), and datasets/partials round-trip through the shard formats."""

import pytest
import torch

import dflash.target.regen as regen
from dflash.data.batch import Sample
from dflash.data.shards import ResponseShards, pack_samples, unpack_samples
from dflash.target.regen import (
    StaticGreedyDecoder,
    cut_at_eos,
    hf_generate_batch,
    left_pad,
    supports_static,
)


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 12, (n,), generator=g).tolist()
    return [torch.randint(0, 500, (k,), generator=g).tolist() for k in lens]


def test_static_decoder_equals_generate(tiny_llama):
    prompts = _prompts(5)
    ref = hf_generate_batch(tiny_llama, prompts, 20, 0, None)
    ids, att = left_pad(prompts, 0)
    got = cut_at_eos(StaticGreedyDecoder(tiny_llama.model).run(ids, att, 20, None), None)
    assert got == ref
    # an EOS that some rows produce mid-way: rows are cut after it, exactly as generate does
    eos = ref[1][7]
    ref_eos = hf_generate_batch(tiny_llama, prompts, 20, 0, eos)
    got_eos = cut_at_eos(StaticGreedyDecoder(tiny_llama.model).run(ids, att, 20, eos), eos)
    assert got_eos == ref_eos and any(len(r) < 20 for r in got_eos)


def test_eos_check_ignores_stale_token_memory(tiny_llama, monkeypatch):
    """The all-rows-ended check cannot be fooled by what the token buffer held before (a reused
    allocator block can hold an earlier batch's EOS): every empty long tensor starts as EOS."""
    prompts = _prompts(4, seed=2)
    ids, att = left_pad(prompts, 0)
    free = StaticGreedyDecoder(tiny_llama.model).run(ids, att, 48, None)
    eos = next(i for i in range(500) if i not in set(free.flatten().tolist()))
    ref = cut_at_eos(StaticGreedyDecoder(tiny_llama.model).run(ids, att, 48, eos), eos)
    real = torch.empty

    def stale(*a, **kw):
        x = real(*a, **kw)
        return x.fill_(eos) if x.dtype == torch.long else x

    monkeypatch.setattr(torch, "empty", stale)
    got = cut_at_eos(StaticGreedyDecoder(tiny_llama.model).run(ids, att, 48, eos), eos)
    assert got == ref and [len(r) for r in got] == [48] * 4


def _staggered(target, n_never: int, n: int = 40):
    """Prompts whose greedy responses hold one token (the test's EOS) at positions far apart,
    plus n_never prompts whose responses lack it: rows end at very different times."""
    prompts = _prompts(64, seed=3)
    ids, att = (x.to(target.device) for x in left_pad(prompts, 0))
    free = StaticGreedyDecoder(target.model, compact=False).run(ids, att, n, None).tolist()
    first = lambda x: {row.index(x) for row in free if x in row}
    eos = max(range(500), key=lambda x: (len(first(x)), -x))
    ended = sorted((r for r in range(64) if eos in free[r]), key=lambda r: free[r].index(eos))
    never = [r for r in range(64) if eos not in free[r]][:n_never]
    return [prompts[r] for r in ended + never], eos


class _WarmedUp(StaticGreedyDecoder):
    """The graph path's step accounting on CPU: each batch size starts with one eager step."""

    def _replay(self, step, dev, n_steps):
        if n_steps <= 1:
            return step, 0
        step()
        return step, 1


def test_compaction_gives_the_same_tokens(tiny_llama):
    """Ended rows leave the batch (at least twice here); the tokens are those of the uncompacted
    decoder and of generate, whether every row ends (decoding stops early) or some run on."""
    for n_never in (0, 2):
        prompts, eos = _staggered(tiny_llama, n_never)
        B, ids_att = len(prompts), left_pad(prompts, 0)
        ref = hf_generate_batch(tiny_llama, prompts, 40, 0, eos)
        assert len({len(r) for r in ref}) > 4 and sum(len(r) == 40 for r in ref) == n_never
        plain = StaticGreedyDecoder(tiny_llama.model, compact=False, check_every=2)
        large = StaticGreedyDecoder(
            tiny_llama.model, compact=True, check_every=2
        )  # B <= min_rows: as plain
        dec = StaticGreedyDecoder(tiny_llama.model, compact=True, check_every=2, min_rows=1)
        warm = _WarmedUp(tiny_llama.model, compact=True, check_every=2, min_rows=1)
        for d in (plain, large, dec, warm):
            assert cut_at_eos(d.run(*ids_att, 40, eos), eos) == ref
        assert len(warm.stretches) >= 3
        assert plain.stretches == large.stretches and len(plain.stretches) == 1
        sizes, steps = [b for b, _ in dec.stretches], sum(n for _, n in dec.stretches)
        assert len(sizes) >= 3 and sizes[0] == B and sizes == sorted(sizes, reverse=True)
        assert steps == plain.stretches[0][1] and (steps < 39) == (n_never == 0)
        assert sizes[-1] >= n_never and sum(b * n for b, n in dec.stretches) < B * steps


@pytest.mark.slow
def test_compiled_step_compiles_once_for_every_batch_shape(tiny_llama):
    """data.regen_compile: the step is compiled with dynamic shapes, so batches of other sizes and
    prompt lengths, and the smaller batches of compaction, reuse the one graph (a compile per
    shape would cost a budgeted run tens of seconds each); the tokens are the eager step's."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    graphs = lambda: counters["stats"]["unique_graphs"]  # noqa: E731
    prompts, eos = _staggered(tiny_llama, 2)
    new = 40
    many = (prompts * new)[:new]  # B == max_new: duck sizing would tie the two sizes
    for sub in (many, prompts[1:], prompts[-5:]):  # other B and prompt lengths
        ids_att = left_pad(sub, 0)
        plain = StaticGreedyDecoder(tiny_llama.model)
        dec = StaticGreedyDecoder(tiny_llama.model, compile=True, compact=True, check_every=2)
        dec.min_rows = 1
        assert cut_at_eos(dec.run(*ids_att, new, eos), eos) == cut_at_eos(
            plain.run(*ids_att, new, eos), eos
        )
        assert graphs() == 1, f"recompiled: {graphs()} graphs"
    assert len(dec.stretches) >= 2  # compaction ran under the compiled step too


def test_packed_gqa_attention_equals_repeated_kv():
    """One query token, grouped KV heads, a per-row padding mask: the packed kernel call gives
    plain SDPA over the repeated cache (what transformers does without packing)."""
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, L, D = 3, 6, 2, 9, 8
    q, k, v = (torch.randn(B, h, n, D, generator=g) for h, n in ((Hq, 1), (Hkv, L), (Hkv, L)))
    mask = torch.rand(B, 1, 1, L, generator=g) > 0.3
    mask[..., -1] = True
    module = torch.nn.Module()
    module.num_key_value_groups = Hq // Hkv
    got, _ = regen.packed_gqa_sdpa(module, q, k, v, mask, scaling=0.5)
    rep = Hq // Hkv
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask, scale=0.5
    )
    torch.testing.assert_close(got, ref.transpose(1, 2))


def test_static_decoder_steps_use_packed_gqa(tiny_llama, monkeypatch):
    """Decode steps of a GQA target go through packed_gqa_sdpa (and still equal generate); the
    model's attention setting is restored afterwards."""
    calls = []
    real = regen.packed_gqa_sdpa

    def spy(module, query, *a, **kw):
        calls.append(query.shape[2])
        return real(module, query, *a, **kw)

    monkeypatch.setattr(regen, "packed_gqa_sdpa", spy)
    prompts = _prompts(4, seed=1)
    ref = hf_generate_batch(tiny_llama, prompts, 12, 0, None)
    ids, att = left_pad(prompts, 0)
    got = cut_at_eos(StaticGreedyDecoder(tiny_llama.model).run(ids, att, 12, None), None)
    assert got == ref
    assert 1 in calls and tiny_llama.model.config._attn_implementation == "sdpa"


def test_hybrid_targets_keep_generate(tiny_qwen, tiny_llama):
    assert supports_static(tiny_llama.model) and not supports_static(tiny_qwen.model)


def test_shards_and_flat_samples_round_trip(tmp_path):
    sh = ResponseShards(str(tmp_path / "p"))
    sh.append("k", 0, [[1, 2], [3]])
    sh.append("k", 1, [[], [4, 5, 6]])
    assert sh.load("k") == [[1, 2], [3], [], [4, 5, 6]]
    assert sh.load("other") == [] and not (tmp_path / "p").exists()
    samples = [Sample(7, torch.tensor([1, 2, 3]), torch.tensor([False, True, True]))]
    samples.append(Sample(9, torch.tensor([4]), torch.tensor([True])))
    back = unpack_samples(pack_samples(samples))
    assert [s.sample_id for s in back] == [7, 9]
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(samples, back))
    assert all(torch.equal(a.loss_mask, b.loss_mask) for a, b in zip(samples, back))


def test_fused_decoding_gives_the_same_tokens_and_restores_the_model(tiny_llama, monkeypatch):
    """data.regen_fuse: the norms, MLP gates and RoPE of every layer run the fused functions
    inside the decoder (here through torch.compile's eager backend: the same patching without
    a kernel build), the tokens are the plain decoder's, and nothing stays patched after."""
    import dflash.target.fused as fused

    monkeypatch.setattr(fused, "FUSE_BACKEND", "eager")
    monkeypatch.setattr(fused, "_CHECKED", {})
    model = tiny_llama.model
    norms, mlps, mod = fused.fusable_parts(model)
    n = model.config.num_hidden_layers
    assert len(norms) == 2 * n + 1 and len(mlps) == n and mod is not None
    calls = {"rms": 0, "silu": 0, "rope": 0}
    for name, key in (("_rms_norm", "rms"), ("_silu_mul", "silu"), ("_rope", "rope")):
        real = getattr(fused, name)

        def spy(*a, real=real, key=key, **kw):
            calls[key] += 1
            return real(*a, **kw)

        monkeypatch.setattr(fused, name, spy)
    eager_rope = mod.apply_rotary_pos_emb
    prompts, eos = _staggered(tiny_llama, 2)
    ids, att = left_pad(prompts, 0)
    plain = cut_at_eos(StaticGreedyDecoder(model).run(ids, att, 24, eos), eos)
    assert calls == {"rms": 0, "silu": 0, "rope": 0}
    got = cut_at_eos(StaticGreedyDecoder(model, fuse=True).run(ids, att, 24, eos), eos)
    assert got == plain
    # the prefill and 23 one-token steps; + 1: the equivalence check of each kind; + 1: the
    # first call's compiled result checked against the eager function's (once a process)
    steps, once = 24, 2
    assert calls == {
        "rms": steps * (2 * n + 1) + once,
        "silu": steps * n + once,
        "rope": steps * n + once,
    }
    assert mod.apply_rotary_pos_emb is eager_rope
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.parametrize("fault", ["wrong", "fails"])
def test_a_fused_chain_unlike_eager_leaves_the_decoder_eager(
    tiny_llama, monkeypatch, capsys, fault
):
    """A compiled chain that computes something else than its eager function (beyond rounding)
    or does not compile is found at its first call: a warning, that call's eager result, and
    the eager function from then on, so the tokens are the plain decoder's."""
    import dflash.target.fused as fused

    def compiled(fn):
        if fn is not fused._rms_norm:
            return fn
        if fault == "fails":

            def broken(*a):
                raise RuntimeError("no kernel")

            return broken
        return lambda *a: fn(*a) * 1.001

    monkeypatch.setattr(fused, "_compiled_fn", compiled)
    monkeypatch.setattr(fused, "_CHECKED", {})
    model = tiny_llama.model
    prompts, eos = _staggered(tiny_llama, 2)
    ids, att = left_pad(prompts, 0)
    plain = cut_at_eos(StaticGreedyDecoder(model).run(ids, att, 16, eos), eos)
    for _ in range(2):  # the second batch: the chain stays eager, no second warning
        got = cut_at_eos(StaticGreedyDecoder(model, fuse=True).run(ids, att, 16, eos), eos)
        assert got == plain
    err = capsys.readouterr().err
    assert err.count("warning: data.regen_fuse:") == 1
    why = "differs from eager beyond rounding" if fault == "wrong" else "no kernel"
    assert "rms_norm: " in err and why in err
    assert fused._checked(fused._rms_norm).state == "eager"
    assert fused._checked(fused._silu_mul).state == "checked"


def test_fused_decoding_leaves_other_math_alone(tiny_llama):
    """A norm with another formula (Gemma's 1 + weight) or an MLP with another activation keeps
    its own forward: only exact equivalents are swapped."""
    import copy

    import dflash.target.fused as fused

    class OffsetRMSNorm(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight, self.variance_epsilon = torch.nn.Parameter(torch.randn(n)), 1e-6

        def forward(self, x):
            h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
            return (1 + self.weight) * h.to(x.dtype)

    model = copy.deepcopy(tiny_llama.model)
    layer = model.model.layers[0]
    layer.input_layernorm = OffsetRMSNorm(model.config.hidden_size)
    for m in (model.model.layers[1].mlp,):
        m.act_fn = torch.nn.GELU()
    norms, mlps, _ = fused.fusable_parts(model)
    assert layer.input_layernorm not in norms and model.model.layers[1].mlp not in mlps
    assert layer.post_attention_layernorm in norms and layer.mlp in mlps


@pytest.mark.slow
def test_fused_decoding_compiles_each_chain_once_for_every_batch_shape(tiny_llama):
    """With inductor (the default backend): one graph per fused function and phase (prefill,
    one-token steps), reused by batches of other sizes and prompt lengths; float32 tokens equal
    the plain decoder's."""
    from torch._dynamo.utils import counters

    import dflash.target.fused as fused

    torch._dynamo.reset()
    fused._COMPILED.clear()  # compiled wrappers of an earlier test would hold their own graphs
    fused._CHECKED.clear()
    start = counters["stats"]["unique_graphs"]  # the counters outlive reset()
    graphs = lambda: counters["stats"]["unique_graphs"] - start  # noqa: E731
    prompts = _prompts(6, seed=4)
    for sub in (prompts, prompts[:3], prompts[2:]):
        ids, att = left_pad(sub, 0)
        plain = StaticGreedyDecoder(tiny_llama.model).run(ids, att, 16, None)
        got = StaticGreedyDecoder(tiny_llama.model, fuse=True).run(ids, att, 16, None)
        assert torch.equal(got, plain)
        assert graphs() == 6, f"{graphs()} graphs"  # 3 functions x (prefill, step)


def check_fused_chains_round_as_eager(device: str) -> None:
    """The regen_fuse chains as inductor compiles them, in bf16 on `device`: RoPE and the SiLU
    gate give eager's bits (emulate_precision_casts: bf16 rounding after each op, as eager);
    RMSNorm sums its float32 mean in another order, so a few outputs in 10^5 are one bf16 step
    off. Without emulate_precision_casts ~26-34 % of each chain's outputs differed."""
    import dflash.target.fused as fused

    torch._dynamo.reset()
    fused._COMPILED.clear()
    fused._CHECKED.clear()
    g = torch.Generator().manual_seed(0)
    bf = lambda *shape: torch.randn(*shape, generator=g).bfloat16().to(device)  # noqa: E731
    cos, sin = bf(64, 1, 64), bf(64, 1, 64)
    cases = [
        (fused._rms_norm, (bf(64, 1, 896), bf(896), 1e-6)),
        (fused._silu_mul, (bf(64, 1, 1024), bf(64, 1, 1024))),
        (fused._rope, (bf(64, 14, 1, 64), bf(64, 2, 1, 64), cos, sin)),
    ]
    for fn, args in cases:
        want, got = fn(*args), fused._compiled_fn(fn)(*args)
        for w, o in zip(*(((t,) if torch.is_tensor(t) else t) for t in (want, got)), strict=True):
            assert w.dtype == o.dtype == torch.bfloat16, fn.__name__
            if fn is fused._rms_norm:
                step = w.float().abs().clamp_min(2**-126) * 2**-7  # one bf16 step, about
                assert ((w.float() - o.float()).abs() <= step).all(), fn.__name__
                assert (w != o).float().mean() < 1e-3, fn.__name__
            else:
                assert torch.equal(w, o), fn.__name__


@pytest.mark.slow
def test_fused_chains_round_as_eager_in_bfloat16(tiny_llama):
    """With inductor on CPU; a bf16 tiny model's fused regeneration then decodes the plain
    decoder's tokens (on this model and these prompts: a rare RMSNorm step can still flip a
    near-tie elsewhere)."""
    import copy

    check_fused_chains_round_as_eager("cpu")
    model = copy.deepcopy(tiny_llama.model).bfloat16()  # random weights: flat logits, many ties
    ids, att = left_pad(_prompts(6, seed=5), 0)
    plain = StaticGreedyDecoder(model).run(ids, att, 16, None)
    assert torch.equal(StaticGreedyDecoder(model, fuse=True).run(ids, att, 16, None), plain)
