"""Named eval sets (eval.sets): held-out slices disjoint from training by id or content,
overlap refused at start, each set evaluated and reported under its own name (console,
metrics.jsonl, wandb sections, plot), in the loop and by eval.py alike."""

import gzip
import json
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from conftest import ROOT, make_drafter

from dflash.config import DataConfig, EvalConfig, EvalSetConfig, RunConfig, TargetConfig
from dflash.eval.heldout import check_eval_sets, set_conversations


def _rows(path, ids, text=lambda i: f"question {i}"):
    rows = [
        {
            "id": f"{i}",
            "conversations": [{"from": "human", "value": text(i)}, {"from": "gpt", "value": "a"}],
        }
        for i in ids
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _rc(train, sets, num_samples=6):
    return RunConfig(
        target=TargetConfig(config={"model_type": "llama"}),
        data=DataConfig(source="jsonl", paths=[train], num_samples=num_samples),
        eval=EvalConfig(num_prompts=3, sets=sets),
    )


def test_an_eval_set_that_overlaps_training_is_refused_in_one_line(tmp_path):
    train = _rows(tmp_path / "train.jsonl", range(10))
    same = EvalSetConfig(name="chat", source="jsonl", paths=[train])
    with pytest.raises(ValueError) as e:
        check_eval_sets(_rc(train, [same]))
    assert str(e.value).startswith("eval.sets[chat]: 3 of 3 conversations of") and "\n" not in str(
        e.value
    )
    # another id but the same content (a duplicate under a new id) is the same conversation
    dup = _rows(tmp_path / "dup.jsonl", [100, 101, 102], text=lambda i: f"question {i - 100 + 5}")
    with pytest.raises(ValueError, match="1 of 3 conversations"):
        check_eval_sets(_rc(train, [EvalSetConfig(name="d", source="jsonl", paths=[dup])]))
    # the same id with other content is also refused (rows carry ids: the id decides)
    reused = _rows(tmp_path / "reused.jsonl", [5, 50, 51], text=lambda i: f"other {i}")
    with pytest.raises(ValueError, match="1 of 3 conversations"):
        check_eval_sets(_rc(train, [EvalSetConfig(name="r", source="jsonl", paths=[reused])]))
    other = _rows(tmp_path / "other.jsonl", [20, 21, 22], text=lambda i: f"other {i}")
    check_eval_sets(_rc(train, [EvalSetConfig(name="o", source="jsonl", paths=[other])]))
    # through train.py: one error line, exit 2, before any model loads
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            "target=tiny_llama",
            "data=jsonl",
            f"data.paths=[{train}]",
            "data.num_samples=6",
            f"eval.sets=[{{name: chat, source: jsonl, paths: [{train}]}}]",
            f"out_root={tmp_path}",
            "logger=none",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "eval.sets[chat]: 6 of 8" in errors[0], (
        r.stderr[-800:]
    )


def test_a_heldout_slice_holds_only_conversations_training_does_not_read(tmp_path):
    # rows 6..: row 7 repeats row 2's content under another id, row 8 reuses id 1
    def text(i):
        return "question 2" if i == 7 else f"question {i}"

    train = _rows(tmp_path / "train.jsonl", [0, 1, 2, 3, 4, 5, 6, 7, 1, 9, 10, 11], text)
    held = EvalSetConfig(name="chat", source="jsonl", paths=[train], heldout=True, num_prompts=3)
    rc = _rc(train, [held])
    convs = set_conversations(rc, held)
    assert [c.cid for c in convs] == ["6", "9", "10"]
    check_eval_sets(rc)  # held-out slices are disjoint by construction
    with pytest.raises(ValueError, match=r"eval.sets\[chat\]: no held-out conversations left"):
        set_conversations(_rc(train, [held], num_samples=12), held)


def test_the_last_rows_are_one_set_for_runs_that_train_on_different_shares(tmp_path):
    """rows=last: the held-out set of a run that trains on the file's first rows and of a run
    that trains on none of them is the same (the chat and the code recipe compare on it); the
    first rows that are no training row move with the training share."""
    # row 10 repeats row 2's content (ShareGPT repeats conversations under other ids): a
    # training row for a run that reads the first 8 rows, not for one that reads none
    chat = _rows(tmp_path / "chat.jsonl", range(12), lambda i: "q2" if i == 10 else f"q{i}")
    other = _rows(tmp_path / "other.jsonl", range(100, 110))
    last = EvalSetConfig(
        name="chat", source="jsonl", paths=[chat], heldout=True, num_prompts=3, rows="last"
    )
    on_chat, on_other = _rc(chat, [last], num_samples=8), _rc(other, [last])
    assert [c.cid for c in set_conversations(on_chat, last)] == ["8", "9", "11"]
    assert [c.cid for c in set_conversations(on_other, last)] == ["8", "9", "11"]
    first = replace(last, rows="first")
    assert [c.cid for c in set_conversations(on_chat, first)] == ["8", "9", "11"]
    assert [c.cid for c in set_conversations(on_other, first)] == ["0", "1", "2"]
    # not held out: the last rows as given (but repeats), refused at start when training reads one
    plain = replace(last, heldout=False)
    assert [c.cid for c in set_conversations(on_other, plain)] == ["8", "9", "11"]
    check_eval_sets(_rc(chat, [plain], num_samples=8))
    with pytest.raises(ValueError, match=r"eval.sets\[chat\]: 1 of 3 conversations"):
        check_eval_sets(_rc(chat, [plain], num_samples=9))


def _fake_humaneval(root, n=3):
    (root / "humaneval").mkdir(parents=True, exist_ok=True)
    with gzip.open(root / "humaneval" / "HumanEval.jsonl.gz", "wt") as f:
        for i in range(n):
            row = {
                "task_id": f"HumanEval/{i}",
                "prompt": f'def f{i}(x):\n    """Return x + {i}."""\n',
            }
            f.write(json.dumps(row) + "\n")


def test_each_set_is_evaluated_and_reported_under_its_name(tmp_path, tiny_llama, capsys):
    from dflash.common.loggers import ConsoleLogger, WandbLogger
    from dflash.common.plot import eval_set_keys
    from dflash.eval.offline import Evaluator, evaluate
    from dflash.eval.sets import build_eval_sets
    from dflash.target.shape import Heads

    chat = _rows(tmp_path / "chat.jsonl", range(4))
    _fake_humaneval(tmp_path)
    os.environ["DFLASH_ASSETS"] = str(tmp_path)
    try:
        rc = RunConfig(
            target=TargetConfig(name="tiny_llama", chat_template=True),
            data=DataConfig(source="stdlib", num_samples=4, max_length=256),
            eval=EvalConfig(
                num_prompts=2,
                completion_len=8,
                budgets=[4],
                sets=[
                    EvalSetConfig(name="code", source="humaneval"),
                    EvalSetConfig(name="chat", source="jsonl", paths=[chat], turns="each"),
                ],
            ),
        )
        sets = build_eval_sets(rc, tiny_llama, str(tmp_path / "cache"))
        # a named HumanEval set holds the unnamed one's items (eval.source=humaneval, the code
        # recipe's in-loop set), so a named set in eval.py scores what the loop scored
        unnamed = replace(rc, eval=replace(rc.eval, sets=[], source="humaneval"))
        (plain,) = build_eval_sets(unnamed, tiny_llama, str(tmp_path / "cache")).values()
        # which trees are scored (or at which temperatures) is not the set: the same cache files
        cached = sorted(os.listdir(tmp_path / "cache"))
        rules = replace(rc, eval=replace(rc.eval, tree_rules=["t2"], temperatures=[0.0, 1.0]))
        build_eval_sets(rules, tiny_llama, str(tmp_path / "cache"))
        assert sorted(os.listdir(tmp_path / "cache")) == cached
    finally:
        del os.environ["DFLASH_ASSETS"]
    assert list(sets) == ["code", "chat"] and len(sets["code"]) == 2
    for a, b in zip(sets["code"], plain, strict=True):
        assert torch.equal(a.prompt_ids, b.prompt_ids)
        assert torch.equal(a.completion_ids, b.completion_ids)
    assert len(sets["chat"]) == 2  # one user turn each: one prompt each
    drafter = make_drafter(tiny_llama)
    heads = Heads(tiny_llama.embed_tokens, tiny_llama.lm_head)
    ev = Evaluator(sets, [4], tree_rules=["t1"])
    out = ev.run(drafter, heads)
    assert "eval/chat/rule/t1/tau@4" in out and "eval/code/rule/t1/tau@4" in out
    _, alone = evaluate(drafter, heads, sets["chat"], [4])
    assert out["eval/chat/tau"] == pytest.approx(alone["tau"]) and "eval/code/tau@4" in out
    assert not any(k.startswith("eval/tau") for k in out)  # no unnamed set
    assert set(ev.reports_by_set) == {"code", "chat"}
    ConsoleLogger(None).log(out, step=7)
    assert "code.tau=" in capsys.readouterr().out
    assert WandbLogger.wandb_key("eval/chat/tau@4") == "eval-chat/tau@4"  # a section per set
    assert WandbLogger.wandb_key("eval/tau") == "eval/tau"
    assert eval_set_keys([{"step": 1, **out}], "tau") == ["eval/chat/tau", "eval/code/tau"]


def test_each_turn_of_a_conversation_is_an_eval_prompt(tmp_path, tiny_llama):
    """turns=each: every user turn is a prompt whose history holds the target's own earlier
    greedy answers: each item's prompt starts with the previous item's prompt + completion."""
    from dflash.eval.sets import build_named_set

    rows = [
        {
            "id": "x",
            "messages": [
                {"role": "user", "content": "one"},
                {"role": "assistant", "content": "-"},
                {"role": "user", "content": "two"},
                {"role": "user", "content": "three"},
            ],
        }
    ]
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps(rows[0]) + "\n")
    es = EvalSetConfig(name="chat", source="jsonl", paths=[str(f)], turns="each")
    rc = RunConfig(
        target=TargetConfig(name="tiny_llama", chat_template=True),
        data=DataConfig(source="selfgen", max_length=512),
        eval=EvalConfig(num_prompts=1, completion_len=6, sets=[es]),
    )
    items = build_named_set(rc, es, tiny_llama, None)
    assert len(items) == 3
    for a, b in zip(items, items[1:]):
        prev = a.prompt_ids.tolist() + a.completion_ids.tolist()
        assert b.prompt_ids.tolist()[: len(prev)] == prev
    assert tiny_llama.tokenizer.decode(items[2].prompt_ids).count("<|im_start|>user") == 3


