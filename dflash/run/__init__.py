"""The launcher and entry glue: command-line keys checked against the schema, checks that need no
model, the run directory and its train.log, Ctrl-C / SIGTERM, the one dispatch to a colocated or
split run, and every exit code."""

from .cli import setup, typed  # Hydra set-up; DictConfig -> validated RunConfig
from .launcher import launch  # train.py's whole run
