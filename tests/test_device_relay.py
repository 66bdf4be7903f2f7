"""A run longer than one 30-minute lease of the GPU machine goes in relay legs (scripts/device):
the stopped run's directory is packed into parts a call can bring back, collected here into
upload chunks, and unpacked on the next machine. The round trip must give back every file byte
for byte (but the run lock, the profile and the eval sets' cache, which the resume recomputes
from the tokens files that do travel),
and refuse a missing part or a damaged chunk
instead of resuming from a broken run directory."""

import hashlib
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE = os.path.join(ROOT, "scripts", "device")


def _sh(script, env, *args, check=True):
    r = subprocess.run(
        ["bash", os.path.join(DEVICE, script), *args],
        cwd=ROOT,
        env={**os.environ, **{k: str(v) for k, v in env.items()}},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def _tree(root):
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


@pytest.fixture
def packed(tmp_path):
    """A stopped run's directory (random bytes where the weights and optimizer would be), packed
    in 100 kB parts and fetched in calls of 4 parts, as on the device."""
    run = tmp_path / "runs" / "main"
    ck = run / "checkpoints" / "step_00000007"
    ck.mkdir(parents=True)
    (ck / "train_state.pt").write_bytes(os.urandom(800_000))
    (ck / "model.safetensors").write_bytes(os.urandom(90_000))
    (run / "checkpoints" / "latest").write_text("step_00000007")
    (run / "data").mkdir()
    (run / "data" / "train-abc.pt").write_bytes(bytes(range(256)) * 400)
    (run / "data" / "eval-def.safetensors").write_bytes(os.urandom(300_000))  # recomputed
    (run / "data" / "eval-def.tokens.safetensors").write_bytes(os.urandom(3_000))  # from these
    (run / "metrics.jsonl").write_text('{"step": 7}\n')
    (run / "run.lock").write_text('{"pid": 1}\n')
    (run / "profile").mkdir()
    (run / "profile" / "trace.json").write_text("{}")
    pack = tmp_path / "pack"
    r = _sh("pack_run.sh", {"RUNS": tmp_path / "runs", "PACK": pack, "PART_BYTES": 100_000})
    assert r.stdout.startswith("pack rc=0 11 parts"), r.stdout  # ~1 MB: a tar, the eval cache out
    calls = []
    for i in range(3):
        out = tmp_path / f"call{i}"
        out.mkdir()
        r = _sh("fetch_pack.sh", {"PACK": pack, "I": i, "OUT": out})
        assert len(os.listdir(out)) == (5 if i < 2 else 4)  # 4 parts (3 in the last) + SHA256
        calls.append(out)
    assert "ALL PARTS FETCHED" in r.stdout
    assert _sh("fetch_pack.sh", {"PACK": pack, "I": 3, "OUT": out}, check=False).returncode == 2
    return run, calls


def test_a_packed_run_comes_back_byte_for_byte(tmp_path, packed):
    run, calls = packed
    st = tmp_path / "st"
    st.mkdir()  # an earlier leg's chunks (one more than now) and a checkpoint cut for eval_ckpt.sh
    for name in ("SHA256", "st_07", "ck_00"):
        (st / name).write_text("earlier")
    # the fetched folders in any order; upload chunks of 250 kB (58 MB on the device)
    _sh("relay_collect.sh", {"ST": st, "CHUNK_BYTES": 250_000}, *map(str, calls[::-1]))
    assert sorted(os.listdir(st)) == ["SHA256", "ck_00"] + [f"st_0{i}" for i in range(5)]
    r = _sh("unpack_state.sh", {"STATE": st, "RUNS": tmp_path / "next"})
    assert "step_00000007" in r.stdout
    left = ("run.lock", "profile/", "data/eval-def.safetensors")
    want = {k: v for k, v in _tree(run).items() if not k.startswith(left)}
    assert "data/train-abc.pt" in want and "data/eval-def.tokens.safetensors" in want
    assert len(want) == 6
    assert _tree(tmp_path / "next" / "main") == want
    assert not (st / "run.tar").exists()


def test_a_missing_part_or_a_damaged_chunk_is_refused(tmp_path, packed):
    _, calls = packed
    st = tmp_path / "st"
    for given in (calls[1:], calls[:2]):  # the first call's parts missing; the last call's
        r = _sh("relay_collect.sh", {"ST": st}, *map(str, given), check=False)
        assert r.returncode == 1 and ("is missing" in r.stderr or "do not match" in r.stderr)
        assert not st.exists()
    _sh("relay_collect.sh", {"ST": st, "CHUNK_BYTES": 250_000}, *map(str, calls))
    chunk = st / "st_01"
    data = bytearray(chunk.read_bytes())
    data[1000] ^= 1
    chunk.write_bytes(bytes(data))
    next_runs = tmp_path / "next"
    r = _sh("unpack_state.sh", {"STATE": st, "RUNS": next_runs}, check=False)
    assert r.returncode == 1 and "STATE INCOMPLETE OR BROKEN" in r.stdout
    assert not next_runs.exists() and not (st / "run.tar").exists()
    os.remove(st / "st_03")  # a chunk not uploaded
    assert _sh("unpack_state.sh", {"STATE": st, "RUNS": next_runs}, check=False).returncode == 1


def test_a_run_stopped_before_its_first_save_is_not_packed(tmp_path):
    (tmp_path / "runs" / "main" / "data").mkdir(parents=True)
    pack = tmp_path / "pack"
    r = _sh("pack_run.sh", {"RUNS": tmp_path / "runs", "PACK": pack}, check=False)
    assert r.returncode == 1 and "has no checkpoint: nothing to resume" in r.stdout
    r = _sh("fetch_pack.sh", {"PACK": pack, "I": 0, "OUT": tmp_path}, check=False)
    assert r.returncode == 3 and "NO PACK ON THIS MACHINE" in r.stdout
