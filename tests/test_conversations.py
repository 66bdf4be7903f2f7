"""Conversations: every row format read into one form, bad rows named, skipped rows counted,
multi-turn regeneration (the target's own answers turn by turn, loss on its tokens only, cut at
turn boundaries) and mixtures at their weights."""

import gzip
import json
import os
from dataclasses import replace

import pytest
import torch
from conftest import make_drafter, target_cfg

from dflash.config import DataConfig, MixSourceConfig
from dflash.data.batch import Sample, collate, target_forward
from dflash.data.dataset import dataset_path, generate_greedy, load_or_build_dataset
from dflash.data.files import read_conversations, text_prompts
from dflash.data.mix import mix_quotas, mix_report, training_conversations
from dflash.data.prompts import TokenTable
from dflash.data.rounds import dialogue_samples, run_turns
from dflash.data.stream import SampleStream
from dflash.data.turns import TurnPrompts

SHAREGPT = {
    "id": "c1",
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi there"},
        {"from": "gpt", "value": "Hello!"},
        {"from": "user", "value": "And then?"},
        {"from": "chatgpt", "value": "Then this."},
    ],
}
OPENAI = {
    "id": "c1",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": "Then this."},
    ],
}
NORMAL = OPENAI["messages"]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _cfg(paths, **kw):
    return DataConfig(source=kw.pop("source", "jsonl"), paths=list(paths), **kw)


# ----------------------------------------------------------------------------- formats
def test_every_format_reads_as_the_same_conversation(tmp_path):
    import datasets

    rows = [SHAREGPT, {"id": "p", "prompt": "plain"}]
    want = [NORMAL, [{"role": "user", "content": "plain"}]]
    files = {
        "sharegpt.jsonl": _jsonl(tmp_path / "sharegpt.jsonl", rows),
        "openai.jsonl.gz": str(tmp_path / "openai.jsonl.gz"),
        "list.json": str(tmp_path / "list.json"),
    }
    with gzip.open(files["openai.jsonl.gz"], "wt") as f:
        f.write(json.dumps(OPENAI) + "\n" + json.dumps(rows[1]) + "\n")
    (tmp_path / "list.json").write_text(json.dumps(rows, indent=2))
    for name, path in files.items():
        convs = read_conversations(_cfg([path]))
        assert [c.messages for c in convs] == want, name
        assert [c.cid for c in convs] == ["c1", "p"] and convs[1].plain
    # Hugging Face datasets: a save_to_disk directory, and parquet / arrow / jsonl files
    ds = datasets.Dataset.from_list([OPENAI])
    ds.save_to_disk(str(tmp_path / "saved"))
    ds.to_parquet(str(tmp_path / "t.parquet"))
    ds.to_json(str(tmp_path / "t.jsonl"))
    arrow = next(f for f in os.listdir(tmp_path / "saved") if f.endswith(".arrow"))
    for p in ["saved", "t.parquet", f"saved/{arrow}", "t.jsonl"]:
        convs = read_conversations(_cfg([str(tmp_path / p)], source="hf"))
        assert [c.messages for c in convs] == [NORMAL] and convs[0].cid == "c1", p
    convs = read_conversations(_cfg([str(tmp_path / "t.parquet")], source="parquet"))
    assert convs[0].messages == NORMAL
    # the first prompt of each turns mode (the old API: text_prompts)
    f = files["sharegpt.jsonl"]
    assert text_prompts(_cfg([f], turns="first"))[0] == NORMAL[:2]
    assert text_prompts(_cfg([f], turns="last"))[0] == NORMAL[:4]
    assert text_prompts(_cfg([f]))[1] == "plain"


def test_format_is_detected_per_row_and_data_format_insists(tmp_path):
    f = _jsonl(tmp_path / "m.jsonl", [SHAREGPT, OPENAI, {"prompt": "p"}])
    assert len(read_conversations(_cfg([f]))) == 3
    with pytest.raises(ValueError, match=r"m.jsonl:2: rows need 'conversations': a list of"):
        read_conversations(_cfg([f], format="sharegpt"))
    with pytest.raises(ValueError, match=r"m.jsonl:1: rows need 'messages'"):
        read_conversations(_cfg([f], format="openai"))
    with pytest.raises(ValueError, match=r"m.jsonl:1: rows need a 'prompt' string"):
        read_conversations(_cfg([f], format="prompt"))


