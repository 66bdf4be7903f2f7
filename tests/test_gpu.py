"""GPU tier (`pytest -m gpu`, run on a CUDA machine): the fla kernels, bf16 autocast and real
speculative decoding on the device. Skipped without CUDA."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import MECHANISM_OVERRIDES, ROOT, make_drafter, target_cfg

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def require_fla():
    """The fla tests fail (not skip) without it: the GPU tier is run with the gpu extra."""
    import importlib.util

    assert importlib.util.find_spec("fla") is not None, (
        "flash-linear-attention is not installed: the GPU tier needs `pip install -e '.[gpu]'`"
    )


@pytest.fixture(scope="module")
def qwen_cuda_fp32():
    from dflash.target.load import load_target

    over = MECHANISM_OVERRIDES["tiny_qwen3_5"]
    return load_target(
        target_cfg("tiny_qwen3_5", device="cuda", dtype="float32", **over), num_aux=3
    )


def test_backend_is_fla_on_cuda(qwen_cuda_fp32):
    require_fla()
    assert qwen_cuda_fp32.backend == "fla"


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_specdec_identical_to_greedy_on_fla(qwen_cuda_fp32, variant):
    """Chain and tree decoding on the device give the target's greedy tokens (DFlash2: its
    selector's path and its tree over the selector's rows)."""
    from dflash.decoding import generate_ar, generate_chain, generate_tree
    from dflash.tools.testing import OracleDrafter

    t = qwen_cuda_fp32
    base = make_drafter(t, block_size=8, variant=variant).to("cuda")
    g = torch.Generator().manual_seed(0)
    for i in range(2):
        prompt = torch.randint(0, 511, (16,), generator=g).tolist()
        ar = generate_ar(t, prompt, 48)
        d = OracleDrafter(base, t.lm_head.weight, prompt + ar.tokens, pattern="mixed", seed=i).to(
            "cuda"
        )
        ch = generate_chain(t, d, prompt, 48)
        tr = generate_tree(t, d, prompt, 48, budget=16)
        assert ch.tokens == ar.tokens and tr.tokens == ar.tokens
        assert ch.tau > 1.5 and tr.tau > 1.5  # a 16-node tree can be shallower than the chain


def test_training_on_cuda_bf16(tmp_path):
    require_fla()
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            "logger=none",
            f"out_root={tmp_path}",
            "run_name=g",
            "train.steps=20",
            "train.eval_every=20",
            "train.save_every=20",
            "data.num_samples=32",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    target_line = next(ln for ln in r.stdout.splitlines() if ln.startswith("target: "))
    assert "cuda" in target_line and "Gated-DeltaNet: " in target_line
    assert "fla (" in target_line.split("Gated-DeltaNet: ")[1]  # the GDN kernels, not the fallback
    assert os.path.exists(tmp_path / "g" / "checkpoints" / "step_00000020" / "model.safetensors")


def test_parity_fla_vs_torch_tiny():
    require_fla()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash.tools.parity",
            "--target",
            "tiny_qwen3_5",
            "--a",
            "torch:float32:cuda",
            "--b",
            "fla:float32:cuda",
            "--tokens",
            "512",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_kernel_matches_dense_on_cuda(dtype):
    """The compiled block-sparse kernel vs the dense-mask SDPA path: same hidden states within
    the dtype's tolerance, the same argmax drafts, and matching gradients."""
    from test_flex_attn import _blocks

    from dflash.drafter.attention import to_kernel_masks
    from dflash.drafter.blocks import candidate_anchors, sample_anchors
    from dflash.target.shape import TargetShape

    class T:
        layer_ids = [1, 3, 5]
        shape = TargetShape(8, 256, 1024, 512, 8, 2, torch.float32, 1023, (1, 3, 5))

    drafter = make_drafter(T, block_size=16, window=100).cuda()
    g = torch.Generator().manual_seed(0)
    N, L = 2, 700
    ids = torch.randint(0, 1000, (N, L), generator=g).cuda()
    pos = torch.arange(L).expand(N, L).contiguous().cuda()
    seg = torch.zeros(N, L, dtype=torch.long).cuda()
    seg[1, 600:] = -1
    anchors, valid = sample_anchors(candidate_anchors(seg, seg >= 0), 96, [0, 1])
    blk = _blocks(drafter, ids, pos, seg, anchors, valid)
    aux = torch.randn(N, L, 3 * 256, generator=g).cuda()
    embed = torch.nn.Embedding(1024, 256).cuda()
    lm = torch.randn(1024, 256, generator=g).cuda()

    def run(kernel):
        drafter.zero_grad()
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            h = drafter(
                embed(blk.block_ids_NQ).detach(),
                blk.block_pos_NQ,
                to_kernel_masks(blk.masks, kernel),
                aux_NTF=aux,
                ctx_pos_NT=pos,
            )
        h.float().pow(2).mean().backward()
        return h.float(), drafter.layers[0].self_attn.q_proj.weight.grad.clone()

    h_d, g_d = run("sdpa")
    h_f, g_f = run("flex")
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert torch.isfinite(h_f).all() and torch.isfinite(g_f).all()
    assert rel(h_f, h_d) < tol, rel(h_f, h_d)
    assert rel(g_f, g_d) < 10 * tol, rel(g_f, g_d)
    same = float(((h_f @ lm.t()).argmax(-1) == (h_d @ lm.t()).argmax(-1)).float().mean())
    assert same >= (0.999 if dtype == torch.float32 else 0.99), same


