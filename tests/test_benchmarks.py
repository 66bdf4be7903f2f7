"""The GPU figures are measured with the scripts in benchmarks/: each must still run end to end
against the package (on CPU, the tiny shape) and report the figures its docs quote."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(script: str, args: list[str], tmp_path) -> dict:
    out = tmp_path / f"{script}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", DFLASH_NO_PROGRESS="1")
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{script}.py", *args, "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_bench_train_step_times_both_label_modes(tmp_path):
    res = run_bench(
        "bench_train_step",
        ["--shape", "tiny", "--seq", "128", "--anchors", "16", "--label-sampling", "both"]
        + ["--iters", "1", "--rounds", "1"],
        tmp_path,
    )
    assert res["label_sampling"] == "by_weight"
    assert res["tokens_per_s"] > 0 and res["tokens_per_s_all_labels"] > 0
    ratio = res["s_per_step_all_labels"] / res["s_per_step"]
    assert res["by_weight_speedup"] == pytest.approx(ratio)


def test_bench_loop_reports_capture_step_loop_and_overlap(tmp_path):
    res = run_bench(
        "bench_loop",
        ["--target", "tiny", "--rows", "2", "--seq", "64", "--anchors", "8", "--steps", "1"]
        + ["--warmup", "1", "--ab-rounds", "1", "--label-sampling", "by_weight", "--fuse"],
        tmp_path,
    )
    for key in ("capture_ms", "step_ms", "loop_ms", "loop_source_overlap_ms", "by_weight_speedup"):
        assert res[key] > 0, key
    # a sanity range: a loaded CPU times the parts alone slower (2.25 seen beside other jobs)
    assert 0 < res["loop_over_ideal"] < 5


def test_bench_loop_quick_profiles_step_and_loop(tmp_path):
    prof = tmp_path / "prof"
    res = run_bench(
        "bench_loop",
        ["--target", "tiny", "--rows", "2", "--seq", "64", "--anchors", "8", "--steps", "1"]
        + ["--warmup", "1", "--quick", "--profile", str(prof)],
        tmp_path,
    )
    assert "by_weight_speedup" not in res and "step_fused_ms" not in res
    assert res["loop_ms"] > 0
    assert res["dflash"] == os.path.join(ROOT, "dflash")  # which checkout's package it timed
    for part in ("step", "loop"):
        (summary,) = [
            json.loads(x) for x in (prof / part / "summary.json").read_text().split("\n") if x
        ]
        assert summary["steps"][1] - summary["steps"][0] + 1 == 5
        assert summary["wall_unprofiled"] and summary["wall_ms_per_step"] > 0
        assert any(k.startswith("dflash.forward") for k in summary["phases_ms_per_step"])


def test_bench_target_reports_the_forward(tmp_path):
    res = run_bench(
        "bench_target",
        ["--target", "tiny_qwen3_5", "--seq", "64", "--iters", "1", "--compile-layers"],
        tmp_path,
    )
    assert res["tokens_per_s"] > 0 and 0 < res["fraction_of_peak"]
    assert not any(k.startswith("s_per_forward_compiled") for k in res)  # CUDA-only: CPU eager
    assert "s_per_forward_torch_conv1d" not in res  # fla's conv1d is bound on CUDA only


def test_bench_data_reads_and_encodes_conversations(tmp_path):
    res = run_bench(
        "bench_data",
        ["--conversations", "300", "--tokenizer", "bytes", "--max-length", "4096"],
        tmp_path,
    )
    assert res["conversations"] == 300 and res["user_turns_encoded"] > 300
    assert res["peak_rss_mb"] >= res["rss_before_mb"] and res["conversations_per_cpu_s"] > 0
    assert res["token_tables_mb"] > 0


def test_bench_loop_replays_a_runs_samples(tmp_path):
    """--samples: the loop timed on a run's own dataset cache (its lengths and loss masks), to
    compare a real run's tokens/s with the bench at the same rows and anchors."""
    import torch

    from dflash.data.batch import Sample
    from dflash.data.shards import atomic_torch_save, pack_samples

    g = torch.Generator().manual_seed(0)
    samples = []
    for i, n in enumerate([20, 33, 47, 60, 64, 200, 25, 41, 52, 38] * 2):  # 200: over --seq
        lm = torch.arange(n) >= n // 3
        samples.append(Sample(i, torch.randint(0, 5000, (n,), generator=g), lm))
    path = tmp_path / "train-abc.pt"
    atomic_torch_save(pack_samples(samples), str(path))
    res = run_bench(
        "bench_loop",
        ["--target", "tiny", "--rows", "2", "--seq", "64", "--anchors", "8", "--steps", "1"]
        + ["--warmup", "1", "--quick", "--samples", str(path)],
        tmp_path,
    )
    assert res["samples"] == str(path) and res["loop_ms"] > 0
    kept = [n for n in [20, 33, 47, 60, 64, 25, 41, 52, 38] for _ in range(2)]
    assert min(kept) * 2 <= res["tokens_per_step"] <= max(kept) * 2


