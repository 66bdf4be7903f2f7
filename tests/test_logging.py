"""Loggers: metrics.jsonl always, wandb offline without credentials, plots from jsonl."""

import json
import os

import pytest
import torch

from dflash.common.loggers import make_logger
from dflash.config import LoggerConfig


def test_jsonl_and_console(tmp_path, capsys):
    lg = make_logger(LoggerConfig(kind="console"), str(tmp_path), "r", {})
    lg.log({"train/loss": 1.5, "eval/tau": 2.0}, step=3)
    lg.close()
    assert "step      3" in capsys.readouterr().out
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert rows[0]["step"] == 3 and rows[0]["train/loss"] == 1.5


def test_wandb_offline_without_credentials(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("WANDB_SILENT", "true")
    lg = make_logger(LoggerConfig(kind="wandb"), str(tmp_path), "r", {"a": 1})
    assert lg.run is not None and lg.run.settings.mode == "offline"
    lg.log({"train/loss": 1.0}, step=1)
    lg.close()
    assert any(d.startswith("offline-run") for d in os.listdir(tmp_path / "wandb"))


def test_plot_from_metrics(tmp_path):
    pytest.importorskip("matplotlib")
    from dflash.common.plot import plot_run

    with open(tmp_path / "metrics.jsonl", "w") as f:
        for s in range(1, 5):
            f.write(
                json.dumps(
                    {
                        "step": s,
                        "train/loss": 5 - s,
                        "train/acc": s / 10,
                        "eval/tau": 1 + s / 10,
                        "eval/tau@4": 1 + s / 9,
                        "eval/acc_pos_1": s / 5,
                        "perf/tokens_per_s": 100,
                    }
                )
                + "\n"
            )
    out = plot_run(str(tmp_path))
    assert os.path.getsize(out) > 10_000
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(str(tmp_path / "nope"))


def test_plot_with_eval_sets_draws_each_sets_lines_only():
    """eval.sets: each set's chain tau with its largest DDTree budget (dashed, same colour) and
    its position-1 accuracy; no legend entry for a series the run never logged (eval/tau)."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from dflash.common.plot import run_figure

    rows = [{"step": 1, "train/loss": 3.0, "train/acc": 0.2, "perf/tokens_per_s": 9.0}]
    for s in (0, 4):
        row = {"step": s}
        for name in ("code", "chat"):
            row |= {f"eval/{name}/tau": 1 + s, f"eval/{name}/tau@4": 1.5 + s}
            row |= {f"eval/{name}/tau@64": 2 + s, f"eval/{name}/acc_pos_1": s / 5}
        rows.append(row)
    fig = run_figure(rows)
    legend = lambda ax: [t.get_text() for t in ax.get_legend().get_texts()]  # noqa: E731
    acc, tau = fig.axes[1], fig.axes[2]
    assert legend(tau) == ["tau chat", "chat tau@64", "tau code", "code tau@64"]
    assert legend(acc) == ["train acc (weighted)", "chat acc_pos_1", "code acc_pos_1"]
    lines = {ln.get_label(): ln for ln in tau.get_lines()}
    assert lines["chat tau@64"].get_color() == lines["tau chat"].get_color()
    assert lines["chat tau@64"].get_linestyle() == "--"
    assert list(lines["code tau@64"].get_ydata()) == [2, 6]


def test_compiled_graphs_counts_every_new_compile():
    """perf/compiled_graphs steps up in the interval that paid a (re)compile."""
    from dflash.train.loop import _compiled

    before = _compiled()["perf/compiled_graphs"]
    f = torch.compile(lambda x: x * 3 - 1, backend="eager", dynamic=False)
    f(torch.ones(2))
    f(torch.ones(2))  # the same shape: no new graph
    assert _compiled()["perf/compiled_graphs"] == before + 1
    f(torch.ones(2, 3))  # a new rank: a recompile
    assert _compiled()["perf/compiled_graphs"] == before + 2


def test_eval_keys_have_one_grammar():
    """eval/<metric> is the unnamed set's, eval/<set>/<metric> a named set's: the console line,
    the run summary, the plots and tools.compare read keys through dflash.common.loggers.eval_key."""
    from dflash.common.loggers import eval_key
    from dflash.common.plot import eval_set_keys

    assert eval_key("eval/tau") == (None, "tau")
    assert eval_key("eval/sharegpt/tau@64") == ("sharegpt", "tau@64")
    assert eval_key("train/loss") is None and eval_key("eval0/tau") is None
    assert eval_key("eval/a/b/tau") is None
    rows = [{"eval/tau": 1.0, "eval/code/tau": 2.0, "eval/chat/tau": 3.0, "eval/chat/streak": 1}]
    assert eval_set_keys(rows, "tau") == ["eval/chat/tau", "eval/code/tau"]