def test_static_graph_decoder_equals_generate_on_cuda():
    """The CUDA-graph replayed static-cache decoder gives generate's greedy tokens (fp32)."""
    from dflash.target.load import load_target
    from dflash.target.regen import StaticGreedyDecoder, cut_at_eos, hf_generate_batch, left_pad

    t = load_target(target_cfg("tiny_llama", device="cuda", dtype="float32"), num_aux=3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (int(n),), generator=g).tolist() for n in (3, 9, 17, 5)]
    ref = hf_generate_batch(t, prompts, 40, 0, None)
    ids, att = left_pad(prompts, 0)
    dec = StaticGreedyDecoder(t.model)
    got = cut_at_eos(dec.run(ids.cuda(), att.cuda(), 40, None), None)
    assert dec.graph_used and got == ref


def test_static_graph_decoder_compacts_on_cuda():
    """Compaction on the graph path (a graph captured per smaller batch) keeps generate's tokens."""
    from test_regen import _staggered

    from dflash.target.load import load_target
    from dflash.target.regen import StaticGreedyDecoder, cut_at_eos, hf_generate_batch, left_pad

    t = load_target(target_cfg("tiny_llama", device="cuda", dtype="float32"), num_aux=3)
    prompts, eos = _staggered(t, 2)
    ref = hf_generate_batch(t, prompts, 40, 0, eos)
    ids, att = left_pad(prompts, 0)
    dec = StaticGreedyDecoder(t.model, compact=True, check_every=2, min_rows=1)
    got = cut_at_eos(dec.run(ids.cuda(), att.cuda(), 40, eos), eos)
    assert dec.graph_used and got == ref and len(dec.stretches) >= 3
    # data.regen_compile: the compiled step, captured per batch size, compacting as it goes
    dec = StaticGreedyDecoder(t.model, compile=True, compact=True, check_every=2, min_rows=1)
    got = cut_at_eos(dec.run(ids.cuda(), att.cuda(), 40, eos), eos)
    assert dec.graph_used and got == ref and len(dec.stretches) >= 3