def test_bench_regen_reports_agreement_and_profiles_the_decode(tmp_path):
    prof = tmp_path / "prof"
    res = run_bench(
        "bench_regen",
        ["--target", "tiny", "--batch", "8", "--new", "8", "--check-every", "4", "--min-rows", "2"]
        + ["--repeat", "1", "--dtype", "float32", "--profile", str(prof), "--profile-new", "4"]
        + ["--fuse"],
        tmp_path,
    )
    assert res["static_tokens_per_s"] > 0 and res["hf_generate_tokens_per_s"] > 0
    assert res["identical_rows"] == "8/8"  # float32: the static decoder is HF generate's tokens
    assert res["identical_rows_fused_vs_static"] == "8/8" and res["fuse_speedup"] > 0
    assert res["identical_rows_fused_compact_vs_compact"] == "8/8"
    assert res["fuse_compact_speedup"] > 0
    (summary,) = [json.loads(x) for x in (prof / "summary.json").read_text().split("\n") if x]
    assert summary["what"] == "static decode, 4 tokens" and summary["wall_ms_per_step"] > 0
    fused = tmp_path / "prof_fused" / "summary.json"
    assert json.loads(fused.read_text().split("\n")[0])["what"] == "static decode, fused, 4 tokens"


def test_bench_regen_run_regenerates_a_runs_data_once_per_variant(tmp_path):
    res = run_bench(
        "bench_regen_run",
        ["data.num_samples=16", "data.response_len=8", "--minutes", "1"]
        + ["--variants", "plain", "fuse+compact+b4", "--workdir", str(tmp_path / "w")],
        tmp_path,
    )
    assert res["decoder"] == "HF generate"  # CPU: the options act on the CUDA decoder only
    for v in ("plain", "fuse+compact+b4"):
        assert res[f"{v}_samples"] == 16 and res[f"{v}_prompts_reached"] == "all"
        assert res[f"{v}_tokens_per_s"] > 0
    assert res["plain_batch"] == 32 and res["fuse+compact+b4_batch"] == 4
    assert res["identical_samples_fuse+compact+b4_vs_plain"] == "16/16"  # float32 on CPU
    assert (tmp_path / "w" / "fuse_compact_b4.pt").is_file()


def test_bench_regen_run_matches_samples_by_prompt_not_by_id():
    """Under a time cap two variants keep other prompts, and sample ids count the kept samples:
    the comparison must pair samples by their prompt."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_regen_run import by_prompt, parts_at

    from dflash.data.batch import Sample

    def sample(i, prompt, response):
        ids = torch.tensor(prompt + response)
        mask = torch.tensor([False] * len(prompt) + [True] * len(response))
        return Sample(sample_id=i, input_ids=ids, loss_mask=mask)

    a = by_prompt([sample(0, [5, 6], [7, 8]), sample(1, [9], [1])])
    b = by_prompt([sample(0, [9], [1]), sample(1, [3, 4], [2])])  # prompt [5, 6] not reached
    (common,) = set(a) & set(b)
    assert parts_at(a[common], b[common]) is None and a[common][0].tolist() == [9, 1]
    # where two texts of one prompt part, counted from the response's first token
    c, d = by_prompt([sample(0, [5, 6], [7, 8, 9])]), by_prompt([sample(0, [5, 6], [7, 3, 9])])
    (k,) = c
    assert parts_at(c[k], d[k]) == 1
    assert parts_at(c[k], by_prompt([sample(0, [5, 6], [7])])[k]) == 1  # a prefix parts at its end


def test_bench_regen_run_sums_the_rounds_of_a_conversation_recipe():
    """A multi-turn regeneration logs one line per round: tokens and seconds are their sums,
    prompts reached are the first round's (its cap), and a run no cap cut reached "all"."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_regen_run import regen_figures

    lines = [
        "regenerate: time limit of 1.00 min reached after 96 of 128 prompts (data.regen_time_limit_min)",
        "regenerate: 4000 new tokens in 8.0 s (500 tokens/s, batch 32, HF generate)",
        "regenerate turn 2: 1000 new tokens in 4.0 s (250 tokens/s, batch 32, HF generate)",
        "data: 6 user turns answered in order",
    ]
    got = regen_figures(lines)
    assert got == {
        "new_tokens": 5000,
        "regen_s": 12.0,
        "rounds": 2,
        "tokens_per_s": 416.7,
        "prompts_reached": 96,
    }
    assert regen_figures(lines[1:2])["prompts_reached"] == "all"
    late = "regenerate turn 2: time limit of 0.10 min reached after 7 of 9 prompts (...)"
    assert regen_figures([late, *lines[1:3]])["prompts_reached"] == "all"  # turn 1 was whole
    assert regen_figures([]) == {"prompts_reached": "all"}