@pytest.mark.parametrize(
    "name,text,where,expect",
    [
        (
            "s.jsonl",
            '{"conversations": [{"from": "human", "value": "a"}]}\n\n'
            '{"conversations": [{"from": "human", "value": 7}]}\n',
            ":3: ",
            "'conversations' must be a non-empty list of {'from': str, 'value': str}",
        ),
        (
            "o.jsonl",
            '{"messages": [{"role": "user", "content": "a"}]}\n{"messages": {"role": "user"}}\n',
            ":2: ",
            "'messages' must be a non-empty list of {'role': str, 'content': str}",
        ),
        ("p.jsonl", '{"prompt": "a"}\n{"prompt": ["x"]}\n', ":2: ", "'prompt' must be a string"),
        (
            "l.json",
            '[\n  {"prompt": "a"},\n\n  {"conversations": "no"}\n]\n',
            ":4: ",
            "'conversations' must be a non-empty list",
        ),
        ("b.json", '[\n  {"prompt": "a"},\n  {"prompt": oops}\n]\n', ":3: ", "not valid JSON"),
        ("n.jsonl", '{"prompt": "a"}\n{"text": "b"}\n', ":2: ", "rows need a 'prompt' or"),
    ],
)
def test_a_malformed_row_of_each_format_is_named_with_file_and_line(
    tmp_path, name, text, where, expect
):
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError) as e:
        read_conversations(_cfg([str(tmp_path / name)]))
    msg = str(e.value)
    assert msg.startswith(str(tmp_path / name) + where) and expect in msg and "\n" not in msg, msg


def test_a_malformed_arrow_row_is_named_with_file_and_row(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"prompt": "a"}, {"prompt": ""}, {"prompt": None}]).to_parquet(
        str(tmp_path / "t.parquet")
    )
    with pytest.raises(ValueError, match=r"t.parquet row 2: 'prompt' must be a string"):
        read_conversations(_cfg([str(tmp_path / "t.parquet")], source="parquet"))


