"""The static-cache greedy decoder gives HF `generate`'s tokens (CPU: eager steps; the CUDA
graph path is in the GPU tier), and datasets/partials round-trip through the shard formats."""

import torch

from dflash.batch import Sample
from dflash.regen import StaticGreedyDecoder, cut_at_eos, hf_greedy_batch, left_pad, supports_static
from dflash.shards import ResponseShards, pack_samples, unpack_samples


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 12, (n,), generator=g).tolist()
    return [torch.randint(0, 500, (k,), generator=g).tolist() for k in lens]


def test_static_decoder_equals_generate(tiny_llama):
    prompts = _prompts(5)
    ref = hf_greedy_batch(tiny_llama, prompts, 20, 0, None)
    ids, att = left_pad(prompts, 0)
    got = cut_at_eos(StaticGreedyDecoder(tiny_llama.model).run(ids, att, 20, None), None)
    assert got == ref
    # an EOS that some rows produce mid-way: rows are cut after it, exactly as generate does
    eos = ref[1][7]
    ref_eos = hf_greedy_batch(tiny_llama, prompts, 20, 0, eos)
    got_eos = cut_at_eos(StaticGreedyDecoder(tiny_llama.model).run(ids, att, 20, eos), eos)
    assert got_eos == ref_eos and any(len(r) < 20 for r in got_eos)


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