def test_check_given_answers_scores_regenerated_and_foreign_answers(tmp_path):
    rows = tmp_path / "rows.jsonl"
    conv = [
        {"from": "human", "value": "Tell me about the number {i}."},
        {"from": "gpt", "value": "The number {i} is a number I did not write."},
    ]
    rows.write_text(
        "".join(
            json.dumps(
                {
                    "id": str(i),
                    "conversations": [{**t, "value": t["value"].format(i=i)} for t in conv],
                }
            )
            + "\n"
            for i in range(6)
        )
    )
    res = run_bench(
        "check_given_answers",
        ["--target", "tiny_llama", "--rows", str(rows), "--n", "6", "--response-len", "8"]
        + ["--batch", "6"],
        tmp_path,
    )
    assert res["conversations"] == 6 and res["regenerated_agreement"] == 1.0
    assert res["their_own_answers_given_agreement"] < 0.5
    assert res["regenerated_text_given_tokens"] == res["regenerated_tokens"]


# float32 rows 80 tiles wide, on CPU: tiled_topk's two passes, quickly
TOPK_ARGS = ["--device", "cpu", "--rows", "8", "--vocab", str(128 * 80), "--dtype", "float32"]
TOPK_ARGS += ["--iters", "2", "--rounds", "2"]


def test_bench_topk_times_both_and_checks_the_values(tmp_path):
    res = run_bench(
        "bench_topk",
        TOPK_ARGS,
        tmp_path,
    )
    assert res["values_equal"] and res["indices_equal"]  # float32 normal rows: no ties
    assert res["speedup"] == pytest.approx(res["torch_topk_ms"] / res["tiled_topk_ms"])
    assert "tiled_topk_compiled_ms" not in res


def test_bench_topk_times_the_compiled_function_too(tmp_path):
    res = run_bench(
        "bench_topk",
        [*TOPK_ARGS, "--compile", "aot_eager"],
        tmp_path,
    )
    assert res["values_equal"] and res["compiled_values_equal"]
    assert res["compiled_speedup"] == pytest.approx(
        res["tiled_topk_ms"] / res["tiled_topk_compiled_ms"]
    )


def test_bench_topk_times_the_fused_heads_row_and_tile_stats(tmp_path):
    res = run_bench("bench_topk", [*TOPK_ARGS, "--head"], tmp_path)
    assert res["correct_equal"] and res["topk_values_equal"] and res["loss_rel_diff"] < 1e-6
    assert res["grad_max_abs_diff"] < 1e-6
    assert res["tiles_speedup"] == pytest.approx(res["rows_ms"] / res["tiles_ms"])


def test_bench_loop_times_dflash2s_three_heads(tmp_path):
    res = run_bench(
        "bench_loop",
        ["--target", "tiny", "--rows", "2", "--seq", "64", "--anchors", "8", "--steps", "1"]
        + ["--warmup", "1", "--ab-rounds", "1", "--quick", "--variant", "dflash2", "--head-ab"],
        tmp_path,
    )
    for key in ("step_fused_head_ms", "step_plain_head_ms", "step_tiles_head_ms"):
        assert res[key] > 0, key
    assert res["tiles_speedup"] == pytest.approx(
        res["step_fused_head_ms"] / res["step_tiles_head_ms"]
    )


def test_bench_near_ties_reports_the_kept_text_per_rounds_value(tmp_path):
    args = ["--target", "tiny_llama", "--source", "selfgen", "--dtype", "float32"]
    args += ["--prompts", "3", "--completion-len", "8", "--batch", "2", "--rounds", "0,2"]
    res = run_bench("bench_near_ties", args, tmp_path)
    n = res["greedy_tokens_decoded"]  # up to 3 x 8 (a completion may end at EOS)
    assert res["prompts"] == 3 and 3 < n <= 24
    for r in (0, 2):  # fp32 on CPU: batched and one-shot forwards agree, nothing cut
        assert "cut" not in res[f"rounds{r}_log"], res[f"rounds{r}_log"]
        kept = res[f"rounds{r}_kept_tokens"]  # all but 1-token completions (EOS at once)
        assert kept == res["rounds0_kept_tokens"] >= n - 3 and res[f"rounds{r}_kept_share"] <= 1
