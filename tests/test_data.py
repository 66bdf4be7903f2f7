"""Data: built-in corpora, the held-out rule, resumable regeneration, chat templates, length
filtering, packing (target per sample, drafter masks per segment), and the regen tool."""

import ast
import gzip
import json
import os
import random
import re
import sysconfig
from dataclasses import replace

import pytest
import torch
from conftest import get_target

from dflash.config import DataConfig, TargetConfig
from dflash.data.batch import Sample, collate, target_forward
from dflash.data.corpora import (
    check_training_source,
    completion_prompt,
    humaneval_prompts,
    stdlib_corpus,
    stdlib_files,
    stdlib_prompts,
)
from dflash.data.dataset import build_samples, dataset_path, generate_greedy, load_or_build_dataset
from dflash.data.prompts import drop_long_prompts, encode_prompts, random_prompts
from dflash.data.shards import ResponseShards
from dflash.drafter.blocks import block_attention_mask, candidate_anchors, sample_anchors

# ----------------------------------------------------------------------------- stdlib corpus
STDLIB_PART = os.path.join(sysconfig.get_paths()["stdlib"], "email")  # a quick-to-parse slice


def test_stdlib_prompts_are_deterministic_valid_stubs():
    a = stdlib_prompts(60, seed=3, root=STDLIB_PART)
    assert a == stdlib_prompts(60, seed=3, root=STDLIB_PART)
    assert len(a) == 60 and len(set(a)) == 60
    assert set(a) != set(stdlib_prompts(60, seed=4, root=STDLIB_PART))
    for p in a:
        m = re.fullmatch(r"Complete the following Python code\.\n```python\n(.*)```", p, re.S)
        assert m, p
        tree = ast.parse(m.group(1))  # signature + docstring is valid Python
        node = tree.body[0]
        if isinstance(node, ast.ClassDef) and isinstance(
            node.body[-1], (ast.FunctionDef, ast.AsyncFunctionDef)
        ):
            node = node.body[-1]  # a method under its class line
        assert ast.get_docstring(node), p
    whole = stdlib_corpus(STDLIB_PART)
    assert len(stdlib_prompts(10**6, seed=0, root=STDLIB_PART)) == len(
        whole
    )  # all of it, no repeats
    with pytest.raises(ValueError, match="num_samples"):
        stdlib_prompts(0)


def test_stdlib_corpus_is_the_whole_library():
    items = stdlib_corpus()
    assert len(items) > 5000
    assert not any("site-packages" in f or "/test/" in f for f in stdlib_files())
    assert stdlib_prompts(5, seed=1) == stdlib_prompts(5, seed=1)


# ----------------------------------------------------------------------------- HumanEval (held out)
def _fake_humaneval(path, rows):
    with gzip.open(path, "wt") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_humaneval_prompts_from_file_and_default_location(tmp_path, monkeypatch):
    rows = [
        {
            "task_id": f"HumanEval/{i}",
            "prompt": f'def f{i}(x):\n    """Return x."""\n',
            "entry_point": f"f{i}",
        }
        for i in range(3)
    ]
    (tmp_path / "humaneval").mkdir()
    _fake_humaneval(tmp_path / "humaneval" / "HumanEval.jsonl.gz", rows)
    monkeypatch.setenv("DFLASH_ASSETS", str(tmp_path))
    got = humaneval_prompts()
    assert got == [completion_prompt(r["prompt"]) for r in rows]
    assert (
        humaneval_prompts(str(tmp_path / "humaneval" / "HumanEval.jsonl.gz"), raw=True)[1]
        == rows[1]["prompt"]
    )
    # the same format as the training corpus
    assert got[0].split("\n")[0] == stdlib_prompts(1, seed=0)[0].split("\n")[0]


