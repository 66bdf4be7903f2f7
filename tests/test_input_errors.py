"""Bad user input (data files, damaged checkpoints) fails with one line naming the file and
line and what to do, never a parser's traceback."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, make_drafter

from dflash.common.layout import STATE_FILE
from dflash.config import DataConfig
from dflash.data.files import text_prompts
from dflash.train.resume import load_checkpoint, save_checkpoint


def _jsonl(tmp_path, text, name="p.jsonl"):
    f = tmp_path / name
    f.write_text(text)
    return DataConfig(source="jsonl", paths=[str(f)]), str(f)


def _one_line_error(cfg) -> str:
    with pytest.raises(ValueError) as e:
        text_prompts(cfg)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_malformed_jsonl_line_names_file_and_true_line(tmp_path):
    cfg, path = _jsonl(tmp_path, '{"prompt": "a"}\n\n{"prompt": "b"}\n{"prompt": oops}\n')
    msg = _one_line_error(cfg)
    assert msg.startswith(f"{path}:4: not valid JSON (Expecting value at column 12)"), msg


@pytest.mark.parametrize(
    "row,expect",
    [
        ('{"prompt": 123}', "'prompt' must be a string, got int 123"),
        ('{"prompt": null}', "'prompt' must be a string, got NoneType null"),
        ('["a", "b"]', "a row must be a JSON object"),
        ('{"messages": "hi"}', "'messages' must be a non-empty list of {'role': str"),
        ('{"messages": [{"role": "user", "content": 5}]}', "'messages' must be a non-empty list"),
        ('{"messages": {}}', "'messages' must be a non-empty list"),
    ],
)
def test_wrong_row_types_name_file_line_and_expected_type(tmp_path, row, expect):
    cfg, path = _jsonl(tmp_path, '{"prompt": "ok"}\n' + row + "\n")
    msg = _one_line_error(cfg)
    assert msg.startswith(f"{path}:2: ") and expect in msg, msg


def test_malformed_jsonl_through_train_py_is_one_error_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "a"}\n{"prompt": 123}\n')
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            "data=jsonl",
            f"data.paths=[{f}]",
            f"out_root={tmp_path}",
            "logger=none",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr[-1500:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [f"error: {f}:2: 'prompt' must be a string, got int 123"], r.stderr[-1500:]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]),  # truncated zip
        lambda p: p.write_bytes(b"\x80\x04garbage"),  # pickle garbage
        lambda p: torch.save([1, 2], p),  # a readable file without a train state
    ],
)
@pytest.mark.parametrize("manifest", [True, False])
def test_corrupt_train_state_names_the_file(tiny_qwen, tmp_path, damage, manifest):
    """With its manifest, the checkpoint's sha256 catches the damage first; without one (a
    checkpoint of an older dflash), reading the file does."""
    d = make_drafter(tiny_qwen)
    step = save_checkpoint(str(tmp_path), 3, d, {"x": 1})
    state = tmp_path / "checkpoints" / "step_00000003" / STATE_FILE
    if not manifest:
        os.remove(os.path.join(step, "manifest.json"))
    damage(state)
    with pytest.raises(ValueError) as e:
        load_checkpoint(step, make_drafter(tiny_qwen))
    msg = str(e.value)
    how = "differs from its sha256" if manifest else "resume from another step_* directory"
    assert msg.startswith(str(state)) and how in msg, msg
    assert "\n" not in msg and os.path.isfile(state)


def test_damaged_data_and_eval_caches_are_named(tmp_path, tiny_llama):
    """A damaged cache file is one line naming it and what to do, not torch's or safetensors'
    raw error (e.g. `PytorchStreamReader failed reading zip archive`)."""
    from dflash.config import EvalConfig, RunConfig, TargetConfig
    from dflash.data.dataset import dataset_path, load_or_build_dataset
    from dflash.eval.sets import build_eval_set

    dc = DataConfig(source="selfgen", num_samples=4, prompt_len=4, response_len=4, max_length=16)
    tc = TargetConfig(name="tiny_llama")
    path = dataset_path(dc, tc, str(tmp_path))
    open(path, "wb").write(b"PK\x03\x04 half a zip")
    with pytest.raises(ValueError) as e:
        load_or_build_dataset(dc, tc, tiny_llama, str(tmp_path), log=lambda *_: None)
    assert f"the data cache {path} is damaged" in str(e.value) and "delete it" in str(e.value)
    rc = RunConfig(data=dc, eval=EvalConfig(num_prompts=2, completion_len=4, batch_size=2))
    build_eval_set(rc, tiny_llama, str(tmp_path), log=lambda *_: None)
    ev, _tokens = sorted(p for p in tmp_path.iterdir() if p.name.startswith("eval-"))
    ev.write_text('{"unterminated')
    with pytest.raises(ValueError) as e:
        build_eval_set(rc, tiny_llama, str(tmp_path), log=lambda *_: None)
    assert f"the eval-set cache {ev} is damaged" in str(e.value) and "\n" not in str(e.value)


def test_damaged_run_config_is_named_and_skipped_when_looking_for_the_newest_run(
    tiny_qwen, tmp_path, capsys
):
    """resume=true looks through every run of out_root: one damaged run_config.json is skipped
    with a line instead of breaking the search; resuming that run names the file."""
    from dflash.common.layout import newest_run_of, read_run_config, write_run_config
    from dflash.config import RunConfig

    for name in ("a", "b"):
        save_checkpoint(str(tmp_path / name), 2, make_drafter(tiny_qwen), {})
        write_run_config(RunConfig(exp_name="e"), str(tmp_path / name))
    os.utime(tmp_path / "a" / "checkpoints" / "step_00000002", (1, 1))  # b is the newest
    (tmp_path / "b" / "run_config.json").write_text('{"exp_name": "e", "data": {"x": "unter')
    ck = newest_run_of(str(tmp_path), "e")
    assert ck == str(tmp_path / "a" / "checkpoints" / "step_00000002")
    out = capsys.readouterr().out
    assert f"skipping {tmp_path / 'b'}: {tmp_path / 'b' / 'run_config.json'} is damaged" in out
    with pytest.raises(ValueError, match=r"b/run_config.json is damaged \(not valid JSON"):
        read_run_config(str(tmp_path / "b"))


def _train_py(args, **kw):
    return subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_NO_PROGRESS": "1"},
        **kw,
    )


def test_file_size_limit_while_saving_is_one_line_in_train_log_too(tmp_path):
    """A checkpoint that hits a file-size limit (or a full disk) is one line naming what was
    being written, on the console and in train.log, not torch's `[enforce fail at
    inline_container.cc:672] . unexpected pos ...` traceback."""
    import resource

    def limit():  # the serving weights (0.7 MB) fit, train_state.pt (4 MB) does not
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))

    args = ["run_name=r", "train.steps=2", "train.save_every=2", "data.num_samples=16"]
    args += ["data.response_len=16", "eval.enabled=false", "logger=none"]
    r = _train_py([f"out_root={tmp_path}", *args], preexec_fn=limit)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert line == (
        f"error: file size limit reached writing a checkpoint under {tmp_path}/r/checkpoints "
        "(ulimit -f: 1000000 bytes); raise it: ulimit -f unlimited"
    )
    assert line in (tmp_path / "r" / "train.log").read_text()


def test_an_out_root_that_cannot_be_written_is_one_line():
    r = _train_py(["out_root=/sys/dflash-out", "run_name=r"])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: cannot write /sys/dflash-out"), lines


def test_full_disk_or_quota_names_the_path():
    import errno

    from dflash.common.storage import storage_error, writing

    for e in (
        OSError(errno.ENOSPC, "No space left on device"),
        RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
    ):
        line = storage_error(e, "/tmp/x/model.safetensors")
        assert line.startswith("no space left on the device writing /tmp/x/model.safetensors ("), e
    # a cache writer names its file: the launcher's line then names it too
    with pytest.raises(OSError) as e:
        with writing("/tmp/x/train-1.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 70 vs 5")
    assert e.value.filename == "/tmp/x/train-1.pt"
    assert storage_error(e.value, e.value.filename).startswith("no space left on the device writ")
    quota = storage_error(OSError(errno.EDQUOT, "Disk quota exceeded"), "/tmp/x")
    assert quota.startswith("disk quota exceeded writing /tmp/x")
    assert storage_error(RuntimeError("CUDA out of memory"), "/tmp/x") is None
    assert storage_error(ValueError("bad"), "/tmp/x") is None


@pytest.mark.parametrize(
    "content,source,expect",
    [
        (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "jsonl", ":1: not UTF-8 text (byte 0x89 at column 1)"),
        (b'{"prompt": "a"}\n{"prompt": "b\xe9"}\n', "jsonl", ":2: not UTF-8 text"),
        (b'{"prompt": "a"}\n\x00\x01\x02\n', "jsonl", ":2: a NUL byte: a binary file"),
        (b'{"prompt": "a"}\n{"prompt": oops}\n', "jsonl", ":2: not valid JSON"),
        (b'{"text": "a"}\n', "jsonl", ":1: rows need a 'prompt' or 'messages' field"),
        (b"\n\n", "jsonl", "hold no rows"),
        (b'{"prompt": "a"}\n', "parquet", ": not a parquet file"),
    ],
)
def test_prompt_files_are_read_and_checked_before_the_target_loads(
    tmp_path, content, source, expect
):
    """preflight (train.py's checks before any model loads) reads every prompt row: on a 27B
    target a bad line was found only after minutes of loading."""
    from dflash.config import RunConfig
    from dflash.run.preflight import check_run

    f = tmp_path / "p.jsonl"
    f.write_bytes(content)
    cfg = RunConfig(data=DataConfig(source=source, paths=[str(f)]))
    cfg.target.check_memory = False
    with pytest.raises(ValueError) as e:
        check_run(cfg)
    assert str(f) in str(e.value) and expect in str(e.value) and "\n" not in str(e.value)


def test_eval_prompt_files_are_checked_before_the_target_loads(tmp_path):
    from dflash.config import EvalConfig, RunConfig
    from dflash.run.preflight import check_run

    good, bad = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    good.write_text('{"prompt": "a"}\n')
    bad.write_text('{"prompt": "b"}\n{"prompt": 3}\n')
    cfg = RunConfig(
        data=DataConfig(source="jsonl", paths=[str(good)]), eval=EvalConfig(paths=[str(bad)])
    )
    cfg.target.check_memory = False
    with pytest.raises(ValueError, match=f"{bad}:2: 'prompt' must be a string"):
        check_run(cfg)


def test_empty_prompts_are_counted_and_skipped_in_one_line(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text(
        '{"prompt": ""}\n{"prompt": "a"}\n{"prompt": "  \\n"}\n'
        '{"messages": [{"role": "user", "content": " "}]}\n{"prompt": "b"}\n'
    )
    assert text_prompts(DataConfig(source="jsonl", paths=[str(f)])) == ["a", "b"]
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith(
        f"data: skipped 3 rows of ['{f}'] (empty turn: 3"
    )


def test_a_missing_data_set_under_the_assets_dir_says_how_to_fetch_it(tmp_path, monkeypatch):
    from dflash.config import EvalConfig, EvalSetConfig, RunConfig
    from dflash.run.preflight import check_run

    monkeypatch.setenv("DFLASH_ASSETS", str(tmp_path / "assets"))
    missing = tmp_path / "assets" / "sharegpt" / "sharegpt.jsonl"
    chat = EvalSetConfig(name="chat", source="jsonl", paths=[str(missing)])
    cfg = RunConfig(eval=EvalConfig(sets=[chat]))
    cfg.target.check_memory = False
    with pytest.raises(
        FileNotFoundError, match=r"fetch_models.sh sharegpt` \(or set DFLASH_ASSETS"
    ):
        check_run(cfg)
    elsewhere = EvalSetConfig(name="chat", source="jsonl", paths=[str(tmp_path / "mine.jsonl")])
    with pytest.raises(FileNotFoundError) as e:
        check_run(RunConfig(eval=EvalConfig(sets=[elsewhere])))
    assert "fetch_models" not in str(e.value)  # the user's own file: no asset to fetch