def test_skipped_rows_are_counted_by_reason_in_the_log(tmp_path):
    rows = [
        SHAREGPT,
        {"conversations": [{"from": "tool", "value": "x"}, {"from": "human", "value": "q"}]},
        {"conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "a"}]},
        {"conversations": [{"from": "gpt", "value": "only an answer"}]},
        {
            "conversations": [
                {"from": "human", "value": "q"},
                {"from": "gpt", "value": ""},
                {"from": "human", "value": "r"},
            ]
        },
        {"messages": [{"role": "function", "content": "x"}]},
        {"id": "empty", "conversations": []},  # real ShareGPT dumps hold such rows
    ]
    f = _jsonl(tmp_path / "s.jsonl", rows)
    logs = []
    convs = read_conversations(_cfg([f]), log=logs.append)
    # an empty answer of the dataset is never used under turns=all: that row is kept
    assert [c.messages[0]["content"] for c in convs] == ["Be brief.", "q"]
    assert logs == [
        f"data: skipped 5 rows of [{f!r}] (no user turn: 2 (first at {f}:4), "
        f"unknown role 'tool': 1 (first at {f}:2), empty turn: 1 (first at {f}:3), "
        f"unknown role 'function': 1 (first at {f}:6))"
    ]
    # under turns=last the dataset's own answers are the history: an empty one is skipped too
    logs.clear()
    last = read_conversations(_cfg([f], turns="last"), log=logs.append)
    assert len(last) == 1 and "empty turn: 2" in logs[0]
    with pytest.raises(ValueError, match="every row was skipped: no user turn: 1"):
        read_conversations(_cfg([_jsonl(tmp_path / "e.jsonl", rows[3:4])]))


# ----------------------------------------------------------------------------- multi-turn
CONVS = [
    {
        "id": "a",
        "conversations": [
            {"from": "system", "value": "You are terse."},
            {"from": "human", "value": "What is 2+2?"},
            {"from": "gpt", "value": "four (the dataset's answer, never trained on)"},
            {"from": "human", "value": "And 3+3?"},
            {"from": "human", "value": "Thanks"},
        ],
    },
    {"id": "b", "messages": [{"role": "user", "content": "Name a colour."}]},
    {
        "id": "c",
        "messages": [
            {"role": "assistant", "content": "Hi, ask me."},
            {"role": "user", "content": "Why?"},
            {"role": "assistant", "content": "Because."},
            {"role": "user", "content": "OK"},
        ],
    },
]


def _reference_samples(target, convs, response_len, max_turns=None, answer=None):
    """An independent turn-by-turn loop: the byte template's text written out by hand, one
    conversation and one turn at a time, each answer generated (batch 1) after the target's
    own earlier answers (or answer(conversation, turn), when given: its token ids; None ends the
    conversation)."""
    tok = target.tokenizer
    think = "<think>\n\n</think>\n\n"  # enable_thinking=false on the tiny template
    out = []
    for conv in convs:
        msgs = [
            {
                "role": {"human": "user", "gpt": "assistant"}.get(m.get("from"), m.get("from")),
                "content": m["value"],
            }
            if "from" in m
            else m
            for m in conv.get("conversations", conv.get("messages"))
        ]
        text = "".join(
            f"<|im_start|>system\n{m['content']}<|im_end|>\n" for m in msgs if m["role"] == "system"
        )
        ids, mask = [], []
        for k, m in enumerate([m for m in msgs if m["role"] == "user"][:max_turns]):
            a = None if answer is None else answer(conv, k)
            if answer is not None and a is None:
                break
            if ids:  # the end of the previous answer's turn (its EOS when it generated one)
                text = ("" if ids[-1] == tok.eos_token_id else "<|im_end|>") + "\n"
            text += f"<|im_start|>user\n{m['content']}<|im_end|>\n<|im_start|>assistant\n{think}"
            new = tok(text, add_special_tokens=False)["input_ids"]
            ids, mask = ids + new, mask + [False] * len(new)
            if a is None:
                (a,) = generate_greedy(target, [ids], response_len, batch_size=1)
            ids, mask, text = ids + a, mask + [True] * len(a), ""
        out.append((ids, mask))
    return out


def test_all_turns_are_the_targets_own_answers_after_its_own_earlier_ones(tmp_path, tiny_llama):
    f = _jsonl(tmp_path / "c.jsonl", CONVS)
    dc = _cfg([f], num_samples=10, response_len=5, max_length=400, regen_batch_size=2)
    tc = target_cfg("tiny_llama")
    logs = []
    samples = load_or_build_dataset(dc, tc, tiny_llama, str(tmp_path / "cache"), log=logs.append)
    ref = _reference_samples(tiny_llama, CONVS, 5)
    assert [s.input_ids.tolist() for s in samples] == [r[0] for r in ref]
    assert [s.loss_mask.tolist() for s in samples] == [r[1] for r in ref]
    assert [int(s.loss_mask.sum()) for s in samples] == [15, 5, 10]  # 3, 1 and 2 answers
    assert any("6 user turns answered in order" in m for m in logs)
    assert not any(n.endswith(".partial") for n in os.listdir(tmp_path / "cache"))
    # the samples' answers are the target's greedy tokens: a teacher-forced forward agrees
    for s in samples:
        nxt = tiny_llama.capture(s.input_ids[None]).next_token_NT[0]
        pos = s.loss_mask.nonzero().flatten()
        starts = pos[~s.loss_mask[pos - 1]]  # an answer's first token follows the template's
        follow = pos[s.loss_mask[pos - 1]]
        assert torch.equal(nxt[follow - 1], s.input_ids[follow]) and starts.numel() >= 1
    # data.turns=first / last: one answer after the first / the last user turn
    first = load_or_build_dataset(
        DataConfig(**{**vars(dc), "turns": "first"}), tc, tiny_llama, str(tmp_path / "f")
    )
    assert [int(s.loss_mask.sum()) for s in first] == [5, 5, 5]
    assert first[0].input_ids.tolist()[: len(ref[0][0])][:30] == ref[0][0][:30]
    # data.max_turns=2: every conversation stops after its second answer (a cache of its own)
    logs = []
    two = load_or_build_dataset(
        replace(dc, max_turns=2), tc, tiny_llama, str(tmp_path / "cache"), log=logs.append
    )
    ref2 = _reference_samples(tiny_llama, CONVS, 5, max_turns=2)
    assert [s.input_ids.tolist() for s in two] == [r[0] for r in ref2]
    assert [int(s.loss_mask.sum()) for s in two] == [10, 5, 10]
    assert any("5 user turns answered in order" in m for m in logs), logs
    assert any("answers 5, turns_past_max_turns 1" in m for m in logs), logs
    path = dataset_path(dc, tc, str(tmp_path / "cache"))
    assert dataset_path(replace(dc, max_turns=2), tc, str(tmp_path / "cache")) != path
    with pytest.raises(ValueError, match="data.max_turns must be a whole number >= 1"):
        replace(dc, max_turns=0).validate()


def test_fused_regeneration_answers_every_turn_as_the_plain_decoder(
    tmp_path, tiny_llama, monkeypatch
):
    """data.regen_fuse on conversations (the chat recipe's rounds: each later turn's prompt holds
    the target's earlier answers): the same samples as the independent turn-by-turn loop, the
    fused functions (torch.compile's eager backend here) running in every round."""
    import dflash.data.dataset as dataset
    import dflash.target.fused as fused

    monkeypatch.setattr(dataset, "_static_path", lambda target, temperature: True)  # CUDA's path
    monkeypatch.setattr(fused, "FUSE_BACKEND", "eager")
    monkeypatch.setattr(fused, "_CHECKED", {})
    calls = []
    real = fused._rms_norm
    monkeypatch.setattr(fused, "_rms_norm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    f = _jsonl(tmp_path / "c.jsonl", CONVS)
    dc = _cfg([f], num_samples=10, response_len=5, max_length=400, regen_batch_size=2)
    logs = []
    samples = load_or_build_dataset(
        replace(dc, regen_fuse=True),
        target_cfg("tiny_llama"),
        tiny_llama,
        str(tmp_path / "cache"),
        log=logs.append,
    )
    ref = _reference_samples(tiny_llama, CONVS, 5)
    assert [s.input_ids.tolist() for s in samples] == [r[0] for r in ref]
    assert [s.loss_mask.tolist() for s in samples] == [r[1] for r in ref]
    assert any("6 user turns answered in order" in m for m in logs) and calls
    assert not any("warning: data.regen_fuse" in m for m in logs)


GIVEN = [
    {  # both user turns answered by the row: its answers are the samples' answers
        "id": "a",
        "conversations": [
            {"from": "system", "value": "You are terse."},
            {"from": "human", "value": "What is 2+2?"},
            {"from": "gpt", "value": "Four."},
            {"from": "human", "value": "And 3+3?"},
            {"from": "gpt", "value": "Six, as 3 and 3 make " + "six " * 10},  # past response_len
        ],
    },
    {"id": "b", "messages": [{"role": "user", "content": "Name a colour."}]},  # regenerated
    {
        "id": "c",  # the second user turn has no answer: the sample ends after the first
        "messages": [
            {"role": "user", "content": "Why?"},
            {"role": "assistant", "content": "Because."},
            {"role": "user", "content": "OK"},
        ],
    },
]


def _given_answer(target, response_len):
    """The reference's given answers: the row's answer to user turn k as the text's tokens, then
    EOS, cut at response_len; None where the row has none (conversation c's second turn); b has
    none at all, so the reference regenerates it."""
    tok = target.tokenizer

    def answer(conv, k):
        if conv["id"] == "b":
            return None if k else generate_greedy(target, [_B_PROMPT], response_len, 1)[0]
        turns = conv.get("conversations", conv.get("messages"))
        texts = [t.get("value", t.get("content")) for t in turns]
        roles = [t.get("from", t.get("role")) for t in turns]
        users = [i for i, r in enumerate(roles) if r in ("human", "user")]
        after = [
            i + 1 for i in users if i + 1 < len(turns) and roles[i + 1] in ("gpt", "assistant")
        ]
        if k >= len(after) or after[k] != users[k] + 1:
            return None
        ids = tok(texts[after[k]], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return ids[:response_len]

    return answer


_B_PROMPT = None  # conversation b's prompt, set by the test (the one turn the target answers)


def test_given_answers_are_the_rows_own_in_the_served_template(tmp_path, tiny_llama, monkeypatch):
    """data.answers=given: each conversation's own assistant turns are its answers, placed
    exactly where the target's would be (the same template, glue and EOS handling), cut at
    data.response_len like a regenerated answer; its turns end at the first user turn without
    an answer; a conversation without any is regenerated, and only it reaches the target."""
    import dflash.data.dataset as dataset

    global _B_PROMPT
    f = _jsonl(tmp_path / "g.jsonl", GIVEN)
    dc = _cfg([f], num_samples=10, response_len=12, max_length=400, answers="given")
    tc = target_cfg("tiny_llama")
    reached = []

    def counted(target, prompts, *a, **kw):
        reached.append([list(p) for p in prompts])
        return generate_greedy(target, prompts, *a, **kw)

    monkeypatch.setattr(dataset, "generate_greedy", counted)
    logs = []
    samples = load_or_build_dataset(dc, tc, tiny_llama, str(tmp_path / "cache"), log=logs.append)
    assert len(reached) == 1 and len(reached[0]) == 1  # only b's one turn was generated
    _B_PROMPT = reached[0][0]
    ref = _reference_samples(tiny_llama, GIVEN, 12, answer=_given_answer(tiny_llama, 12))
    assert [s.input_ids.tolist() for s in samples] == [r[0] for r in ref]
    assert [s.loss_mask.tolist() for s in samples] == [r[1] for r in ref]
    text = tiny_llama.tokenizer.decode(samples[0].input_ids[samples[0].loss_mask])
    assert text.startswith("Four.<|im_end|>Six, as 3 a")  # the second cut at 12 tokens, no EOS
    assert int(samples[2].loss_mask.sum()) == len("Because.") + 1
    assert any("2 of 3 conversations answered by their rows' own" in m for m in logs), logs
    assert any("given_answers 2" in m and "turns_without_given_answer 1" in m for m in logs), logs
    # a cache of its own: the same rows regenerated are other samples
    path = dataset_path(dc, tc, str(tmp_path / "cache"))
    assert dataset_path(replace(dc, answers="regenerate"), tc, str(tmp_path / "cache")) != path
    # the rows' answers are text the tiny target would not write: a teacher-forced forward
    # disagrees with most of it, the regenerated answer of b agrees with all of it
    tb = target_forward(tiny_llama, collate(samples))
    hits, total = tb.greedy_agreement().tolist()
    assert total == sum(int(s.loss_mask.sum()) for s in samples)
    b = target_forward(tiny_llama, collate(samples[1:2])).greedy_agreement().tolist()
    assert b[0] == b[1] and hits < 0.5 * total


def test_given_answers_need_rows_that_can_hold_them():
    with pytest.raises(ValueError, match="data.source=stdlib has no answers"):
        DataConfig(source="stdlib", answers="given").validate()
    with pytest.raises(ValueError, match="data.regen_temperature=0.7 asks for sampled"):
        DataConfig(source="jsonl", paths=["x"], answers="given", regen_temperature=0.7).validate()
    with pytest.raises(ValueError, match="data.answers='vllm' is not allowed"):
        DataConfig(source="jsonl", paths=["x"], answers="vllm").validate()


def _fake_tp(first, glues):
    """TurnPrompts with the given first prompts and per-conversation glue rows."""
    glue = TokenTable([g for gs in glues for g in gs])
    starts = torch.tensor([0] + [len(gs) for gs in glues]).cumsum(0).numpy()
    return TurnPrompts(TokenTable(first), glue, starts)


def test_turns_end_at_the_last_answer_that_fits_and_eos_is_not_doubled():
    """Fake target answers: conversation 0's third answer would pass max_length, so its sample
    ends where its second answer ends; the template's end-of-turn token after an answer that
    ended with EOS is not repeated; a first answer that is too long is cut or dropped
    (data.too_long), as single-turn samples always were."""
    EOS = 99
    tp = _fake_tp(
        [[1, 2], [3, 4, 5, 6, 7, 8]],
        [[[EOS, 50, 51], [EOS, 52]], []],
    )
    answers = {0: [[10, 11, EOS], [12, 13], [14, 15, 16, 17]], 1: [[20, 21, 22, 23, EOS]]}
    calls = []

    def generate(prompts, k, convs):
        calls.append([list(p) for p in prompts])
        assert convs == ([0, 1] if k == 0 else [0])
        return [answers[c][k] for c in convs]

    seqs, spans, reached, stats = run_turns(tp, generate, max_length=14, eos=EOS)
    # turn 2's prompt: answer 1 (with its EOS), then the glue without a second EOS
    assert calls[1] == [[1, 2, 10, 11, EOS, 50, 51]]
    # turn 3's prompt: answer 2 did not end with EOS, so the template's own end of turn follows
    assert calls[2] == [[1, 2, 10, 11, EOS, 50, 51, 12, 13, EOS, 52]]
    assert seqs[0] == [1, 2, 10, 11, EOS, 50, 51, 12, 13]  # the third answer would make 15 > 14
    assert spans[0] == [(2, 5), (7, 9)] and stats["turns_cut_at_max_length"] == 1
    samples, st = dialogue_samples(tp, seqs, spans, reached, 14, "truncate")
    assert samples[0].loss_mask.tolist() == [0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert samples[1].input_ids.tolist() == [3, 4, 5, 6, 7, 8, 20, 21, 22, 23, EOS]
    samples, st = dialogue_samples(tp, seqs, spans, reached, 9, "drop")
    assert [s.sample_id for s in samples] == [0] and st["dropped"] == 1
    samples, st = dialogue_samples(tp, seqs, spans, reached, 8, "truncate")
    assert samples[1].loss_mask.tolist() == [0] * 6 + [1, 1] and st["truncated"] == 2


def test_no_anchor_and_no_loss_weight_on_user_turns_or_template_markers(tiny_qwen):
    """Two answers with a short user turn between them: changing the target's labels at every
    position outside the answers (prompt, user turn, role markers) leaves the loss unchanged,
    and no block is anchored there. A block near the end of the first answer used to reach
    across the user turn and take the first label of the second answer from a marker."""
    from conftest import make_drafter as md  # noqa: F401  (the fixture module's helper)

    from dflash.config import TrainConfig
    from dflash.target.shape import Heads
    from dflash.train.step import DrafterTrainer

    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(3):
        parts = [(5, False), (7, True), (3, False), (9, True), (2, False), (6, True)]
        mask = torch.cat([torch.full((n,), m) for n, m in parts])
        ids = torch.randint(0, tiny_qwen.vocab_size - 1, (mask.numel(),), generator=g)
        samples.append(Sample(i, ids, mask))
    tb = target_forward(tiny_qwen, collate(samples))
    drafter = make_drafter(tiny_qwen, block_size=8)
    tr = DrafterTrainer(
        drafter,
        Heads(tiny_qwen.embed_tokens, tiny_qwen.lm_head),
        TrainConfig(steps=1, max_anchors=64),
        torch.device("cpu"),
    )
    p = tr.prepare(tb, 0)
    anchors = p.blocks.anchors_NA[p.blocks.valid_NA]
    rows = torch.arange(len(samples))[:, None].expand_as(p.blocks.anchors_NA)[p.blocks.valid_NA]
    assert tb.loss_mask_NT[rows, anchors].all()
    loss = float(tr.forward_sums(tb, p)[0].detach())
    other = tb.next_token_NT.clone()
    outside = ~tb.loss_mask_NT
    other[outside] = (other[outside] + 1) % (tiny_qwen.vocab_size - 1)
    tb2 = type(tb)(**{**vars(tb), "next_token_NT": other})
    p2 = tr.prepare(tb2, 0)
    assert float(tr.forward_sums(tb2, p2)[0].detach()) == loss
    assert p.num_labels == p2.num_labels > 0


# ----------------------------------------------------------------------------- mixtures
def test_mix_shares_are_within_one_percent_of_their_weights(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}"} for i in range(8000)])
    b = _jsonl(
        tmp_path / "b.jsonl",
        [{"messages": [{"role": "user", "content": f"b{i}"}]} for i in range(3000)],
    )
    c = _jsonl(tmp_path / "c.jsonl", [dict(SHAREGPT, id=f"c{i}") for i in range(2000)])
    mix = [
        MixSourceConfig(name="a", weight=0.6, paths=[a]),
        MixSourceConfig(name="b", weight=0.25, paths=[b]),
        MixSourceConfig(name="c", weight=0.15, paths=[c]),
    ]
    dc = DataConfig(source="mix", mix=mix, num_samples=10_000)
    dc.validate()
    logs = []
    convs, sources = training_conversations(dc, log=logs.append)
    assert len(convs) == 10_000 and mix_quotas([0.6, 0.25, 0.15], 10_000) == [6000, 2500, 1500]
    stream = SampleStream(len(convs), seed=3)
    drawn = [sources[i] for i in stream.take(10_000 + 4321)][-10_000:]  # across an epoch
    for k, w in enumerate([0.6, 0.25, 0.15]):
        assert abs(drawn.count(k) / 10_000 - w) < 0.01
    # a source short of its share shrinks the mix instead of tilting it, and says so
    logs.clear()
    convs, sources = training_conversations(
        DataConfig(source="mix", mix=mix, num_samples=20_000), log=logs.append
    )
    assert [sources.count(k) for k in range(3)] == [7200, 3000, 1800]
    assert any("b has 3000 of 5000, c has 2000 of 3000" in m and "12000 samples" in m for m in logs)
    # each source's share of samples and tokens, from the samples
    samples = [
        Sample(i, torch.ones(4 + 4 * s, dtype=torch.long), torch.ones(2, dtype=torch.bool), s)
        for i, s in enumerate([0, 0, 1, 2])
    ]
    rep = mix_report(samples, dc)
    assert rep["a"]["samples_share"] == 0.5 and rep["b"]["tokens"] == 8
    assert rep["c"]["tokens_share"] == round(12 / 28, 4)


def test_mix_validation_names_the_key():
    with pytest.raises(ValueError, match=r"data.mix needs data.source=mix"):
        DataConfig(mix=[MixSourceConfig(name="a", paths=["x"])]).validate()
    with pytest.raises(ValueError, match=r"data.mix\[1\].name='a' is used twice"):
        DataConfig(
            source="mix",
            mix=[MixSourceConfig(name="a", paths=["x"]), MixSourceConfig(name="a", paths=["y"])],
        ).validate()
    with pytest.raises(ValueError, match=r"data.mix\[0\].weight must be > 0"):
        DataConfig(source="mix", mix=[MixSourceConfig(name="a", weight=0, paths=["x"])]).validate()
    with pytest.raises(ValueError, match=r"data.turns='some' is not allowed"):
        DataConfig(turns="some").validate()


def test_given_answers_in_a_mix_leave_the_stdlib_stubs_to_the_target(tmp_path, tiny_llama):
    """A mix under data.answers=given: the jsonl rows that hold answers keep them; its row
    without one and every stdlib stub (a bare prompt) are regenerated."""
    f = _jsonl(tmp_path / "g.jsonl", GIVEN)
    dc = DataConfig(
        source="mix",
        answers="given",
        num_samples=6,
        response_len=6,
        max_length=400,
        regen_batch_size=8,
        mix=[
            MixSourceConfig(name="chat", weight=0.5, source="jsonl", paths=[f]),
            MixSourceConfig(name="code", weight=0.5, source="stdlib"),
        ],
    )
    dc.validate()
    logs = []
    samples = load_or_build_dataset(
        dc, target_cfg("tiny_llama"), tiny_llama, str(tmp_path / "c"), log=logs.append
    )
    import re

    (n,) = [int(x) for m in logs for x in re.findall(r"^data: 2 of (\d+) conversations", m)]
    assert n == len(samples) >= 5  # (a long stdlib stub may not fit data.max_length)
    assert any(m.startswith(f"data: regenerating {n - 2} responses") for m in logs), logs
    assert any("given_answers 2" in m for m in logs), logs
    assert [s.source for s in samples].count(0) == 3  # the chat rows, b regenerated among them
