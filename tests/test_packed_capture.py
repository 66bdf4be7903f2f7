"""Packed target capture: an attention-only target runs a batch's samples packed into shared rows
(position ids restarting per sample, no padding computed) and must give exactly what one sample
per row gives; a target with recurrent layers is never packed; a packed capture that disagrees
on its first batch falls back to one sample per row, saying so."""

import pytest
import torch
from conftest import get_target

from dflash.config import TargetConfig
from dflash.data.batch import Sample, collate, pack_for_capture, sample_spans, target_forward
from dflash.target.graphs import LEN_TO, ROWS_TO, CaptureGraphs, CompiledLayers
from dflash.target.load import load_target
from dflash.target.packing import attends_only

LENGTHS = [40, 7, 23, 12, 40, 3, 31]


def _samples(vocab: int) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, n in enumerate(LENGTHS):
        lm = torch.zeros(n, dtype=torch.bool)
        lm[n // 2 :] = True
        out.append(Sample(i, torch.randint(0, vocab - 2, (n,), generator=g), lm))
    return out


def _tiny_qwen2_sliding():
    """Qwen2 with a sliding window of 8 on its first layers: the mask must combine the window
    with the packed samples."""
    cfg = dict(
        model_type="qwen2",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=4,
        tie_word_embeddings=False,
    )
    return load_target(
        TargetConfig(name="tiny_qwen2_swa", config=cfg, device="cpu", dtype="float32"), num_aux=3
    )


def _both(target, batch):
    """Packed (fresh check each time) and one-sample-per-row captures of the same batch."""
    target.packs_capture = target.pack_check_pending = True
    packed = target_forward(target, batch)
    target.packs_capture = False
    ref = target_forward(target, batch)
    target.packs_capture = True
    return packed, ref


@pytest.mark.parametrize("pack_to", [None, 64])
@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen2_swa"])
def test_packed_capture_equals_one_sample_per_row(name, pack_to, capsys):
    target = get_target(name) if name == "tiny_llama" else _tiny_qwen2_sliding()
    assert attends_only(target.model) and target.packs_capture
    if name == "tiny_qwen2_swa":
        assert "sliding_attention" in target.model.config.layer_types
    batch = collate(_samples(target.vocab_size), pad_id=0, pack_to=pack_to)
    packed, ref = _both(target, batch)
    assert "samples packed into shared rows" in capsys.readouterr().out
    torch.testing.assert_close(packed.aux_NTF, ref.aux_NTF, atol=1e-5, rtol=1e-5)
    assert torch.equal(packed.next_token_NT, ref.next_token_NT)
    assert target.packs_capture  # the check passed: packing stays on


def test_pack_layout_fills_rows_and_restarts_positions():
    batch = collate(_samples(512), pad_id=0)
    spans = sample_spans(batch.segment_ids_NT)
    ids, pos, seg, (r, c, pr, pc) = pack_for_capture(batch, spans)
    # first fit, longest first, rows as long as the longest sample: 40 | 40 | 31+7 | 23+12+3
    assert ids.shape == (4, 40) and batch.input_ids_NT.shape == (7, 40)
    assert torch.equal(ids[pr, pc], batch.input_ids_NT[r, c])  # every token, once
    assert len(set(zip(pr.tolist(), pc.tolist()))) == sum(LENGTHS)
    for i, (_, _, n) in enumerate(spans):  # each sample contiguous, positions 0..n-1
        rows, cols = pr[r == i], pc[r == i]
        assert rows.unique().numel() == 1 and torch.equal(cols, cols[0] + torch.arange(n))
        assert torch.equal(pos[rows[0], cols], torch.arange(n))
    assert torch.equal(pos[2], torch.cat([torch.arange(31), torch.arange(7), torch.arange(2)]))
    assert torch.equal(seg[pr, pc], r) and (seg >= 0).sum() == sum(LENGTHS)
    # padded to buckets (CUDA graphs): rows of 64 hold 40+23 | 40+12+7+3 | 31, padded to 4 rows
    ids_b, pos_b, seg_b, (r, c, pr, pc) = pack_for_capture(batch, spans, rows_to=4, len_to=32)
    assert ids_b.shape == pos_b.shape == seg_b.shape == (4, 64)
    assert torch.equal(ids_b[pr, pc], batch.input_ids_NT[r, c]) and torch.equal(seg_b[pr, pc], r)
    assert (seg_b[3] == -1).all() and torch.equal(pos_b[3], torch.arange(64))
    assert torch.equal(pos_b[2, 31:], torch.arange(33))  # a row's padding restarts at 0


def test_shared_rows_come_from_the_host_placement_and_match_the_packed_layout():
    """While the pack check waits for a batch with a shared row, target_forward reads which
    samples share one from the host placement (a device read would sync every capture: the GPU
    tier's never-waits test failed on it); that placement is the one the packed tensors use."""
    from dflash.data.batch import _sharing_a_row

    g = torch.Generator().manual_seed(3)
    for trial in range(40):
        lengths = torch.randint(1, 70, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g)
        samples = [
            Sample(i, torch.randint(0, 50, (int(n),), generator=g), torch.ones(int(n), dtype=bool))
            for i, n in enumerate(lengths)
        ]
        batch = collate(samples, pad_id=0)
        N, T = batch.input_ids_NT.shape
        spans = sample_spans(batch.segment_ids_NT)
        for buckets in [(), (4, 32)]:
            seg = pack_for_capture(batch, spans, *buckets)[2]
            per_row = [set(row[row >= 0].tolist()) for row in seg]
            want = torch.zeros(N, T, dtype=torch.bool)
            for i, (r, o, n) in enumerate(spans):
                want[r, o : o + n] = any(i in ids and len(ids) >= 2 for ids in per_row)
            got = _sharing_a_row(spans, N, T, *buckets)
            assert (got is None) == (not want.any()), (trial, buckets)
            assert got is None or torch.equal(got, want), (trial, buckets)


def test_bucketed_masked_capture_equals_one_sample_per_row(capsys):
    """The CUDA-graph path's forward (rows and length padded to buckets, an explicit
    block-diagonal causal mask from the segment ids) gives one-sample-per-row outputs; on the
    CPU it runs eagerly, on CUDA the same function is replayed from graphs (tests/test_gpu.py)."""
    target = get_target("tiny_llama")
    assert target.capture_graphs is None  # CPU: not graphable
    target.capture_graphs = CaptureGraphs(target)
    CaptureGraphs.buckets = (4, 32)
    try:
        batch = collate(_samples(target.vocab_size), pad_id=0)
        packed, ref = _both(target, batch)
    finally:
        CaptureGraphs.buckets = (ROWS_TO, LEN_TO)
        target.capture_graphs = None
    assert "samples packed into shared rows" in capsys.readouterr().out
    torch.testing.assert_close(packed.aux_NTF, ref.aux_NTF, atol=1e-5, rtol=1e-5)
    assert torch.equal(packed.next_token_NT, ref.next_token_NT)


def test_a_target_with_recurrent_layers_is_never_packed():
    target = get_target("tiny_qwen3_5")
    assert not attends_only(target.model) and not target.packs_capture


def _leaky(target, monkeypatch, eps: float):
    """A capture whose packed rows leak as flash attention's do with several rows: every sample
    after the first of a row is off by a relative eps (positions behind a restart)."""
    real = target.capture

    def leaky(ids, att=None, with_final_hidden=False, label_chunk=4096, position_ids_NT=None):
        out = real(ids, att, with_final_hidden, label_chunk, position_ids_NT)
        if position_ids_NT is not None:
            later = position_ids_NT < torch.arange(ids.shape[1])[None]
            out.aux_NTF = out.aux_NTF * (1 + eps * later[..., None])
        return out

    monkeypatch.setattr(target, "capture", leaky)


def _batch(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        lm = torch.zeros(n, dtype=torch.bool)
        lm[n // 2 :] = True
        out.append(Sample(i, torch.randint(0, vocab - 2, (n,), generator=g), lm))
    return collate(out, pad_id=0)


def test_a_packed_capture_that_disagrees_falls_back_with_a_warning(monkeypatch, capsys):
    """The check waits for a batch with a shared row (equal lengths: one sample per packed row,
    packed == unpacked whatever the kernel does), then compares that row's samples: a leak of
    5e-4 relative in the second sample of one shared row among six single rows is caught (over
    the whole batch it is 6.6e-5, under the fp32 tolerance 1e-4) and packing falls back."""
    target = _tiny_qwen2_sliding()
    _leaky(target, monkeypatch, eps=5e-4)
    vacuous = _batch([40] * 4, target.vocab_size)
    target_forward(target, vacuous)
    out = capsys.readouterr()
    assert "packed" not in out.out + out.err
    assert target.packs_capture and target.pack_check_pending  # nothing was compared yet
    batch = _batch([40] * 6 + [7, 3], target.vocab_size, seed=1)  # 7 + 3 share a row
    got = target_forward(target, batch)
    assert "packed target capture differs from one sample per row" in capsys.readouterr().err
    assert not target.packs_capture and not target.pack_check_pending
    target.packs_capture = False
    ref = target_forward(target, batch)
    torch.testing.assert_close(got.aux_NTF, ref.aux_NTF)


def test_attention_kernels_that_mix_packed_rows_never_pack(capsys):
    """flash_attention_2/3 follow restarting position ids for a single row only: with several
    packed rows, samples would attend across each other. Such a target captures one sample per
    row, saying so; sdpa / eager / flex keep packing."""
    import copy

    from dflash.target.capture import Target

    base = get_target("tiny_llama")
    assert base.packs_capture
    model = copy.deepcopy(base.model)
    model.config._attn_implementation = "flash_attention_2"
    t = Target(model, base.layer_ids, packed_capture=True)
    assert not t.packs_capture
    assert (
        "one sample per row: attention implementation 'flash_attention_2'"
        in capsys.readouterr().err
    )


def test_compiled_layers_compile_once_behind_the_capture_graphs_path(monkeypatch):
    """The CUDA-graph capture (`CaptureGraphs`, here its eager path on the CPU) passes packed rows
    a mask that is a view of [R, L, L]; the packing check's unpacked capture then passes
    transformers' mask, a view of another base. The layers compiled once for both, and for
    other rows after: not on the bases' shapes and strides (the H100 run of 2026-12-05
    recompiled every layer at the check), nor on sizes that happened to be equal at the first
    trace (the tiny target's 128 rows length and hidden size: the length was specialized)."""
    from conftest import target_cfg
    from torch._dynamo.utils import counters

    from dflash.target.graphs import CaptureGraphs, packed_mask

    target = load_target(target_cfg("tiny_llama"), num_aux=3)  # see the test above
    assert packed_mask(torch.zeros(2, 5, dtype=torch.long))._base is not None  # what is guarded
    samples = _samples(target.vocab_size)
    target.compiled_layers = compiled = _compiled(target, monkeypatch)
    target.capture_graphs = CaptureGraphs(target)
    counters.clear()
    try:
        target.pack_check_pending = False
        target_forward(target, collate(samples, pad_id=0, pack_to=64))  # padded to 128 long
        compiles = counters["frames"]["total"]
        _both(target, collate(samples[2:], pad_id=0, pack_to=48))  # the check: both kinds
        target.packs_capture = False
        target_forward(target, collate(samples[:5], pad_id=0))  # other rows, unpacked
    finally:
        target.compiled_layers = target.capture_graphs = None
    assert not compiled.failed and compiled._mask is None  # the copy dropped after the capture
    assert compiles >= 1 and counters["frames"]["total"] == compiles


def _compiled(target, monkeypatch, backend="eager"):
    """target.compile_layers on the CPU: CompiledLayers.of only enables it on CUDA, so build it
    directly, with a dynamo backend that needs no C++/Triton build (same swap and hooks)."""
    monkeypatch.setattr(CompiledLayers, "BACKEND", backend)
    torch._dynamo.reset()
    return CompiledLayers(target.decoder_layers())


def test_compiled_layers_capture_equals_eager_and_only_inside_the_capture(monkeypatch, capsys):
    target = get_target("tiny_llama")
    assert CompiledLayers.of(target, False) is None and not capsys.readouterr().out
    assert CompiledLayers.of(target, True) is None  # CPU: eager, with a note
    assert "target.compile_layers is for CUDA targets" in capsys.readouterr().out
    batch = collate(_samples(target.vocab_size), pad_id=0, pack_to=64)
    ref = target_forward(target, batch)
    calls = []
    compiled = _compiled(target, monkeypatch)
    compiled.fns = [lambda *a, _f=f, **k: calls.append(1) or _f(*a, **k) for f in compiled.fns]
    target.compiled_layers = compiled
    try:
        got = target_forward(target, batch)
        n = len(calls)
        # an eval set's one-row check stays eager: a compile for one row would be thrown away
        # (the first training batch has many rows and compiled again, on the H100)
        from dflash.eval.sets import consistent_greedy

        consistent_greedy(target, [3, 4, 5], [6, 7])
    finally:
        target.compiled_layers = None
    assert n == len(calls) == target.num_layers  # every layer ran compiled, once (one forward)
    assert not compiled.failed
    assert all("forward" not in vars(layer) for layer in target.decoder_layers())  # restored
    torch.testing.assert_close(got.aux_NTF, ref.aux_NTF, atol=1e-5, rtol=1e-5)  # taps outside
    assert torch.equal(got.next_token_NT, ref.next_token_NT)


def test_compiled_layers_compile_once_for_packed_and_unpacked_rows(monkeypatch):
    """Packed rows carry their own positions ([R, T] -> position embeddings [R, T, D]), unpacked
    rows share one ([1, T, D]); the compiled layers see both at the run-start packing check. With
    dynamic shapes the two batch sizes' equality was a guard, and the second kind compiled every
    layer again (the H200 run of 2026-12-05: "duck sizing added this equality")."""
    from conftest import target_cfg
    from torch._dynamo.utils import counters

    # its own target: the shared one may carry transformers' output-capturing hooks (installed
    # the first time any test calls it with output_hidden_states), which break the layer graphs
    target = load_target(target_cfg("tiny_llama"), num_aux=3)
    samples = _samples(target.vocab_size)
    target.compiled_layers = compiled = _compiled(target, monkeypatch)
    counters.clear()
    try:
        assert target.packs_capture
        target.pack_check_pending = False
        target_forward(target, collate(samples, pad_id=0, pack_to=64))  # packed rows only
        compiles = counters["frames"]["total"]
        _both(target, collate(samples[2:], pad_id=0, pack_to=48))  # the check: both kinds
        target.packs_capture = False
        seen, real = [], compiled._rows_matched

        def spy(args, kwargs):
            out = real(args, kwargs)
            seen.append(out["position_embeddings"])
            return out

        compiled._rows_matched = spy
        target_forward(target, collate(samples[:5], pad_id=0))  # other rows, unpacked
    finally:
        target.compiled_layers = None
    assert not compiled.failed
    assert compiles >= 1 and counters["frames"]["total"] == compiles
    # the rows' copy of the shared position embeddings is made once a forward, for every layer
    assert len(seen) == target.num_layers and all(pe is seen[0] for pe in seen)
    assert seen[0][0].shape[0] == 5 and compiled._pe is None  # dropped after the capture


def test_compiled_layers_trace_a_hybrid_target(monkeypatch):
    """Gated-DeltaNet + attention layers (the 27B worker's kind; unpacked rows, torch kernels on
    CPU) go through dynamo too, with the eager forward's aux states and labels: the first step
    toward compiling the worker's elementwise chains (its profile: 42 % of the forward)."""
    target = get_target("tiny_qwen3_5")
    assert not target.packs_capture
    batch = collate(_samples(target.vocab_size), pad_id=0)
    ref = target_forward(target, batch)
    target.compiled_layers = compiled = _compiled(target, monkeypatch)
    # and the units the CUDA path compiles: by default every layer whole (a Gated-DeltaNet
    # layer's fla kernels called outside the graphs); with compile_gdn=mlp a Gated-DeltaNet
    # layer's MLP only, every attention layer whole
    assert [type(u).__name__ for u in CompiledLayers.units(target)] == [
        type(layer).__name__ for layer in target.decoder_layers()
    ]
    units = CompiledLayers.units(target, "mlp")
    kinds = [type(u).__name__ for u in units]
    assert len(units) == target.num_layers and "Qwen3_5DecoderLayer" in kinds
    assert (
        sum(k.endswith("MLP") for k in kinds)
        == sum(hasattr(layer, "linear_attn") for layer in target.decoder_layers())
        > 0
    )
    try:
        got = target_forward(target, batch)
    finally:
        target.compiled_layers = None
    assert not compiled.failed
    torch.testing.assert_close(got.aux_NTF, ref.aux_NTF, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.next_token_NT, ref.next_token_NT)


def test_a_layer_compile_that_fails_warns_and_runs_eagerly(monkeypatch, capsys):
    def broken_backend(gm, *args, **kwargs):
        raise RuntimeError("no compiler here")

    target = get_target("tiny_llama")
    batch = collate(_samples(target.vocab_size), pad_id=0, pack_to=64)
    ref = target_forward(target, batch)
    target.compiled_layers = compiled = _compiled(target, monkeypatch, broken_backend)
    try:
        got = target_forward(target, batch)
        again = target_forward(target, batch)  # no second warning
    finally:
        target.compiled_layers = None
    err = capsys.readouterr().err
    assert compiled.failed and err.count("target.compile_layers: compiling a decoder layer") == 1
    assert "no compiler here" in err
    for out in (got, again):
        torch.testing.assert_close(out.aux_NTF, ref.aux_NTF, atol=1e-5, rtol=1e-5)
        assert torch.equal(out.next_token_NT, ref.next_token_NT)


def test_sample_spans_equal_a_scan_of_every_row():
    """(row, start, length) of every run of one segment id (>= 0) within a row, in order; a run
    never continues across rows, even with the same id at both ends."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        N, T = (int(x) for x in torch.randint(1, 7, (2,), generator=g))
        seg = torch.randint(-1, 3, (N, T), generator=g)
        want = []
        for r in range(N):
            t = 0
            while t < T:
                e = t
                while e < T and seg[r, e] == seg[r, t]:
                    e += 1
                if seg[r, t] >= 0:
                    want.append((r, t, e - t))
                t = e
        assert sample_spans(seg) == want
    assert sample_spans(torch.zeros(0, 5, dtype=torch.long)) == []


def test_pack_check_counts_near_ties_as_agreeing_in_bf16_only(capsys):
    """Labels that differ only where the reference's top logits nearly tie (bf16, compiled
    layers) keep packing on; a clear difference, or any difference in fp32, turns it off."""
    from types import SimpleNamespace

    from dflash.target.packing import packed_capture_agrees

    torch.manual_seed(0)
    N, T, H, V = 2, 50, 8, 16
    head = torch.nn.Linear(H, V, bias=False)
    final = torch.randn(N, T, H)
    logits = head(final).detach()
    top2 = logits.topk(2, dim=-1)
    ref_lab = top2.indices[..., 0]
    gap = top2.values[..., 0] - top2.values[..., 1]
    flip = torch.zeros(N, T, dtype=torch.bool)
    flip.view(-1)[gap.flatten().argsort()[:5]] = True  # the 5 closest ties (5 %)
    packed_lab = torch.where(flip, top2.indices[..., 1], ref_lab)
    aux = torch.randn(N, T, 3 * H)

    def check(dtype, labels):
        t = SimpleNamespace(pack_check_pending=True, lm_head=head, packs_capture=True)
        t.capture_graphs = "graphs"
        a = aux.to(dtype)
        return packed_capture_agrees(t, [a, labels], [a, ref_lab], final)

    near_gap = float(gap[flip].max())
    assert near_gap <= 0.1, near_gap  # the premise: these are near-ties
    with torch.no_grad():
        assert check(torch.bfloat16, packed_lab)
        assert "near-tie" in capsys.readouterr().out
        far = torch.zeros(N, T, dtype=torch.bool)
        far.view(-1)[gap.flatten().argsort()[-5:]] = True  # the 5 clearest decisions
        assert not check(torch.bfloat16, torch.where(far, top2.indices[..., 1], ref_lab))
        assert not check(torch.float32, packed_lab)  # fp32: no tolerance for flips


# ----------------------------------------------------------------------------- Gated-DeltaNet kernels
def _gdn_module(target):
    import sys

    return sys.modules[type(target.model).__module__]


def _conv_to_fla_contract(calls):
    """A torch stand-in for fla's `causal_conv1d` contract (x [B, T, D], weight [D, W] ->
    (y [B, T, D], state)), written tap by tap in the [B, T, D] layout: the CPU has no Triton."""

    def causal_conv1d(x, weight, bias=None, activation=None, cu_seqlens=None):
        B, T, D = x.shape
        assert weight.shape[0] == D and cu_seqlens is None
        calls.append(tuple(x.shape))
        W = weight.shape[1]
        y = torch.zeros(B, T, D, dtype=torch.float32)
        for w in range(W):  # y[t] = sum_w weight[:, w] * x[t - (W - 1) + w]
            shift = W - 1 - w
            y[:, shift:] += weight[:, w].float() * x[:, : T - shift].float()
        if bias is not None:
            y += bias.float()
        if activation in ("silu", "swish"):
            y = torch.nn.functional.silu(y)
        return y.to(x.dtype), None

    return causal_conv1d


def test_fla_conv1d_binding_gives_the_fallback_capture(monkeypatch):
    """linear_attn.use_fla_conv1d: transformers' causal_conv1d_fn ([B, D, T] views) bound to a
    kernel of fla's contract ([B, T, D]) gives the torch fallback's aux states and labels, and the
    report names the kernel. (On the GPU, tests/test_gpu.py holds the real fla kernel.)"""
    from dflash.target.linear_attn import linear_attn_report, use_fla_conv1d

    target = get_target("tiny_qwen3_5")
    mod = _gdn_module(target)
    batch = collate(_samples(target.vocab_size), pad_id=0)
    ref = target_forward(target, batch)
    calls = []
    monkeypatch.setattr(mod, "causal_conv1d_fn", mod.causal_conv1d_fn)  # restored after the test
    assert use_fla_conv1d(mod, kernel=_conv_to_fla_contract(calls))
    assert not use_fla_conv1d(mod, kernel=_conv_to_fla_contract(calls))  # bound already
    assert linear_attn_report(mod)["causal_conv1d_fn"].startswith("fla (")
    got = target_forward(target, batch)
    n_gdn = sum(hasattr(layer, "linear_attn") for layer in target.decoder_layers())
    assert len(calls) == n_gdn > 0 and all(c[1] == batch.input_ids_NT.shape[1] for c in calls)
    torch.testing.assert_close(got.aux_NTF, ref.aux_NTF, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.next_token_NT, ref.next_token_NT)


def test_whole_gated_deltanet_layers_compile_around_their_kernels(monkeypatch):
    """target.compile_gdn=layer: a Gated-DeltaNet layer compiled whole calls its kernel ops
    outside the traced graph (as the eager forward does, with real tensors) once
    kernels_outside_compile has made them opaque; without it, dynamo traces into the op (the
    27B worker then ran the torch fallback). Same aux states and labels as eager."""
    from dflash.target.linear_attn import kernels_outside_compile

    target = get_target("tiny_qwen3_5")
    mod = _gdn_module(target)
    batch = collate(_samples(target.vocab_size), pad_id=0)
    ref = target_forward(target, batch)
    fallback = mod.torch_chunk_gated_delta_rule
    assert kernels_outside_compile(mod) == []  # torch fallbacks stay traceable

    def run(opaque: bool):
        seen = []

        def kernel(*args, **kwargs):  # stands for a fla kernel bound by transformers
            seen.append(torch.compiler.is_compiling())
            if torch.compiler.is_compiling():  # traced into (wrong): skip the slow fallback trace
                return torch.zeros_like(kwargs.get("value", args[2])), None
            return fallback(*args, **kwargs)

        kernel._dflash_kernel, kernel._dflash_kernel_name = "fla", "test.kernel"
        monkeypatch.setattr(mod, "torch_chunk_gated_delta_rule", kernel)
        if opaque:
            assert "torch_chunk_gated_delta_rule" in kernels_outside_compile(mod)
        units = CompiledLayers.units(target, "layer")
        assert [type(u).__name__ for u in units].count("Qwen3_5DecoderLayer") == target.num_layers
        monkeypatch.setattr(CompiledLayers, "BACKEND", "eager")
        torch._dynamo.reset()
        # one Gated-DeltaNet layer compiled (dynamo's trace of a layer takes seconds on CPU)
        first = next(u for u in units if hasattr(u, "linear_attn"))
        target.compiled_layers = compiled = CompiledLayers([first])
        try:
            got = target_forward(target, batch)
        finally:
            target.compiled_layers = None
        assert not compiled.failed
        return seen, got

    seen, _ = run(opaque=False)
    assert any(seen)  # traced into: what happened to the 27B layers
    seen, got = run(opaque=True)
    n_gdn = sum(hasattr(layer, "linear_attn") for layer in target.decoder_layers())
    assert len(seen) == n_gdn and not any(seen)  # one call a layer, eager (compiled or not)
    torch.testing.assert_close(got.aux_NTF, ref.aux_NTF, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.next_token_NT, ref.next_token_NT)
    with pytest.raises(ValueError, match="compile_gdn='whole'; choose mlp or layer"):
        CompiledLayers.units(target, "whole")