def test_humaneval_missing_or_wrong_file(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_ASSETS", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"fetch_models.sh humaneval"):
        humaneval_prompts()
    bad = tmp_path / "train.jsonl.gz"
    _fake_humaneval(bad, [{"prompt": "x"}])
    with pytest.raises(ValueError, match="is not HumanEval"):
        humaneval_prompts(str(bad))


def test_humaneval_is_never_training_data(tmp_path):
    with pytest.raises(ValueError, match="held out"):
        check_training_source("humaneval")
    with pytest.raises(ValueError, match="looks like HumanEval"):
        check_training_source("jsonl", ["/data/HumanEval.jsonl.gz"])
    with pytest.raises(ValueError, match="looks like HumanEval"):
        check_training_source("jsonl", ["/data/human_eval_prompts.jsonl"])
    check_training_source("stdlib")
    check_training_source("jsonl", ["/data/sharegpt.jsonl"])
    # refused before any target work or file access
    with pytest.raises(ValueError, match="held out"):
        load_or_build_dataset(
            DataConfig(source="humaneval"), TargetConfig(), target=None, cache_dir=str(tmp_path)
        )


# ----------------------------------------------------------------------------- chat template
class FakeTok:
    def __init__(self, template="{{ messages }}{% if enable_thinking %}<think>{% endif %}"):
        self.chat_template = template
        self.calls = []

    def apply_chat_template(self, convs, **kw):  # batched, as transformers' is
        self.calls += [(msgs, kw) for msgs in convs]
        return {"input_ids": [[1, 2, len(msgs[0]["content"])] for msgs in convs]}

    def __call__(self, texts):
        return {"input_ids": [[9, len(t)] for t in texts]}


def test_chat_template_applied_explicitly():
    tok = FakeTok()
    tc = TargetConfig(chat_template=True, enable_thinking=False)
    assert encode_prompts(["abc", [{"role": "user", "content": "hello"}]], tok, tc) == [
        [1, 2, 3],
        [1, 2, 5],
    ]
    msgs, kw = tok.calls[0]
    assert msgs == [{"role": "user", "content": "abc"}]
    assert (
        kw["add_generation_prompt"] is True
        and kw["enable_thinking"] is False
        and kw["tokenize"] is True
    )
    encode_prompts(["x"], tok, replace(tc, enable_thinking=True))
    assert tok.calls[-1][1]["enable_thinking"] is True
    assert encode_prompts(["abcd"], tok, replace(tc, chat_template=False)) == [[9, 4]]


def test_a_conversation_ending_with_an_assistant_turn_is_answered_by_the_target(capsys):
    """[user, assistant] would get a second assistant turn generated after the dataset's answer:
    the trailing assistant turn goes (the target answers the user itself), counted in a line;
    a row of assistant turns only has nothing to answer and is skipped, counted too."""
    from dflash.target.tokenizer import byte_tokenizer

    tok, tc = byte_tokenizer(300), TargetConfig(chat_template=True)
    user = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    answered = user + [{"role": "assistant", "content": "hello"}]
    got = encode_prompts([answered, "q", [{"role": "assistant", "content": "x"}]], tok, tc)
    assert got == encode_prompts([user, "q"], tok, tc)
    kw = dict(add_generation_prompt=True, tokenize=True, return_dict=False, enable_thinking=False)
    assert got[0] == list(tok.apply_chat_template(user, **kw))  # ends: "<|im_start|>assistant\n"
    line = capsys.readouterr().out.splitlines()[0]
    assert line == (
        "data: 2 conversation(s) ended with an assistant turn: dropped it, the target answers "
        "the turn before itself; 1 held only assistant turns and were skipped"
    )


def test_batched_encoding_equals_one_prompt_at_a_time():
    """encode_prompts tokenizes 1,024 prompts a call: the ids equal the tokenizer's own
    one-conversation apply_chat_template (and plain call) for every prompt, across chunks."""
    from dflash.target.tokenizer import byte_tokenizer

    tok = byte_tokenizer(300)
    rng = random.Random(0)
    alphabet = "ab c\n\t{}()éλ中😀<|>"
    prompts = ["".join(rng.choices(alphabet, k=rng.randint(0, 30))) for _ in range(1100)]
    prompts[7] = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    tc = TargetConfig(name="t", chat_template=True, enable_thinking=False)
    got = encode_prompts(prompts, tok, tc)
    for p, ids in zip(prompts, got):
        msgs = p if isinstance(p, list) else [{"role": "user", "content": p}]
        one = tok.apply_chat_template(
            msgs,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            enable_thinking=False,
        )
        assert ids == list(one)
    raw = encode_prompts(prompts[:1030], tok, replace(tc, chat_template=False))
    assert raw[:7] + raw[8:] == [tok(p)["input_ids"] for p in prompts[:1030] if isinstance(p, str)]


def test_chat_template_errors():
    tc = TargetConfig(name="t", chat_template=True)
    with pytest.raises(ValueError, match="has no chat template; set target.chat_template=false"):
        encode_prompts(["x"], FakeTok(template=None), tc)
    with pytest.raises(ValueError, match="no thinking switch; set target.enable_thinking=false"):
        encode_prompts(["x"], FakeTok(template="{{ messages }}"), replace(tc, enable_thinking=True))
    with pytest.raises(ValueError, match="no prompts"):
        encode_prompts([], FakeTok(), tc)


# ----------------------------------------------------------------------------- lengths, empty
def test_too_long_rows_truncated_or_dropped_and_counted():
    prompts = [[1, 2, 3], [1, 2, 3, 4, 5, 6], [1] * 9]
    responses = [[7, 8], [7, 8, 9, 10], [7]]
    s, st = build_samples(prompts, responses, max_length=8, too_long="truncate")
    assert [x.input_ids.numel() for x in s] == [5, 8]
    assert st["truncated"] == 2 and st["dropped"] == 1  # the third keeps no response token
    assert s[1].loss_mask.tolist() == [False] * 6 + [True] * 2
    s, st = build_samples(prompts, responses, max_length=8, too_long="drop")
    assert [x.sample_id for x in s] == [0] and st["dropped"] == 2 and st["truncated"] == 0
    kept, n = drop_long_prompts(prompts, 6)
    assert kept == [[1, 2, 3]] and n == 2


def test_empty_dataset_is_refused():
    with pytest.raises(ValueError, match="dataset is empty"):
        build_samples([[1] * 9], [[2]], max_length=4, too_long="drop")
    with pytest.raises(ValueError, match="dataset is empty"):
        build_samples([[1]], [[]], max_length=4, too_long="drop")


def test_text_source_without_tokenizer_is_refused(tmp_path, tiny_llama):
    from dflash.target.capture import Target

    tc = TargetConfig(name="tiny_llama")
    bare = Target(tiny_llama.model, tiny_llama.layer_ids, tokenizer=None)
    with pytest.raises(ValueError, match="needs a target with a tokenizer.*target.tokenizer=bytes"):
        load_or_build_dataset(DataConfig(source="stdlib", num_samples=2), tc, bare, str(tmp_path))


# ----------------------------------------------------------------------------- resumable regeneration
class Interrupt(Exception):
    pass


def _counting_generate(model, fail_after=None):
    real, calls = type(model).generate.__get__(model), []

    def gen(*a, **kw):
        if fail_after is not None and len(calls) >= fail_after:
            raise Interrupt()
        calls.append(kw["input_ids"].shape[0])
        return real(*a, **kw)

    return gen, calls


def test_interrupted_regeneration_resumes_to_the_same_result(tmp_path, tiny_llama, monkeypatch):
    prompts = random_prompts(10, 6, tiny_llama.vocab_size, [tiny_llama.mask_token_id], seed=5)
    prompts[3] = prompts[3][:3]  # mixed lengths: left padding inside a batch
    kw = dict(max_new_tokens=5, batch_size=3)
    ref = generate_greedy(tiny_llama, prompts, **kw)

    partial = str(tmp_path / "x.pt.partial")
    gen, calls = _counting_generate(tiny_llama.model, fail_after=2)
    monkeypatch.setattr(tiny_llama.model, "generate", gen)
    with pytest.raises(Interrupt):
        generate_greedy(tiny_llama, prompts, partial_path=partial, **kw)
    assert len(ResponseShards(partial).load(None)) == 6  # two batches streamed to shards

    gen, calls = _counting_generate(tiny_llama.model)
    monkeypatch.setattr(tiny_llama.model, "generate", gen)
    logs = []
    out = generate_greedy(tiny_llama, prompts, partial_path=partial, log=logs.append, **kw)
    assert out == ref
    assert calls == [3, 1]  # only the two remaining batches ran
    assert any("resuming regeneration at 6" in m for m in logs)

    # a partial file written for other prompts is ignored, not spliced in
    logs.clear()
    other = generate_greedy(tiny_llama, prompts[:4], partial_path=partial, log=logs.append, **kw)
    assert other == ref[:4] and any("written for other prompts" in m for m in logs)


def test_regenerated_dataset_is_cached_and_resumed(tmp_path, tiny_llama):
    dc = DataConfig(
        source="selfgen",
        num_samples=6,
        prompt_len=4,
        response_len=4,
        max_length=16,
        regen_batch_size=4,
    )
    tc = TargetConfig(name="tiny_llama")
    logs = []
    a = load_or_build_dataset(dc, tc, tiny_llama, str(tmp_path), log=logs.append)
    path = dataset_path(dc, tc, str(tmp_path))
    assert os.path.exists(path) and not os.path.exists(path + ".partial")
    b = load_or_build_dataset(dc, tc, tiny_llama, str(tmp_path), log=logs.append)
    assert "from cache" in logs[-1]
    assert all(
        torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        for x, y in zip(a, b)
    )
    assert dataset_path(replace(dc, pack_to=64), tc, str(tmp_path)) == path  # packing: same data
    assert dataset_path(replace(dc, regen_compact=True), tc, str(tmp_path)) == path  # same tokens


def test_regen_time_limit_keeps_a_random_subset_of_whole_batches(tmp_path, tiny_llama, monkeypatch):
    """data.regen_time_limit_min: no batch starts past the limit; the prompts reached are whole
    batches in a seeded random order (not the shortest prompts), their responses are those of
    a run without a limit, and the dataset says how many were not reached."""
    import dflash.data.dataset as data_mod

    g = torch.Generator().manual_seed(3)
    lens = torch.randint(2, 9, (24,), generator=g).tolist()
    prompts = [torch.randint(0, 400, (n,), generator=g).tolist() for n in lens]
    ref = generate_greedy(tiny_llama, prompts, 4, batch_size=3)
    clock = iter(range(1000))  # each read of the clock: one more "second"
    monkeypatch.setattr(data_mod.time, "perf_counter", lambda: float(next(clock)))
    # batches start at clock reads 1, 2, ...: a 2.5 s limit lets two batches run
    out = generate_greedy(tiny_llama, prompts, 4, batch_size=3, time_limit_s=2.5)
    reached = [j for j, r in enumerate(out) if r is not None]
    assert len(reached) == 6
    assert sorted(lens[j] for j in reached) != sorted(lens)[:6]  # not the shortest six
    assert [out[j] for j in reached] == [ref[j] for j in reached]  # the same batches

    dc = DataConfig(
        source="selfgen",
        num_samples=12,
        prompt_len=4,
        response_len=3,
        max_length=16,
        regen_batch_size=2,
        regen_time_limit_min=1.5 / 60,
    )
    logs = []
    clock = iter(range(1000))
    samples = load_or_build_dataset(
        dc, TargetConfig(name="tiny_llama"), tiny_llama, str(tmp_path), log=logs.append
    )
    assert len(samples) == 2
    assert any("time limit" in m and "after 2 of 12" in m for m in logs)
    assert any("not_reached_in_time 10" in m for m in logs)
    with pytest.raises(ValueError, match="regen_time_limit_min"):
        replace(dc, regen_time_limit_min=0).validate()


# ----------------------------------------------------------------------------- packing
def _samples(target, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, target.vocab_size - 1, (n,), generator=g)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 3 :] = True
        out.append(Sample(100 + i, ids, mask))
    return out