def test_fused_regen_chains_round_as_eager_on_cuda():
    """data.regen_fuse's chains as Triton kernels: RoPE and the SiLU gate give eager's bf16 bits,
    RMSNorm within one bf16 step in a few outputs (without emulate_precision_casts the H200
    bench's fused regeneration differed from the plain one in 75 of 512 rows)."""
    from test_regen import check_fused_chains_round_as_eager

    check_fused_chains_round_as_eager("cuda")


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_capture_graphs_equal_one_sample_per_row_on_cuda(dtype, compiled):
    """The packed capture replayed from CUDA graphs (several buckets, each replayed with new
    contents) gives the eager one-sample-per-row aux states and labels; with
    target.compile_layers the graphs hold the compiled layers (the reference stays eager)."""
    from dflash.data.batch import Sample, collate, target_forward
    from dflash.target.load import load_target

    cfg = target_cfg("tiny_llama", device="cuda", dtype=dtype, compile_layers=compiled)
    t = load_target(cfg, num_aux=3)
    assert t.capture_graphs is not None and (t.compiled_layers is not None) == compiled
    layers = t.compiled_layers
    g = torch.Generator().manual_seed(0)
    for lengths in ([40, 7, 23, 12, 40, 3, 31], [150, 5, 60, 130, 100], [41, 8, 22, 13, 39, 4, 30]):
        samples = [
            Sample(i, torch.randint(0, 500, (n,), generator=g), torch.arange(n) >= n // 2)
            for i, n in enumerate(lengths)
        ]
        batch = collate(samples, pad_id=0)
        graphs, t.capture_graphs, t.compiled_layers = t.capture_graphs, None, None
        t.packs_capture = False
        ref = target_forward(t, batch, with_final_hidden=True)
        t.packs_capture, t.capture_graphs, t.compiled_layers = True, graphs, layers
        got = target_forward(t, batch)
        real = batch.segment_ids_NT.cuda() >= 0
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == "float32" else dict(atol=5e-2, rtol=5e-2)
        torch.testing.assert_close(got.aux_NTF[real], ref.aux_NTF[real], **tol)
        label, ref_label = got.next_token_NT[real], ref.next_token_NT[real]
        if dtype == "float32":
            assert torch.equal(label, ref_label)
        else:  # a random tiny model has near-tied logits: a differing label must be one of them
            logits = t.lm_head(ref.final_hidden_NTH[real]).float()
            gap = logits.gather(1, ref_label[:, None]) - logits.gather(1, label[:, None])
            differ = (label != ref_label).float().mean().item()
            print(f"{lengths}: labels differ at {differ:.2%}, largest logit gap {gap.max():.3f}")
            assert gap.max() <= 0.1 and differ <= 0.1
    assert len(graphs.graphs) == 2 and not graphs.failed  # (2, 128) twice, (2, 256) once
    assert layers is None or not layers.failed


@pytest.mark.parametrize("gdn", ["mlp", "layer"])
def test_gated_deltanet_target_on_fla_conv1d_and_compiled_layers_on_cuda(gdn):
    """A fla-bound hybrid target: transformers' causal_conv1d_fn runs fla's Triton conv1d (the
    torch fallback's aux states and labels), and target.compile_layers with compile_gdn=mlp or
    layer gives the eager capture with the fla kernels still bound (layer: called outside the
    compiled graphs)."""
    import sys

    from dflash.data.batch import Sample, collate, target_forward
    from dflash.target.linear_attn import linear_attn_report
    from dflash.target.load import load_target

    require_fla()
    over = MECHANISM_OVERRIDES["tiny_qwen3_5"]
    cfg = target_cfg(
        "tiny_qwen3_5", device="cuda", dtype="float32", compile_layers=True, compile_gdn=gdn, **over
    )
    t = load_target(cfg, num_aux=3)
    mod = sys.modules[type(t.model).__module__]
    report = linear_attn_report(mod)
    assert report["causal_conv1d_fn"].startswith("fla ("), report
    assert report["chunk_gated_delta_rule"].startswith("fla ("), report
    # the op on transformers' layout ([B, D, T], a transposed view) against a grouped conv
    x = torch.randn(2, 37, 96, device="cuda").transpose(1, 2)
    w, bias = torch.randn(96, 4, device="cuda"), torch.randn(96, device="cuda")
    want = torch.nn.functional.conv1d(x, w[:, None], bias, padding=3, groups=96)[..., :37]
    got = mod.causal_conv1d_fn(x, w, bias, activation="silu")
    torch.testing.assert_close(got, torch.nn.functional.silu(want), atol=1e-4, rtol=1e-4)
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(i, torch.randint(0, 500, (n,), generator=g), torch.arange(n) >= n // 2)
        for i, n in enumerate([150, 64, 97])
    ]
    batch = collate(samples, pad_id=0)
    layers, t.compiled_layers = t.compiled_layers, None
    fla_eager = target_forward(t, batch)
    t.compiled_layers = layers
    compiled = target_forward(t, batch)
    assert not layers.failed
    real = batch.segment_ids_NT.cuda() >= 0
    torch.testing.assert_close(
        compiled.aux_NTF[real], fla_eager.aux_NTF[real], atol=1e-4, rtol=1e-4
    )
    assert torch.equal(compiled.next_token_NT[real], fla_eager.next_token_NT[real])


@pytest.mark.parametrize("label_sampling", ["all", "by_weight"])
def test_colocated_step_never_waits_for_the_gpu(label_sampling):
    """After warm-up (kernel compiles, graph capture, the packed-capture check), a colocated
    step (packed CUDA-graph capture, deferred screen, drafter step with flex attention and the
    fused CE) queues its work without one host sync: sync debug mode "error" raises on any.
    by_weight: its keep probabilities once went to the GPU with a blocking copy every step (a
    15-ms stream sync a step in the H200 profile of the Qwen2.5 loop)."""
    import math

    from dflash.config import TrainConfig
    from dflash.data.batch import Sample, collate, target_forward
    from dflash.target.load import load_target
    from dflash.target.shape import Heads
    from dflash.train.build import screen_batch
    from dflash.train.step import DrafterTrainer

    t = load_target(target_cfg("tiny_llama", device="cuda", dtype="bfloat16"), num_aux=3)
    cfg = TrainConfig(steps=10, max_anchors=16, label_sampling=label_sampling)
    dev = torch.device("cuda")
    tr = DrafterTrainer(make_drafter(t), Heads(t.embed_tokens, t.lm_head), cfg, dev)
    assert tr.attn_kernel == "flex" and t.capture_graphs is not None
    g = torch.Generator().manual_seed(0)
    batches = [
        collate(
            [
                Sample(i, torch.randint(0, 500, (n,), generator=g), torch.arange(n) >= n // 3)
                for i, n in enumerate(lengths)
            ],
            pad_id=0,
        )
        for lengths in ([60, 17, 33, 90], [70, 20, 41, 85])
    ]

    def step(b):
        tb, pending = screen_batch(target_forward(t, b), "skip", defer=True)
        return tr.step_async([tb]), pending

    for b in batches + batches:
        step(b)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for b in batches:
            figures, pending = step(b)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert math.isfinite(figures.read()["train/loss"]) and pending.read() == []


def test_fused_elementwise_chains_match_eager_on_cuda():
    """dflash.drafter.fuse: the compiled RMSNorm / RoPE / SwiGLU chains give the eager drafter's output
    and gradients (bf16 autocast, within bf16 rounding)."""
    from dflash.drafter import fuse
    from dflash.target.load import load_target

    t = load_target(target_cfg("tiny_llama", device="cuda", dtype="float32"), num_aux=3)
    d = make_drafter(t).cuda()
    N, T, A, B = 2, 48, 6, d.spec.block_size
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(N, T, d.spec.num_aux * d.spec.hidden_size, generator=g).cuda()
    emb = torch.randn(N, A * B, d.spec.hidden_size, generator=g).cuda()
    pos = torch.arange(T).expand(N, T).cuda()
    bpos = (torch.arange(A)[:, None] * 5 + 10 + torch.arange(B)).reshape(1, -1).expand(N, -1).cuda()
    mask = torch.rand(N, 1, A * B, T + A * B, generator=g).cuda() < 0.7
    masks = {k: mask for k in set(d.spec.layer_types)}
    outs, default = [], fuse.ENABLED
    for on in (False, True):
        fuse.ENABLED = on
        d.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = d(emb, bpos, masks, aux_NTF=aux, ctx_pos_NT=pos)
        h.float().square().mean().backward()
        outs.append((h.float(), {k: p.grad.clone() for k, p in d.named_parameters()}))
    fuse.ENABLED = default
    (h0, g0), (h1, g1) = outs
    torch.testing.assert_close(h1, h0, atol=3e-2, rtol=3e-2)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], atol=3e-2, rtol=5e-2, msg=k)


