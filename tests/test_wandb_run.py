"""A tiny training run with logger=wandb in offline mode, read back from the offline run
directory: resolved config, metric step axes, per-prompt eval table, acceptance histogram and
the checkpoint artifact."""

import glob
import json
import struct
import time

import pytest

pytest.importorskip("wandb")


def wandb_records(path: str) -> list:
    """Records of an offline .wandb file: W&B's header, then LevelDB-log framing (32 KiB
    blocks of chunks: crc32, length, type 1 full / 2 first / 3 middle / 4 last) around
    protobuf Records. wandb >= 0.19 ships no Python reader (its core is Go)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    out, pos, buf, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # a chunk still being written
            break
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def complete_records(path: str, timeout_s: float = 60.0) -> list:
    """wandb's service process writes the offline file on its own schedule, and run.finish()
    can return before the last records are flushed: wait for the exit record."""
    deadline = time.monotonic() + timeout_s
    while True:
        recs = wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in recs):
            return recs
        assert time.monotonic() < deadline, f"{path}: no exit record after {timeout_s} s"
        time.sleep(0.2)


def test_wandb_offline_run_reads_back(tmp_path, monkeypatch):
    from test_tiny_tokenizer import _cfg

    from dflash.train.colocated import run_colocated

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    extra = ["logger=wandb", "logger.mode=offline", "logger.log_checkpoints=true"]
    cfg = _cfg(tmp_path, "tiny_qwen3_5", "selfgen", extra)
    run_colocated(cfg, str(tmp_path / "run"))
    (run_dir,) = glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*"))
    (wfile,) = glob.glob(f"{run_dir}/run-*.wandb")
    recs = complete_records(wfile)
    by_kind = {}
    for r in recs:
        by_kind.setdefault(r.WhichOneof("record_type"), []).append(r)

    # the resolved config (typed, every group), nested as the run config
    (run,) = by_kind["run"]
    cfg_items = {u.key: json.loads(u.value_json) for u in run.run.config.update}
    assert cfg_items["train"]["steps"] == 2 and cfg_items["target"]["name"] == "tiny_qwen3_5"
    assert cfg_items["logger"]["log_checkpoints"] is True

    # metric namespaces on the trainer/step axis
    metrics = {
        (m.metric.glob_name or m.metric.name): m.metric.step_metric for m in by_kind["metric"]
    }
    for ns in ("train", "eval", "perf", "pipe"):
        assert metrics[f"{ns}/*"] == "trainer/step"

    # the eval at step 0 and at step 2: a per-prompt table and an acceptance histogram each
    rows = []
    for r in by_kind["history"]:
        items = {}
        for i in r.history.item:  # nested values arrive as one item per leaf path
            path = [i.key] if i.key else list(i.nested_key)
            node = items
            for k in path[:-1]:
                node = node.setdefault(k, {})
            node[path[-1]] = json.loads(i.value_json)
        if "eval/prompts" in items:
            rows.append(items)
    assert [int(x["trainer/step"]) for x in rows] == [0, 2]
    hist = rows[-1]["eval/accepted_hist"]
    assert hist["_type"] == "histogram" and sum(hist["values"]) > 0
    assert len(hist["bins"]) == cfg.drafter.block_size + 1  # lengths 0..B-1
    table_ref = rows[-1]["eval/prompts"]
    assert table_ref["_type"] == "table-file" and table_ref["nrows"] == 2
    table = json.load(open(f"{run_dir}/files/{table_ref['path']}"))
    assert table["columns"][:6] == ["step", "prompt", "rounds", "streak", "tau", "matches"]
    assert "dds@4" in table["columns"]
    row = dict(zip(table["columns"], table["data"][0]))
    assert row["step"] == 2 and row["rounds"] >= 1 and set(row["matches"]) <= set("✓✗ ")
    assert row["tau"] == pytest.approx(row["streak"] + 1)

    # the checkpoint as a model artifact, serving files only
    (art,) = [r.artifact for r in by_kind["artifact"] if r.artifact.type == "model"]
    assert art.name == "run-drafter"  # <run dir name>-drafter
    assert {c.path for c in art.manifest.contents} == {"config.json", "model.safetensors"}


def test_dashboard_spec_names_only_metrics_that_runs_log(tmp_path, capsys):
    """Every panel of docs/wandb_workspace.json plots a key a colocated run logs, or a pipe/*
    key the split pipeline logs (dflash/train/split/)."""
    import os
    import re

    from conftest import ROOT
    from test_tiny_tokenizer import _cfg

    from dflash.tools.wandb_workspace import load_spec, main
    from dflash.train.colocated import run_colocated

    run_colocated(_cfg(tmp_path, "tiny_qwen3_5", "selfgen"), str(tmp_path / "run"))
    logged = {k for line in open(tmp_path / "run" / "metrics.jsonl") for k in json.loads(line)}
    src = "".join(
        open(f).read()
        for f in glob.glob(os.path.join(ROOT, "dflash", "**", "*.py"), recursive=True)
    )
    logged |= set(re.findall(r'"(pipe/[a-z_]+)"', src))
    spec = load_spec()
    wanted = {y for sec in spec["sections"] for p in sec["panels"] for y in p["y"]}
    assert {"train/loss", "eval/tau", "eval/dds@8", "perf/tokens_per_s"} <= wanted
    assert {"pipe/worker_tokens_per_s", "pipe/trainer_tokens_per_s"} <= wanted  # per role
    assert wanted - logged == set()
    assert spec["x"] == "trainer/step"
    assert main(["--print"]) == 0 and "tau (tokens per verify round)" in capsys.readouterr().out


def test_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
    """The wandb id lives in the run dir: a second logger there (a resume) reuses it."""
    from dflash.common.loggers import WandbLogger
    from dflash.config import LoggerConfig

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = LoggerConfig(kind="wandb", mode="offline")
    ids = []
    for _ in range(2):
        lg = WandbLogger(cfg, str(tmp_path), "r", {"a": 1})
        ids.append(lg.run.id)
        lg.close()
    assert ids[0] == ids[1] == (tmp_path / "wandb_id").read_text().strip()
    (tmp_path / "other").mkdir()
    other = WandbLogger(cfg, str(tmp_path / "other"), "o", {})
    assert other.run.id != ids[0]
    other.close()
