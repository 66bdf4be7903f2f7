"""Save the dflash dashboard layout (docs/wandb_workspace.json) as a wandb saved workspace view.

    pip install wandb-workspaces && wandb login
    python -m dflash.tools.wandb_workspace --entity ENTITY --project dflash

Needs the wandb-workspaces package and online credentials (a workspace lives on the server; an
offline run cannot carry one). `--print` shows the panels without either.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SPEC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "wandb_workspace.json")


def load_spec(path: str = SPEC) -> dict:
    with open(path) as f:
        spec = json.load(f)
    for sec in spec["sections"]:
        for panel in sec["panels"]:
            if not panel.get("y"):
                raise ValueError(f"{path}: panel {panel.get('title')!r} has no y metrics")
    return spec


def build_workspace(spec: dict, entity: str, project: str):
    """The spec as a wandb_workspaces Workspace (one LinePlot per panel, x = the step axis)."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    return ws.Workspace(
        name=spec["name"],
        entity=entity,
        project=project,
        sections=[
            ws.Section(
                name=sec["name"],
                panels=[
                    wr.LinePlot(title=p["title"], x=spec["x"], y=list(p["y"]))
                    for p in sec["panels"]
                ],
                is_open=True,
            )
            for sec in spec["sections"]
        ],
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--entity")
    ap.add_argument("--project", default="dflash")
    ap.add_argument("--spec", default=SPEC)
    ap.add_argument("--print", action="store_true", help="list the panels; save nothing")
    a = ap.parse_args(argv)
    spec = load_spec(a.spec)
    if a.print:
        for sec in spec["sections"]:
            print(sec["name"])
            for p in sec["panels"]:
                print(f"  {p['title']}: {', '.join(p['y'])} vs {spec['x']}")
        return 0
    if not a.entity:
        print("error: --entity is required to save a workspace", file=sys.stderr)
        return 2
    try:
        workspace = build_workspace(spec, a.entity, a.project)
    except ImportError:
        print("error: needs `pip install wandb-workspaces` (and `wandb login`)", file=sys.stderr)
        return 2
    saved = workspace.save()
    print(f"saved workspace view: {getattr(saved, 'url', '') or spec['name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
