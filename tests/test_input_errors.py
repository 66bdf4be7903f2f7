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
