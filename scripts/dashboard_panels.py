"""The panel model of the gpuwatchd dashboards and the SDK code that turns it into JSON.

Used by scripts/gen_dashboards.py; the panel tables are dashboard_node.py and
dashboard_fleet.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from grafana_foundation_sdk.builders import bargauge, stat, statetimeline, table, timeseries
from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus as gp
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

S = 'cluster=~"$cluster", node=~"$node", instance=~"$instance"'
G = f'{S}, gpu=~"$gpu"'
NODE_KEYS = "cluster, node, instance"
DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
EMPTY = "Empty while nothing is wrong. "  # tests only check that such queries evaluate

HEALTH_TEXT = {"0": ("healthy", "green"), "1": ("degraded", "orange"), "2": ("unhealthy", "red")}
UP_TEXT = {"0": ("down", "red"), "1": ("up", "green")}
FLAG_TEXT = {"0": ("no", "green"), "1": ("yes", "red")}


@dataclass
class P:
    """One panel: kind, title, [(expr, legend)], width, height and options."""

    kind: str
    title: str
    targets: list[tuple[str, str]] = field(default_factory=list)
    w: int = 12
    h: int = 8
    unit: str = ""
    description: str = ""
    mapping: dict[str, tuple[str, str]] | None = None
    instant: bool = False


def row(title: str) -> P:
    return P("row", title, w=24, h=1)


def _mappings(text: dict[str, tuple[str, str]]) -> list[dm.ValueMapping]:
    return [
        dm.ValueMap(
            options={
                v: dm.ValueMappingResult(text=t, color=c, index=i)
                for i, (v, (t, c)) in enumerate(sorted(text.items()))
            }
        )
    ]


BUILDERS: dict[str, Any] = {
    "stat": stat.Panel,
    "table": table.Panel,
    "timeseries": timeseries.Panel,
    "bargauge": bargauge.Panel,
    "state-timeline": statetimeline.Panel,
}


def _panel(p: P, pid: int, pos: dm.GridPos) -> Any:
    if p.kind == "row":
        return gd.Row(p.title).id(pid).grid_pos(pos)
    b = BUILDERS[p.kind]().id(pid).title(p.title).datasource(DS).grid_pos(pos)
    if p.description:
        b = b.description(p.description)
    if p.unit:
        b = b.unit(p.unit)
    if p.mapping:
        b = b.mappings(_mappings(p.mapping))
    for i, (expr, legend) in enumerate(p.targets):
        q = gp.Dataquery().expr(expr).ref_id(chr(ord("A") + i)).datasource(DS)
        if legend:
            q = q.legend_format(legend)
        if p.instant:
            q = q.instant().format(pm.PromQueryFormat.TABLE)
        b = b.with_target(q)
    if p.kind == "table" and len(p.targets) > 1:
        b = b.with_transformation(dm.DataTransformerConfig(id_val="merge", options={}))
    return b


def _layout(panels: list[P]) -> list[tuple[P, dm.GridPos]]:
    out, x, y, row_h = [], 0, 0, 0
    for p in panels:
        if p.kind == "row" or x + p.w > 24:
            x, y, row_h = 0, y + row_h, 0
        out.append((p, dm.GridPos(h=p.h, w=p.w, x=x, y=y)))
        x, row_h = x + p.w, max(row_h, p.h)
        if p.kind == "row":
            x, y, row_h = 0, y + 1, 0
    return out


def _variable(name: str, label: str, query: str) -> Any:
    return (
        gd.QueryVariable(name)
        .label(label)
        .datasource(DS)
        .query({"query": query, "refId": name})
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .include_all(True)
        .all_value(".*")
        .multi(True)
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
    )


def build(uid: str, title: str, description: str, panels: list[P], gpu: bool) -> dict[str, Any]:
    """One dashboard as JSON-able data."""
    d = (
        gd.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["gpuwatchd", "gpu", "nvidia"])
        .editable()
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .refresh("1m")
        .time("now-6h", "now")
        .timezone("browser")
        .link(
            gd.DashboardLink("gpuwatchd dashboards")
            .type(dm.DashboardLinkType.DASHBOARDS)
            .tags(["gpuwatchd"])
            .as_dropdown(False)
            .include_vars(True)
            .keep_time(True)
        )
        .with_variable(gd.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            _variable("cluster", "Cluster", "label_values(gpuwatchd_build_info, cluster)")
        )
        .with_variable(
            _variable(
                "node", "Node", 'label_values(gpuwatchd_build_info{cluster=~"$cluster"}, node)'
            )
        )
        .with_variable(
            _variable(
                "instance",
                "Target",
                'label_values(gpuwatchd_build_info{cluster=~"$cluster", node=~"$node"}, instance)',
            )
        )
    )
    if gpu:
        d = d.with_variable(
            _variable("gpu", "GPU", f"label_values(gpuwatchd_gpu_info{{{S}}}, gpu)")
        )
    for pid, (p, pos) in enumerate(_layout(panels), start=1):
        item = _panel(p, pid, pos)
        d = d.with_row(item) if p.kind == "row" else d.with_panel(item)
    data: dict[str, Any] = json.loads(json.dumps(d.build(), cls=JSONEncoder))
    for panel in data["panels"]:
        if panel.get("options") is None:
            panel.pop("options", None)  # unset: Grafana applies the panel type's defaults
    return data