def test_overlapped_capture_on_a_side_stream_gives_the_same_batches_on_cuda():
    """topology.overlap_capture: batches captured one step ahead on a side stream (CUDA graphs
    replayed there) equal the batches captured in step, step after step."""
    from dflash.config import RunConfig
    from dflash.data.batch import Sample
    from dflash.target.load import load_target
    from dflash.train.colocated import LocalBatchSource

    t = load_target(target_cfg("tiny_llama", device="cuda", dtype="float32"), num_aux=3)
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(24):
        n = int(torch.randint(20, 160, (1,), generator=g))
        samples.append(
            Sample(i, torch.randint(0, 500, (n,), generator=g), torch.arange(n) >= n // 3)
        )
    got = {}
    for overlap in (False, True):
        cfg = RunConfig()
        cfg.train.micro_batch_size, cfg.train.grad_accum = 4, 2
        cfg.topology.overlap_capture = overlap
        src = LocalBatchSource(t, samples, cfg)
        assert (src.side is not None) == overlap
        got[overlap] = []
        for _ in range(4):
            for tb in src.next_batches():
                torch.cuda.current_stream().synchronize()
                got[overlap].append((tb.aux_NTF.clone(), tb.next_token_NT.clone()))
        assert src.stream.position == 4 * 8 and src.interval_metrics()["pipe/bad_samples"] == 0
    for (a0, n0), (a1, n1) in zip(got[False], got[True]):
        assert torch.equal(n0, n1) and torch.allclose(a0, a1, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overlap,label_sampling", [(True, "all"), (False, "by_weight")])
def test_colocated_source_never_waits_for_the_gpu(overlap, label_sampling):
    """The colocated batch source train.py runs (collate, capture, deferred screen), in step or
    with topology.overlap_capture (the next step's capture launched on the side stream), and
    the drafter step: after warm-up they queue their work without a host sync, as in
    test_colocated_step_never_waits_for_the_gpu."""
    import math

    from dflash.config import RunConfig
    from dflash.data.batch import Sample
    from dflash.target.load import load_target
    from dflash.target.shape import Heads
    from dflash.train.colocated import LocalBatchSource
    from dflash.train.step import DrafterTrainer

    t = load_target(target_cfg("tiny_llama", device="cuda", dtype="bfloat16"), num_aux=3)
    g = torch.Generator().manual_seed(0)
    n = 100  # one length: every batch packs to the same CUDA-graph bucket
    samples = [
        Sample(i, torch.randint(0, 500, (n,), generator=g), torch.arange(n) >= n // 3)
        for i in range(8)
    ]
    cfg = RunConfig()
    cfg.train.micro_batch_size, cfg.train.max_anchors = 4, 16
    cfg.train.label_sampling, cfg.topology.overlap_capture = label_sampling, overlap
    src = LocalBatchSource(t, samples, cfg)
    dev = torch.device("cuda")
    tr = DrafterTrainer(make_drafter(t), Heads(t.embed_tokens, t.lm_head), cfg.train, dev)
    for _ in range(4):  # the graph captured, kernels compiled
        tr.step_async(src.next_batches())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            figures = tr.step_async(src.next_batches())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert math.isfinite(figures.read()["train/loss"])


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_static_compiled_step_matches_eager_on_cuda(variant):
    """train.compile with inductor on the device (flex attention, the fused CE, labels by weight
    and the fused chains inside one graph): batches of three lengths padded to one row length
    run one compiled graph and give the eager step's loss and updates (bf16 autocast). DFlash2
    too (its convolutions and selector loss): the recipe's next ablation compiles it."""
    import copy

    from torch._dynamo.utils import counters

    from dflash.config import TrainConfig
    from dflash.data.batch import Sample, collate, target_forward
    from dflash.target.load import load_target
    from dflash.target.shape import Heads
    from dflash.train.step import DrafterTrainer

    torch._dynamo.reset()
    t = load_target(target_cfg("tiny_llama", device="cuda", dtype="bfloat16"), num_aux=3)
    drafter = make_drafter(t, variant=variant)
    dev = torch.device("cuda")

    def trainer(**over):
        cfg = TrainConfig(steps=10, max_anchors=16, lr=1e-3, label_sampling="by_weight", **over)
        return DrafterTrainer(copy.deepcopy(drafter), Heads(t.embed_tokens, t.lm_head), cfg, dev)

    eager, comp = trainer(), trainer(compile=True, fuse=True)
    g = torch.Generator().manual_seed(0)
    batches = [
        [Sample(i, torch.randint(0, 500, (n,), generator=g), torch.arange(n) >= n // 3)
         for i, n in enumerate(lengths)]
        for lengths in ([60, 17, 33, 90], [70, 20, 41, 85], [30, 96, 12, 44])
    ]  # fmt: skip
    # the eager steps first: their own compiled pieces (flex, fused chains) see new shapes
    # and may compile again, which must not count against the static step's one graph
    ref = [eager.train_step([target_forward(t, collate(s, pad_id=0))]) for s in batches]
    graphs = []
    for s, a in zip(batches, ref):
        b = comp.train_step([target_forward(t, collate(s, pad_id=0, pad_to=128))])
        graphs.append(counters["stats"]["unique_graphs"])
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=2e-2)
        assert b["train/labels"] == a["train/labels"]
    assert graphs[-1] == graphs[0]  # compiled at the first step only
    for (k, x), y in zip(eager.drafter.named_parameters(), comp.drafter.parameters()):
        assert torch.allclose(x, y, atol=5e-3), k  # bf16 rounding through three Adam steps


@pytest.mark.parametrize("V,tiles", [(512, False), (128 * 64, True)])
def test_fused_selection_matches_the_plain_path_on_cuda(V, tiles):
    """DFlash2's selection through the fused head on the device (the compiled CE stats, topk on
    the bf16 logits; and the stats compiled tile by tile, train.fused_head=tiles) against the
    checkpointed plain path: the same loss and gradients, up to bf16 rounding."""
    from dflash.drafter.dflash2 import CandidateSelector
    from dflash.train.fused_ce import fused_ce_selection_sum, uses_tiles
    from dflash.train.losses import ce_selection_sum

    assert uses_tiles(V, 8, tiles) == tiles
    g = torch.Generator().manual_seed(0)
    M, H = 300, 64
    h = (torch.randn(M, H, generator=g) * 2).cuda().bfloat16()
    w = torch.randn(V, H, generator=g).cuda().bfloat16()
    labels, prev = (torch.randint(0, V, (M,), generator=g).cuda() for _ in range(2))
    # half the labels among each row's top-16 logits: the selector's loss (and the successor
    # codebook's gradient) needs candidates that hold the label; random labels of 8,192 hit none
    top = (h.float() @ w.float().T).topk(16, -1).indices
    pick = torch.randint(0, 16, (M,), generator=g).cuda()
    labels[: M // 2] = top.gather(1, pick[:, None])[: M // 2, 0]
    weights = torch.rand(M, generator=g).cuda()
    out = []
    for fused in (False, True):
        torch.manual_seed(1)
        sel = CandidateSelector(V, H, 16, 8).cuda()
        with torch.no_grad():
            for p in sel.parameters():
                p.normal_(0, 0.3)
        hh = h.clone().requires_grad_()
        kw = dict(selection_weight=1.0, chunk=128)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if fused:
                loss, _ = fused_ce_selection_sum(
                    hh, w, labels, weights, prev, sel, **kw, tiles=tiles
                )
            else:
                loss, _ = ce_selection_sum(hh, w, labels, weights, prev, sel, **kw)
        loss.backward()
        out.append((loss.item(), hh.grad.float(), sel.successor_codebook.grad))
    (l1, g1, s1), (l2, g2, s2) = out
    assert s1.abs().sum() > 0  # the selector's loss reached the codebooks
    assert l2 == pytest.approx(l1, rel=1e-2)
    assert torch.nn.functional.cosine_similarity(g1.flatten(), g2.flatten(), 0) > 0.999
    assert torch.nn.functional.cosine_similarity(s1.flatten(), s2.flatten(), 0) > 0.999
