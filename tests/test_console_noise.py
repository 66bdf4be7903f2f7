"""Console output of a run: the Gated-DeltaNet path in one line; transformers' fallback warnings
hidden only when dflash chose the torch backend itself, and never against the user's setting."""

import logging

from dflash.target.linear_attn import linear_attn_summary, quiet_fallback_warnings

HUB = "transformers.integrations.hub_kernels"


def test_gdn_summary_is_one_line_grouped_by_implementation():
    report = {
        "chunk_gated_delta_rule": "fla (fla.ops.gated_delta_rule.chunk_gated_delta_rule)",
        "recurrent_gated_delta_rule": "fla (fla.ops.x.fused_recurrent_gated_delta_rule)",
        "causal_conv1d_fn": "torch fallback (transformers.models.x.causal_conv1d_fn)",
    }
    assert linear_attn_summary(report) == (
        "fla (chunk_gated_delta_rule, recurrent_gated_delta_rule); torch fallback (causal_conv1d_fn)"
    )


def test_fallback_warnings_quiet_unless_the_user_sets_a_verbosity(monkeypatch):
    log = logging.getLogger(HUB)
    monkeypatch.setattr(log, "level", logging.NOTSET)
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "warning")
    quiet_fallback_warnings()
    assert log.level == logging.NOTSET
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY")
    quiet_fallback_warnings()
    assert log.level == logging.ERROR
    assert logging.getLogger("transformers").level != logging.ERROR  # only this logger