def test_a_turn_set_whose_first_turns_are_all_too_long_names_data_max_length(tmp_path, tiny_llama):
    """Every conversation's first prompt past data.max_length: the error names the length and
    the fix, not "every greedy completion is shorter than 2 tokens" (what it said before)."""
    from dflash.eval.sets import build_named_set

    f = tmp_path / "c.jsonl"
    _rows(f, range(2), text=lambda i: "word " * 200)
    es = EvalSetConfig(name="chat", source="jsonl", paths=[str(f)], turns="each")
    rc = RunConfig(
        target=TargetConfig(name="tiny_llama", chat_template=True),
        data=DataConfig(source="selfgen", max_length=64),
        eval=EvalConfig(num_prompts=2, completion_len=6, sets=[es]),
    )
    with pytest.raises(ValueError, match=r"none of the set's 2 conversations .*data.max_length=64"):
        build_named_set(rc, es, tiny_llama, None)


def test_a_mixed_multi_turn_run_reports_every_set_in_the_loop_and_in_eval_py(tmp_path):
    """train.py on the tiny Llama: ShareGPT-style conversations (every turn regenerated) mixed
    with the code corpus, two eval sets; per-set figures in the console, metrics.jsonl, the plot
    and run_config.json (with the mix's shares), and eval.py reproducing the last in-loop eval
    of every set."""
    convs = [
        {
            "id": f"c{i}",
            "conversations": [
                {"from": "human", "value": f"Tell me about {i}."},
                {"from": "gpt", "value": "old answer"},
                {"from": "human", "value": f"And {i + 1}?"},
            ],
        }
        for i in range(40)
    ]
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(c) + "\n" for c in convs))
    _fake_humaneval(tmp_path)
    over = [
        "target=tiny_llama",
        "data.source=mix",
        f"data.mix=[{{name: chat, weight: 0.75, source: jsonl, paths: [{chat}]}}, "
        "{name: code, weight: 0.25, source: stdlib}]",
        "data.num_samples=16",
        "data.response_len=8",
        "data.max_length=256",
        "data.regen_batch_size=8",
        "eval.completion_len=12",
        "eval.budgets=[4]",
        "eval.num_prompts=2",
        f"eval.sets=[{{name: code, source: humaneval}}, "
        f"{{name: chat, source: jsonl, paths: [{chat}], heldout: true, turns: each}}]",
        "train.steps=4",
        "train.eval_every=4",
        "train.save_every=4",
        "train.log_every=2",
        "train.micro_batch_size=4",
        f"out_root={tmp_path}",
        "run_name=r",
        "logger=console",
    ]
    env = {**os.environ, "DFLASH_ASSETS": str(tmp_path), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "train.py", *over],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    run = tmp_path / "r"
    log = (run / "train.log").read_text()
    assert "data.mix: chat 12 conversations (75.0%), code 4 conversations (25.0%)" in log
    # the weights are shares of the conversations read; what training gets (after prompts
    # too long for data.max_length are dropped) is logged and recorded as it is
    kept = int(re.search(r"data: (\d+) samples regenerated", log).group(1))
    share = re.search(r"data.mix shares: chat ([\d.]+)% of samples", log).group(1)
    assert "user turns answered in order (data.turns=all)" in log
    steps = [ln for ln in log.splitlines() if ln.startswith("step ") and "code.tau=" in ln]
    assert steps and "chat.tau=" in steps[-1]
    assert "eval code: streak" in log and "eval chat: streak" in log
    rows = [json.loads(x) for x in open(run / "metrics.jsonl")]
    last = [x for x in rows if "eval/code/tau" in x][-1]
    assert last["step"] == 4 and "eval/chat/tau" in last and "eval/tau" not in last
    assert last["eval/chat/num_prompts"] == 4  # two held-out conversations, two turns each
    cfg = json.load(open(run / "run_config.json"))
    mix = cfg["data_mix"]
    assert mix["chat"]["samples"] + mix["code"]["samples"] == kept
    assert mix["chat"]["samples_share"] == pytest.approx(float(share) / 100, abs=1e-3)
    assert (run / "metrics.png").is_file()
    out = tmp_path / "rep.json"
    ck = run / "checkpoints" / "step_00000004"
    r = subprocess.run(
        [sys.executable, "eval.py", f"ckpt={ck}", f"out={out}", f"eval_dir={tmp_path}/ev"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "eval sets code, chat" in r.stdout and "eval set chat:" in r.stdout
    rep = json.load(open(out))
    for name in ("code", "chat"):
        assert rep["sets"][name]["summary"]["tau"] == pytest.approx(
            last[f"eval/{name}/tau"], abs=1e-9
        )
        assert rep["summary"][f"{name}/tau@4"] == pytest.approx(
            last[f"eval/{name}/tau@4"], abs=1e-9
        )


def test_a_heldout_slice_of_a_mixed_source_starts_after_that_sources_share(tmp_path):
    """With data.mix, training reads a file source up to its share of data.num_samples: the
    held-out slice starts right after it (not after data.num_samples rows)."""
    from dflash.config import MixSourceConfig

    chat = _rows(tmp_path / "chat.jsonl", range(20))
    mix = [
        MixSourceConfig(name="chat", weight=0.5, paths=[chat]),
        MixSourceConfig(name="code", weight=0.5, source="stdlib"),
    ]
    held = EvalSetConfig(name="chat", source="jsonl", paths=[chat], heldout=True, num_prompts=3)
    rc = RunConfig(
        target=TargetConfig(config={"model_type": "llama"}),
        data=DataConfig(source="mix", mix=mix, num_samples=24),
        eval=EvalConfig(sets=[held]),
    )
    assert [c.cid for c in set_conversations(rc, held)] == ["12", "13", "14"]
    # a mix names its eval prompts: refused at start without eval.sets or eval.source
    with pytest.raises(ValueError, match="data.source=mix: name the eval prompts with eval.sets"):
        check_eval_sets(RunConfig(data=rc.data, eval=EvalConfig()))


def test_the_chat_recipe_and_a_code_run_judge_on_the_same_sharegpt_conversations(
    tmp_path, monkeypatch
):
    """eval=code_and_chat: the ShareGPT set of +exp=qwen05_chat (which trains on the file's
    first 14,000 conversations) and of a +exp=qwen05_coder run scored with it are the same
    conversations (a stand-in file of the real one's size class: 14,100 rows)."""
    from conftest import CONF
    from hydra import compose, initialize_config_dir

    from dflash.run.cli import setup, typed

    setup()
    (tmp_path / "sharegpt").mkdir()
    # row 14,090 repeats row 5 (a training conversation of the chat recipe only)
    _rows(
        tmp_path / "sharegpt" / "sharegpt.jsonl",
        range(14_100),
        lambda i: "question 5" if i == 14_090 else f"question {i}",
    )
    monkeypatch.setenv("DFLASH_ASSETS", str(tmp_path))
    sets = {}
    for over in (["+exp=qwen05_chat"], ["+exp=qwen05_coder", "eval=code_and_chat"]):
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            rc = typed(compose("config", overrides=[*over, "data.code_dirs=[]"]))
        (es,) = [s for s in rc.eval.sets if s.name == "sharegpt"]
        sets[over[0]] = [c.cid for c in set_conversations(rc, es, lambda *_: None)]
    assert sets["+exp=qwen05_chat"] == sets["+exp=qwen05_coder"]
    assert sets["+exp=qwen05_chat"] == [str(i) for i in range(14_051, 14_100) if i != 14_090]
