"""Evaluation that predicts serving: the offline greedy simulation (streak, tau, DDTree, tau at
temperature T), eval sets, reports, real-decoding reports and eval.py's driver."""

from .cli import run_eval  # eval.py: a checkpoint on its target's eval set
from .ddtree import ddtree_accept_many  # DDTree acceptance of the greedy continuation
from .metrics import summarize, walk_chain  # rounds walked as an engine walks them
from .offline import Evaluator, evaluate  # the offline simulation; the in-loop evaluator
from .sets import (  # prompts + the target's greedy completions, cached
    build_eval_set,
    build_eval_sets,
)