def test_collate_packs_first_fit():
    t = type("T", (), {"vocab_size": 50})()
    b = collate(_samples(t, [10, 7, 5, 12, 3]), pad_id=0, pack_to=16)
    # rows [10, 5], [7, 3], [12]: width = the fullest row
    assert b.input_ids_NT.shape == (3, 15)
    assert b.sample_ids.tolist() == [100, 102, 101, 104, 103]
    assert b.segment_ids_NT[0].tolist() == [0] * 10 + [1] * 5
    assert b.segment_ids_NT[1].tolist() == [2] * 7 + [3] * 3 + [-1] * 5
    assert b.position_ids_NT[0, 10:15].tolist() == list(range(5))
    assert b.row_seeds == [100, 101, 103]


@pytest.mark.parametrize("name", ["tiny_qwen3_5", "tiny_llama"])
def test_packed_target_forward_equals_unpacked_per_sample(name):
    target = get_target(name, num_aux=3)
    samples = _samples(target, [11, 6, 9, 4, 13])
    packed = target_forward(target, collate(samples, pad_id=0, pack_to=24))
    assert packed.input_ids_NT.shape[0] < len(samples)
    for s in samples:
        alone = target.capture(s.input_ids[None])
        r, c = (
            (packed.segment_ids_NT >= 0)
            .nonzero()[
                (
                    packed.sample_ids[packed.segment_ids_NT[packed.segment_ids_NT >= 0]]
                    == s.sample_id
                )
            ]
            .unbind(-1)
        )
        assert r.unique().numel() == 1 and c.numel() == s.input_ids.numel()
        torch.testing.assert_close(packed.aux_NTF[r, c], alone.aux_NTF[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(packed.next_token_NT[r, c], alone.next_token_NT[0])


def test_drafter_masks_never_cross_segments():
    t = type("T", (), {"vocab_size": 50})()
    b = collate(_samples(t, [9, 7, 5, 12, 6, 4]), pad_id=0, pack_to=20)
    cand = candidate_anchors(b.segment_ids_NT, b.loss_mask_NT)
    anchors, valid = sample_anchors(cand, 64, b.row_seeds)
    B = 4
    for window, causal in ((None, False), (3, True)):
        m = block_attention_mask(
            anchors,
            valid,
            b.position_ids_NT,
            b.segment_ids_NT,
            B,
            causal_in_block=causal,
            window=window,
        )[:, 0]
        N, T = b.segment_ids_NT.shape
        A = anchors.shape[1]
        ctx = m[..., :T].reshape(N, A, B, T)
        blk = m[..., T:].reshape(N, A, B, A, B)
        seg_a = b.segment_ids_NT.gather(1, anchors)
        j = torch.arange(T)
        allowed = (
            (b.segment_ids_NT[:, None, :] == seg_a[:, :, None])
            & (j < anchors[:, :, None])
            & valid[..., None]
        )
        assert not (
            ctx & ~allowed[:, :, None, :]
        ).any()  # no other sample, nothing at/after the anchor
        assert ctx.any()
        eye = torch.eye(A, dtype=torch.bool)[None, :, None, :, None]
        assert not (blk & ~eye).any()  # blocks never see each other
        # anchors of one row that belong to different samples never share any key
        assert seg_a[valid].unique().numel() > 1


# ----------------------------------------------------------------------------- regen tool
def test_regen_tool_writes_the_training_cache(tmp_path, capsys):
    from dflash.tools import regen

    args = [
        "--target",
        "tiny_llama",
        "--data",
        "selfgen",
        "--set",
        "num_samples=5",
        "response_len=4",
        "max_length=32",
        "regen_batch_size=2",
    ]
    assert (
        regen.main(args + ["--cache-dir", str(tmp_path), "--jsonl", str(tmp_path / "s.jsonl")]) == 0
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["samples"] == 5 and summary["response_tokens"] == 20
    rows = [json.loads(line) for line in open(tmp_path / "s.jsonl")]
    assert len(rows) == 5 and len(rows[0]["response_ids"]) == 4
    # a training run with the same settings and data.cache_dir finds it
    from dflash.target.load import target_config_from_yaml

    dc = DataConfig(
        source="selfgen",
        num_samples=5,
        response_len=4,
        max_length=32,
        regen_batch_size=2,
        prompt_len=16,
        seed=1234,
    )
    tc = target_config_from_yaml("tiny_llama")
    assert summary["out"] == dataset_path(dc, tc, str(tmp_path))
    logs = []
    load_or_build_dataset(dc, tc, None, str(tmp_path), log=logs.append)
    assert "from cache" in logs[-1]
    assert regen.main(args + ["--out", str(tmp_path / "a.pt"), "--cache-dir", str(tmp_path)]) == 2
    assert (
        regen.main(
            [
                "--target",
                "tiny_llama",
                "--data",
                "selfgen",
                "--set",
                "source=humaneval",
                "--out",
                str(tmp_path / "h.pt"),
            ]
        )
        == 2
    )
    assert "held out" in capsys.readouterr().err


def test_jsonl_prompts_and_empty_files(tmp_path):
    from dflash.data.files import text_prompts

    good = tmp_path / "p.jsonl"
    good.write_text(
        '{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "b"}]}\n{"prompt": "c"}\n'
    )
    assert text_prompts(DataConfig(source="jsonl", paths=[str(good)], num_samples=2)) == [
        "a",
        [{"role": "user", "content": "b"}],
    ]
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="hold no rows"):
        text_prompts(DataConfig(source="jsonl", paths=[str(empty)]))
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match=r"b.jsonl:1: rows need a 'prompt' or 'messages' field"):
        text_prompts(DataConfig(source="jsonl", paths=[str(bad)]))
    with pytest.raises(FileNotFoundError, match="not found"):
        text_prompts(DataConfig(source="jsonl", paths=[str(tmp_path / "none.jsonl")]))


def test_eval_prompts_are_held_out_from_training(tmp_path):
    """Same source for training and eval: eval takes rows training never sees."""
    import json as _json

    from dflash.config import DataConfig, EvalConfig, RunConfig, TargetConfig
    from dflash.data.files import text_prompts
    from dflash.eval.sets import heldout_text_prompts

    f = tmp_path / "p.jsonl"
    f.write_text("".join(_json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(20)))
    for data in (
        DataConfig(source="jsonl", paths=[str(f)], num_samples=12),
        DataConfig(source="stdlib", num_samples=64, seed=3),
    ):
        rc = RunConfig(
            target=TargetConfig(config={"model_type": "llama"}),
            data=data,
            eval=EvalConfig(num_prompts=6),
        )
        train = {str(p) for p in text_prompts(data)}
        ev = heldout_text_prompts(rc)
        assert len(ev) == 6 and not train & {str(p) for p in ev}
    rc = RunConfig(
        target=TargetConfig(config={"model_type": "llama"}),
        data=DataConfig(source="jsonl", paths=[str(f)], num_samples=20),
        eval=EvalConfig(num_prompts=4),
    )
    with pytest.raises(ValueError, match="no held-out prompts"):
        heldout_text_prompts(rc)


def test_eval_set_cache_is_shared_across_data_cache_dirs(tmp_path, tiny_llama):
    """data.cache_dir (and batch packing, the static decoder's options) do not change an eval
    set: another run with the same eval set reads it from the cache instead of rebuilding it."""
    from dflash.config import EvalConfig, RunConfig
    from dflash.eval.sets import build_eval_set

    def cfg(**data):
        return RunConfig(
            data=DataConfig(source="selfgen", num_samples=4, prompt_len=4, **data),
            eval=EvalConfig(num_prompts=2, completion_len=6, batch_size=2),
        )

    logs = []
    a = build_eval_set(cfg(cache_dir="/a"), tiny_llama, str(tmp_path), log=logs.append)
    assert not any("from cache" in m for m in logs)
    for other in (dict(cache_dir="/b"), dict(pack_to=64), dict(regen_compact=True)):
        logs.clear()
        b = build_eval_set(cfg(**other), tiny_llama, str(tmp_path), log=logs.append)
        assert any("from cache" in m for m in logs), other
        assert [torch.equal(x.aux_TF, y.aux_TF) for x, y in zip(a, b)] == [True, True]
    cache, tokens = sorted(f for f in os.listdir(tmp_path) if f.startswith("eval-"))
    assert tokens == cache.replace(".safetensors", ".tokens.safetensors")
    for f in (cache, tokens):
        assert os.stat(tmp_path / f).st_mode & 0o044 == 0o044  # readable by group and others


_EXECUTION_ONLY = dict(
    compile_layers=True, compile_gdn="mlp", capture_graphs=False, packed_capture=False,
    check_memory=False,
)  # fmt: skip


def test_the_targets_execution_settings_key_neither_cache(tmp_path, tiny_llama):
    """How the target runs the training capture (compiled layers, CUDA graphs, packing, the
    memory check) changes neither the regenerated data nor the eval sets (built eagerly, one row
    at a time): switching one reuses both caches; a setting that changes the forward does not."""
    from dflash.config import EvalConfig, RunConfig
    from dflash.config.model import TARGET_EXECUTION_ONLY
    from dflash.eval.sets import build_eval_set

    assert set(_EXECUTION_ONLY) == set(TARGET_EXECUTION_ONLY)
    dc = DataConfig(source="selfgen", num_samples=4, prompt_len=4)
    tc = TargetConfig(name="tiny_llama")
    path = dataset_path(dc, tc, str(tmp_path))
    assert dataset_path(dc, replace(tc, **_EXECUTION_ONLY), str(tmp_path)) == path
    assert dataset_path(dc, replace(tc, dtype="bfloat16"), str(tmp_path)) != path

    def cfg(**target):
        return RunConfig(
            target=replace(RunConfig().target, **target),
            data=dc,
            eval=EvalConfig(num_prompts=2, completion_len=6, batch_size=2),
        )

    build_eval_set(cfg(), tiny_llama, str(tmp_path / "ev"), log=lambda *_: None)
    files = sorted(os.listdir(tmp_path / "ev"))
    logs = []
    build_eval_set(cfg(**_EXECUTION_ONLY), tiny_llama, str(tmp_path / "ev"), log=logs.append)
    assert any("from cache" in m for m in logs) and sorted(os.listdir(tmp_path / "ev")) == files


def test_dtype_auto_names_the_cache_of_the_dtype_it_resolves_to(tmp_path, monkeypatch):
    """`target.dtype=auto` is float32 on a CPU and bfloat16 on a GPU, whose texts differ at
    near-ties: the data cache and the eval set are named by the resolved dtype, so the same
    command on the two machines does not share a cache, and auto on a CPU is float32's."""
    import torch

    from dflash.config import RunConfig
    from dflash.eval.sets import _set_names

    class _T:
        layer_ids = [1]

    dc = DataConfig(source="selfgen", num_samples=4, prompt_len=4)
    auto, fp32, bf16 = (
        TargetConfig(name="tiny_llama", dtype=d) for d in ("auto", "float32", "bfloat16")
    )
    sets = {
        d: _set_names(RunConfig(target=replace(RunConfig().target, dtype=d, device="cpu")), _T, {}, "eval")[0]
        for d in ("auto", "float32", "bfloat16")
    }  # fmt: skip
    assert dataset_path(dc, auto, str(tmp_path)) == dataset_path(dc, fp32, str(tmp_path))
    assert sets["auto"] == sets["float32"] != sets["bfloat16"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the same command on a GPU
    assert dataset_path(dc, auto, str(tmp_path)) == dataset_path(dc, bf16, str(tmp_path))
    assert dataset_path(dc, auto, str(tmp_path)) != dataset_path(dc, fp32, str(tmp_path))


def test_caches_named_before_the_execution_settings_left_their_key_are_still_read(
    tmp_path, tiny_llama, monkeypatch
):
    """A data cache, a regeneration's partial files and an eval set written under their names of
    before 2026-12-07 (the execution-only target settings in the key) are read, not rebuilt: a
    resumed run keeps its data and its eval text."""
    import dflash.data.dataset as dataset
    import dflash.eval.sets as sets
    from dflash.config import EvalConfig, RunConfig

    dc = DataConfig(source="selfgen", num_samples=4, prompt_len=4, response_len=4, max_length=16)
    tc = TargetConfig(name="tiny_llama", compile_layers=True)
    a = load_or_build_dataset(dc, tc, tiny_llama, str(tmp_path), log=lambda *_: None)
    new = dataset_path(dc, tc, str(tmp_path))
    old = str(tmp_path / f"train-{dataset.data_fingerprint(dc, tc, legacy=True)}.pt")
    assert old != new
    os.rename(new, old)

    def no_regeneration(*_a, **_k):
        raise AssertionError("the data was regenerated")

    monkeypatch.setattr(dataset, "regenerate_dataset", no_regeneration)
    logs = []
    b = load_or_build_dataset(dc, tc, tiny_llama, str(tmp_path), log=logs.append)
    assert any(f"earlier name {old}" in m for m in logs), logs
    assert [x.input_ids.tolist() for x in a] == [x.input_ids.tolist() for x in b]
    os.remove(old)
    os.makedirs(old + ".partial")  # a regeneration stopped half-way goes on under its name
    assert dataset_path(dc, tc, str(tmp_path)) == old

    rc = RunConfig(
        target=replace(RunConfig().target, compile_layers=True),
        data=dc,
        eval=EvalConfig(num_prompts=2, completion_len=6, batch_size=2),
    )
    with monkeypatch.context() as m:  # the set written as before: every target setting keyed
        m.setattr(sets, "TARGET_EXECUTION_ONLY", ())
        m.setattr(sets, "concrete_settings", vars)  # and "auto" not yet resolved
        items = sets.build_eval_set(rc, tiny_llama, str(tmp_path / "ev"), log=lambda *_: None)
    (legacy, _) = sorted(os.listdir(tmp_path / "ev"))

    def no_generation(*_a, **_k):
        raise AssertionError("the eval set was generated again")

    monkeypatch.setattr(sets, "generate_greedy", no_generation)
    logs.clear()
    again = sets.build_eval_set(rc, tiny_llama, str(tmp_path / "ev"), log=logs.append)
    assert any(f"from cache {tmp_path / 'ev' / legacy}" in m for m in logs), logs
    assert [torch.equal(x.aux_TF, y.aux_TF) for x, y in zip(items, again)] == [True, True]


def test_an_eval_set_without_its_cache_is_rebuilt_from_its_tokens_file(
    tmp_path, tiny_llama, monkeypatch
):
    """A run directory copied without its eval cache (a relay leg's pack, another machine) keeps
    the ~1 % tokens file: the same prompts and completions come back without generating again
    (a regenerated completion could change at a near-tie), the states recomputed along them."""
    import dflash.eval.sets as sets
    from dflash.config import EvalConfig, RunConfig

    rc = RunConfig(
        data=DataConfig(source="selfgen", num_samples=4, prompt_len=4),
        eval=EvalConfig(num_prompts=3, completion_len=6, batch_size=2),
    )
    a = sets.build_eval_set(rc, tiny_llama, str(tmp_path / "run"), log=lambda *_: None)
    cache, tokens = sorted((tmp_path / "run").iterdir())
    assert tokens.stat().st_size < cache.stat().st_size / 5
    moved = tmp_path / "moved"
    moved.mkdir()
    os.rename(tokens, moved / tokens.name)  # the tokens file alone, where eval.py reads
    os.remove(cache)

    def no_generation(*_a, **_k):
        raise AssertionError("the eval set was generated again")

    monkeypatch.setattr(sets, "generate_greedy", no_generation)
    logs = []
    b = sets.build_eval_set(rc, tiny_llama, str(tmp_path / "new"), logs.append, read_dirs=(moved,))
    assert any(f"prompts and completions of {moved / tokens.name}" in m for m in logs), logs
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert torch.equal(x.prompt_ids, y.prompt_ids)
        assert torch.equal(x.completion_ids, y.completion_ids)
        assert torch.allclose(x.aux_TF, y.aux_TF) and torch.allclose(x.final_LH, y.final_LH)
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == [cache.name, tokens.name]
    os.remove(tmp_path / "new" / tokens.name)  # a cache written before tokens files existed
    sets.build_eval_set(rc, tiny_llama, str(tmp_path / "new"), log=lambda *_: None)
    assert (tmp_path / "new" / tokens.name).read_bytes() == (moved / tokens.name).read_bytes()


def test_sampled_regeneration_is_seeded_and_not_greedy(tiny_llama):
    """data.regen_temperature > 0 samples the answers through HF generate: the same seed gives
    the same answers, another seed others, and neither is the greedy text."""
    from dflash.data.dataset import _generate_batch

    prompts = random_prompts(4, 4, tiny_llama.vocab_size, [tiny_llama.mask_token_id], seed=5)
    greedy = _generate_batch(tiny_llama, prompts, 12, 0.0, seed=0)
    a, b = (_generate_batch(tiny_llama, prompts, 12, 1.5, seed=s) for s in (1, 1))
    c = _generate_batch(tiny_llama, prompts, 12, 1.5, seed=2)
    assert a == b and a != c and a != greedy and all(0 < len(r) <= 12 for r in a)


def test_completions_cut_at_a_parting_forward_are_counted(tiny_llama):
    """A completion the one-shot forward parts from (a near-tie on the GPU; here a wrong token)
    is cut there, and the build line says how many were cut and how many left out."""
    from dflash.data.dataset import generate_greedy
    from dflash.eval.greedy import checked_items

    prompts = random_prompts(3, 4, tiny_llama.vocab_size, [tiny_llama.mask_token_id], seed=2)
    comps = [list(c) for c in generate_greedy(tiny_llama, prompts, 6, 3)]
    comps[0][3] = (comps[0][3] + 1) % tiny_llama.vocab_size  # parts at token 3: cut to 3
    comps[1][1] = (comps[1][1] + 1) % tiny_llama.vocab_size  # cut to 1: left out
    logs = []
    items = checked_items(tiny_llama, list(zip(prompts, comps)), 0.0, logs.append)
    assert [it.completion_ids.tolist() for it in items] == [comps[0][:3], comps[2]]
    assert "(2 of 3 completions cut where" in logs[-1] and "; 1 left out" in logs[-1], logs


def test_regeneration_says_how_long_it_will_take_after_the_first_batch(tiny_llama, monkeypatch):
    """A first try with sizes meant for a large target must not look hung: after the first
    batch a line gives the rate's estimate of the rest, then one every few minutes."""
    import dflash.data.dataset as data_mod

    prompts = random_prompts(10, 4, tiny_llama.vocab_size, [tiny_llama.mask_token_id], seed=1)
    clock = iter(range(0, 10000, 10))  # each read of the clock: 10 s later
    monkeypatch.setattr(data_mod.time, "perf_counter", lambda: float(next(clock)))
    logs = []
    generate_greedy(tiny_llama, prompts, 3, batch_size=3, log=logs.append)
    eta = [m for m in logs if " to go at this rate" in m]
    assert eta[0] == (
        "regenerate: 3 of 10 prompts in 20 s; ~47 s to go at this rate (data.num_samples, "
        "data.response_len and data.regen_batch_size set the work)"
    ), logs
    assert len(eta) == 1  # the next batches come within the next few minutes


def test_a_regeneration_killed_as_it_started_restarts_by_itself(tmp_path, tiny_llama):
    """A kill between making `<cache>.partial/` and writing its key left a folder every later
    start failed on (`[Errno 2] .../key`, with a shared data.cache_dir every run): it is
    started over with a line; an unreadable shard is regenerated from there."""
    prompts = random_prompts(6, 4, tiny_llama.vocab_size, [tiny_llama.mask_token_id], seed=2)
    ref = generate_greedy(tiny_llama, prompts, 3, batch_size=2)
    partial = tmp_path / "train-x.pt.partial"
    partial.mkdir()
    logs = []
    out = generate_greedy(
        tiny_llama, prompts, 3, batch_size=2, partial_path=str(partial), log=logs.append
    )
    assert out == ref and any("starting over" in m and "no key file" in m for m in logs), logs
    shard = partial / "shard_000001.npz"
    shard.write_bytes(b"PK\x03\x04 damaged")
    logs.clear()
    assert ResponseShards(str(partial)).load(None, logs.append) == ref_first_batch(ref, prompts, 2)
    assert any("shard_000001.npz is unreadable" in m for m in logs) and not shard.exists()


def ref_first_batch(ref, prompts, batch_size):
    from dflash.data.dataset import _regen_order

    order = _regen_order(prompts, batch_size, 0)
    return [ref[j] for j in order[:batch_size]]
