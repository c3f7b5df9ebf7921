"""The dashboard's queries and what they read: each PromQL expression's metric and label names.

A tokenizer, not a parser: it finds the names a query reads (identifiers that are not functions,
keywords or label names), which is what the tests compare with a live /metrics. Whether the
expressions parse is checked by Prometheus itself (test_prometheus.py, `make test-integration`).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_PATH = ROOT / "configs" / "grafana" / "tandem.json"

_TOKENS = re.compile(r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<duration>(?:\d+(?:ms|[smhdwy]))+)
  | (?P<number>(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<variable>\$\{?\w+\}?)
  | (?P<name>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<symbol>[(){},])
  | (?P<other>\S)
  | \s+
""", re.X)
KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                      "unless", "offset", "atan2", "inf", "nan", "start", "end"})
# aggregation operators may be followed by `by (...)` instead of their parenthesis
AGGREGATIONS = frozenset({"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
                          "bottomk", "topk", "quantile", "limitk", "limit_ratio"})
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
# Grafana's template query for the model picker: label_values(metric, label)
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?P<metric>[A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*(?P<label>\w+)\s*\)\s*$")


@dataclass(frozen=True)
class QueryNames:
    metrics: frozenset[str]
    labels: frozenset[str]  # in matchers and in by/without/on/ignoring clauses


def names_in(expression: str) -> QueryNames:
    """The metric and label names `expression` reads."""
    tokens = [(m.lastgroup, m.group()) for m in _TOKENS.finditer(expression) if m.lastgroup]
    metrics, labels = set(), set()
    braces, grouping_parens, after_grouping_keyword = 0, 0, False
    for i, (kind, text) in enumerate(tokens):
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if kind == "symbol":
            braces += {"{": 1, "}": -1}.get(text, 0)
            if text == "(" and after_grouping_keyword:
                grouping_parens = 1
            elif text == "(" and grouping_parens:
                grouping_parens += 1
            elif text == ")" and grouping_parens:
                grouping_parens -= 1
            after_grouping_keyword = False
            continue
        after_grouping_keyword = kind == "name" and text in GROUPING
        if kind != "name" or text in KEYWORDS or text in AGGREGATIONS:
            continue
        if braces or grouping_parens:
            labels.add(text)
        elif following != "(":
            metrics.add(text)
    return QueryNames(frozenset(metrics), frozenset(labels))


def load_dashboard(path: Path = DASHBOARD_PATH) -> dict:
    return json.loads(path.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside collapsed rows included."""
    panels = []
    for panel in dashboard.get("panels", []):
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def dashboard_expressions(dashboard: dict) -> list[str]:
    """Every panel target's PromQL."""
    return [target["expr"] for panel in all_panels(dashboard) for target in panel.get("targets", [])]


def template_queries(dashboard: dict) -> list[QueryNames]:
    """The names the dashboard's variables read (label_values(metric, label) queries)."""
    found = []
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        match = _LABEL_VALUES.match(text)
        if variable.get("type") == "query":
            if match is None:
                raise ValueError(f"variable {variable.get('name')}: not a label_values(metric, label) query: {text!r}")
            found.append(QueryNames(frozenset({match["metric"]}), frozenset({match["label"]})))
    return found


def grafana_variables_replaced(expression: str, rate_window: str) -> str:
    """`expression` as Grafana would send it with every model selected ($model_name -> .*)."""
    return (expression.replace("$__rate_interval", rate_window).replace("$__interval", rate_window)
            .replace("$model_name", ".*"))
