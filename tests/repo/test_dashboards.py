"""The Grafana dashboards of deploy/compose: valid models on the provisioned datasource, PromQL that parses,
and only metrics the services really export (scraped from each one's /metrics, started as `make up` does).

PromQL is checked with ``promtool check rules`` (Debian's ``prometheus`` package, which `make install`
installs), and with the small parser below for what promtool accepts but a dashboard gets wrong (PromQL's
usual traps: ``rate`` of a gauge, a counter read without ``rate``, ``histogram_quantile`` not grouped by
``le``) and to find the metric names each query reads.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from opml_devstack.process import ServiceProcess
from opml_devstack.stack import installed_services
from opml_devstack.testing.metrics import scrape, scrape_router
from opml_devstack.testing.services import env_prefix

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "compose" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
PROMETHEUS_SERIES = {"up"}  # made by Prometheus itself for every target, not by a service
GRAFANA_RANGES = {"$__rate_interval", "$__interval", "$__range"}


def _datasource_uid() -> str:
    provisioned = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    [source] = [s for s in provisioned["datasources"] if s["type"] == "prometheus"]
    return source["uid"]


def _panels(panels: list[dict]) -> Iterator[dict]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _panel_queries(dashboard: dict) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target."""
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield f"{dashboard['uid']} panel {panel['id']} {panel['title']!r} {target['refId']}", target["expr"]


def _variable_queries(dashboard: dict) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every query variable: ``label_values(m, l)`` gives ``m``."""
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["definition"])
            assert found, f"{dashboard['uid']} ${variable['name']}: expected label_values(metric, label)"
            yield f"{dashboard['uid']} variable ${variable['name']}", found.group(1)


def _all_queries(*, variables: bool = True) -> list[tuple[str, str]]:
    dashboards = [json.loads(path.read_text()) for path in DASHBOARDS]
    return [query for dashboard in dashboards for query in
            [*_panel_queries(dashboard), *(_variable_queries(dashboard) if variables else ())]]


# ------------------------------------------------------------------------------------------- PromQL

AGGREGATIONS = {"sum": 1, "min": 1, "max": 1, "avg": 1, "group": 1, "stddev": 1, "stdvar": 1, "count": 1,
                "count_values": 2, "topk": 2, "bottomk": 2, "quantile": 2, "limitk": 2, "limit_ratio": 2}
_RANGE_FUNCTIONS = ["rate", "irate", "increase", "delta", "idelta", "deriv", "resets", "changes", "avg_over_time", "min_over_time", "max_over_time", "sum_over_time", "count_over_time", "last_over_time", "present_over_time", "stddev_over_time", "stdvar_over_time", "absent_over_time"]
_VECTOR_FUNCTIONS = ["abs", "ceil", "floor", "exp", "ln", "log2", "log10", "sqrt", "sgn", "absent", "sort", "sort_desc", "timestamp", "histogram_count", "histogram_sum", "histogram_avg"]
FUNCTIONS: dict[str, tuple[tuple[str, ...], str]] = {
    **{name: (("matrix",), "vector") for name in _RANGE_FUNCTIONS},
    **{name: (("vector",), "vector") for name in _VECTOR_FUNCTIONS},
    "quantile_over_time": (("scalar", "matrix"), "vector"),
    "predict_linear": (("matrix", "scalar"), "vector"),
    "histogram_quantile": (("scalar", "vector"), "vector"),
    "round": (("vector", "scalar?"), "vector"),
    "clamp": (("vector", "scalar", "scalar"), "vector"),
    "clamp_min": (("vector", "scalar"), "vector"),
    "clamp_max": (("vector", "scalar"), "vector"),
    "label_replace": (("vector", "string", "string", "string", "string"), "vector"),
    "label_join": (("vector", "string", "string", "string*"), "vector"),
    "scalar": (("vector",), "scalar"),
    "vector": (("scalar",), "vector"),
    "time": ((), "scalar"),
}
COUNTER_FUNCTIONS = {"rate", "irate", "increase", "resets"}
BINARY = {"or": 1, "and": 2, "unless": 2, "==": 3, "!=": 3, "<=": 3, ">=": 3, "<": 3, ">": 3,
          "+": 4, "-": 4, "*": 5, "/": 5, "%": 5, "atan2": 5, "^": 6}
_TOKEN = re.compile(r"""\s*(?:
    (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*')
  | (?P<range>\[[^\]]*\])
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>==|!=|<=|>=|=~|!~|[-+*/%^<>=(){},])
)""", re.VERBOSE)
_DURATION = r"(?:(?:\d+(?:ms|s|m|h|d|w|y))+|\$__\w+)"


@dataclass
class Selector:
    name: str
    range: str | None = None
    within: tuple[str, ...] = ()  # enclosing functions and aggregations, outermost first


@dataclass
class Aggregation:
    op: str
    grouping: tuple[str, ...]
    selectors: list[Selector] = field(default_factory=list)


class PromQLError(ValueError):
    pass


class PromQL:
    """A recursive-descent parser of the PromQL dashboards use; ``parse`` returns the expression's type
    and leaves the vector selectors (with what encloses them) in ``selectors``."""

    def __init__(self, expr: str) -> None:
        self.tokens: list[tuple[str, str]] = []
        position = 0
        while position < len(expr.rstrip()):
            found = _TOKEN.match(expr, position)
            if not found:
                raise PromQLError(f"unexpected {expr[position:].lstrip()[:20]!r}")
            self.tokens.append((found.lastgroup, found.group(found.lastgroup)))
            position = found.end()
        self.position = 0
        self.within: list[str] = []
        self.selectors: list[Selector] = []
        self.aggregations: list[Aggregation] = []

    def parse(self) -> str:
        kind = self._expr(1)
        if self.position != len(self.tokens):
            raise PromQLError(f"unexpected {self._peek()[1]!r} after a complete expression")
        return kind

    def _peek(self) -> tuple[str, str]:
        return self.tokens[self.position] if self.position < len(self.tokens) else ("end", "end of query")

    def _take(self, text: str | None = None, kind: str | None = None) -> str:
        token_kind, token = self._peek()
        if (text is not None and token != text) or (kind is not None and token_kind != kind):
            raise PromQLError(f"expected {text or kind}, got {token!r}")
        self.position += 1
        return token

    def _labels(self) -> tuple[str, ...]:
        self._take("(")
        labels = []
        while self._peek()[1] != ")":
            labels.append(self._take(kind="ident"))
            if self._peek()[1] != ",":
                break
            self._take(",")
        self._take(")")
        return tuple(labels)

    def _expr(self, min_precedence: int) -> str:
        left = self._unary()
        while (op := self._peek()[1]) in BINARY and BINARY[op] >= min_precedence:
            self._take()
            if self._peek()[1] == "bool":
                self._take()
            if self._peek()[1] in ("on", "ignoring"):
                self._take()
                self._labels()
            if self._peek()[1] in ("group_left", "group_right"):
                self._take()
                if self._peek()[1] == "(":
                    self._labels()
            right = self._expr(BINARY[op] + (0 if op == "^" else 1))
            if {left, right} - {"scalar", "vector"}:
                raise PromQLError(f"{op!r} needs scalars or instant vectors, got {left} and {right}")
            if op in ("and", "or", "unless") and {left, right} != {"vector"}:
                raise PromQLError(f"{op!r} needs instant vectors on both sides")
            left = "vector" if "vector" in (left, right) else "scalar"
        return left

    def _unary(self) -> str:
        if self._peek()[1] in ("-", "+"):
            self._take()
            kind = self._unary()
            if kind not in ("scalar", "vector"):
                raise PromQLError(f"unary minus needs a scalar or an instant vector, got {kind}")
            return kind
        return self._postfix()

    def _postfix(self) -> str:
        kind = self._primary()
        if self._peek()[0] == "range":
            text = self._take()[1:-1].strip()
            if kind == "selector" and re.fullmatch(_DURATION, text):
                self.selectors[-1].range = text
                kind = "matrix"
            elif kind in ("vector", "selector") and re.fullmatch(rf"{_DURATION}:{_DURATION}?", text):
                kind = "matrix"  # a subquery
            else:
                raise PromQLError(f"[{text}] is not a range of a selector nor a subquery")
        return "vector" if kind == "selector" else kind

    def _primary(self) -> str:
        token_kind, token = self._peek()
        if token_kind == "number":
            self._take()
            return "scalar"
        if token_kind == "string":
            self._take()
            return "string"
        if token == "(":
            self._take()
            kind = self._expr(1)
            self._take(")")
            return kind
        if token == "{":
            self.selectors.append(Selector("", within=tuple(self.within)))
            self._matchers()
            return "selector"
        if token_kind != "ident":
            raise PromQLError(f"unexpected {token!r}")
        self._take()
        if token in AGGREGATIONS:
            return self._aggregation(token)
        if self._peek()[1] == "(":
            return self._call(token)
        self.selectors.append(Selector(token, within=tuple(self.within)))
        if self._peek()[1] == "{":
            self._matchers()
        return "selector"

    def _matchers(self) -> None:
        self._take("{")
        while self._peek()[1] != "}":
            self._take(kind="ident")
            if self._peek()[1] not in ("=", "!=", "=~", "!~"):
                raise PromQLError(f"expected a label matcher operator, got {self._peek()[1]!r}")
            self._take()
            self._take(kind="string")
            if self._peek()[1] != ",":
                break
            self._take(",")
        self._take("}")

    def _aggregation(self, op: str) -> str:
        grouping: tuple[str, ...] = ()
        if self._peek()[1] in ("by", "without"):
            self._take()
            grouping = self._labels()
        aggregation = Aggregation(op, grouping)
        self.aggregations.append(aggregation)
        first = len(self.selectors)
        kinds = self._arguments(op)
        expected = ("scalar", "vector") if AGGREGATIONS[op] == 2 else ("vector",)
        if op == "count_values":
            expected = ("string", "vector")
        if kinds != list(expected):
            raise PromQLError(f"{op} takes ({', '.join(expected)}), got ({', '.join(kinds)})")
        if self._peek()[1] in ("by", "without"):
            if aggregation.grouping:
                raise PromQLError(f"{op} has two groupings")
            self._take()
            aggregation.grouping = self._labels()
        aggregation.selectors = self.selectors[first:]
        return "vector"

    def _call(self, name: str) -> str:
        if name not in FUNCTIONS:
            raise PromQLError(f"unknown function {name}()")
        params, result = FUNCTIONS[name]
        kinds = self._arguments(name)
        required = [p for p in params if not p.endswith(("?", "*"))]
        variadic = params and params[-1].endswith("*")
        if not len(required) <= len(kinds) <= (len(kinds) if variadic else len(params)):
            raise PromQLError(f"{name}() takes {len(params)} arguments, got {len(kinds)}")
        for index, kind in enumerate(kinds):
            expected = params[min(index, len(params) - 1)].rstrip("?*")
            if kind != expected:
                raise PromQLError(f"argument {index + 1} of {name}() must be a {expected}, got a {kind}")
        return result

    def _arguments(self, name: str) -> list[str]:
        self._take("(")
        self.within.append(name)
        kinds = []
        while self._peek()[1] != ")":
            kinds.append(self._expr(1))
            if self._peek()[1] != ",":
                break
            self._take(",")
        self.within.pop()
        self._take(")")
        return kinds


def promql_problems(expr: str) -> list[str]:
    """What is wrong with ``expr``: a syntax or type error, or one of PromQL's usual semantic traps."""
    try:
        parser = PromQL(expr)
        if parser.parse() not in ("vector", "scalar"):
            return ["a panel query must give an instant vector or a scalar"]
    except PromQLError as error:
        return [str(error)]
    problems = []
    for selector in parser.selectors:
        counter_like = selector.name.endswith(("_total", "_bucket", "_sum", "_count"))
        inside = selector.within[-1] if selector.within else None
        if inside in COUNTER_FUNCTIONS and not counter_like:
            problems.append(f"{inside}() of {selector.name}, which is not a counter")
        if selector.name.endswith("_total") and inside not in COUNTER_FUNCTIONS:
            problems.append(f"counter {selector.name} read without rate() or increase()")
        if inside == "rate" and selector.range != "$__rate_interval":
            problems.append(f"rate() of {selector.name} over [{selector.range}]: use [$__rate_interval]")
        if selector.range is not None and selector.range.startswith("$") and selector.range not in GRAFANA_RANGES:
            problems.append(f"[{selector.range}] is not one of Grafana's ranges {sorted(GRAFANA_RANGES)}")
        if selector.name.endswith("_bucket") and not any(name in AGGREGATIONS for name in selector.within):
            problems.append(f"{selector.name}: buckets not summed by (le, ...) (one series per replica)")
    for aggregation in parser.aggregations:
        buckets = [s.name for s in aggregation.selectors if s.name.endswith("_bucket")]
        if buckets and "le" not in aggregation.grouping:
            problems.append(f"{aggregation.op} of {buckets[0]} must keep 'le' (by (le, ...)) for histogram_quantile")
    return problems


def metric_names(expr: str) -> set[str]:
    parser = PromQL(expr)
    parser.parse()
    return {selector.name for selector in parser.selectors}


# ------------------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_is_a_valid_model_on_the_provisioned_datasource(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    uid = _datasource_uid()
    assert dashboard["uid"] == path.stem and dashboard["title"] and dashboard["schemaVersion"] >= 39
    panels = list(_panels(dashboard["panels"]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {path.name}"
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    for panel in panels:
        where = f"{path.name} panel {panel['id']} {panel['title']!r}"
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, where
        if panel["type"] == "row":
            continue
        assert panel["type"] in ("timeseries", "stat"), where
        assert panel["datasource"] == {"type": "prometheus", "uid": uid}, where
        assert panel["targets"], f"{where} has no query"
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), f"{where}: duplicate refIds"
        for target in panel["targets"]:
            assert target["datasource"] == {"type": "prometheus", "uid": uid}, where
            used = set(re.findall(r"\$(\w+)", target["expr"] + target.get("legendFormat", "")))
            assert {name for name in used if not name.startswith("__")} <= variables, where
    for variable in dashboard["templating"]["list"]:
        assert variable["datasource"] == {"type": "prometheus", "uid": uid}, variable["name"]


def test_dashboards_cover_every_service_and_are_provisioned() -> None:
    uids = {json.loads(path.read_text())["uid"] for path in DASHBOARDS}
    assert uids >= {"opml-overview"} | {f"opml-{spec.name}" for spec in installed_services()}
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "opml.yaml").read_text())["providers"][0]
    grafana = yaml.safe_load((ROOT / "deploy" / "compose" / "docker-compose.yml").read_text())["services"]["grafana"]
    mounts = dict(volume.rsplit(":", 1)[0].split(":", 1) for volume in grafana["volumes"])
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./grafana/provisioning/datasources"] == "/etc/grafana/provisioning/datasources"
    assert mounts["./grafana/provisioning/dashboards"] == "/etc/grafana/provisioning/dashboards"


def test_every_query_is_sound_promql() -> None:
    problems = [f"{where}: {problem}\n    {expr}" for where, expr in _all_queries(variables=False)
                for problem in promql_problems(expr)]
    for where, expr in _all_queries():
        try:
            PromQL(expr).parse()
        except PromQLError as error:
            problems.append(f"{where}: {error}\n    {expr}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("expr, problem", [
    ("sum(rate(x_total[$__rate_interval])", "expected )"),
    ("sum by (le method) (rate(x_total[$__rate_interval]))", "expected )"),
    ('sum(rate(x_total{a="b" c="d"}[$__rate_interval]))', "expected }"),
    ("sum(rate(x_total{a=\"b\"}[$__rate_interval])) by le", "expected ("),
    ("rat(x_total[$__rate_interval])", "unknown function"),
    ("sum(rate(x_total[$__rate_interval])) ! 2", "unexpected '! 2'"),
    ("rate(x_total)", "must be a matrix"),
    ("sum(rate(x_total[$__rate_interval])) + x_total[5m]", "needs scalars or instant vectors"),
    ("x_total", "without rate()"),
    ("rate(some_gauge[$__rate_interval])", "not a counter"),
    ("rate(x_total[5m])", "use [$__rate_interval]"),
    ("histogram_quantile(0.99, sum by (method) (rate(d_bucket[$__rate_interval])))", "must keep 'le'"),
    ("histogram_quantile(0.99, rate(d_bucket[$__rate_interval]))", "not summed by (le"),
])
def test_the_promql_check_catches_broken_queries(expr: str, problem: str) -> None:
    assert any(problem in found for found in promql_problems(expr)), promql_problems(expr)


def test_promtool_parses_every_query(tmp_path: Path) -> None:
    assert shutil.which("promtool"), "promtool is missing: `make install` installs Debian's prometheus package"
    rules = [{"record": f"opml:dashboard_query:{index}",
              "expr": re.sub(r"\$__\w+", "5m", expr).replace("$", "")}  # Grafana's variables made literal
             for index, (_where, expr) in enumerate(_all_queries())]
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = subprocess.run(["promtool", "check", "rules", str(tmp_path / "rules.yml")], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def exposed_families(exposition: str) -> dict[str, set[str]]:
    """Metric family -> the series names Prometheus stores of it, from a text exposition's ``# TYPE``
    lines, so metrics declared but without samples yet count: a histogram ``h`` gives h_bucket, h_sum
    and h_count. prometheus-client's ``_created`` series are left out (nothing to chart)."""
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}
    families = {}
    for line in exposition.splitlines():
        if line.startswith("# TYPE ") and not line.split()[2].endswith("_created"):
            _, _, name, kind = line.split(maxsplit=3)
            families[name] = {name + suffix for suffix in suffixes.get(kind, ("",))}
    return families


def test_labelled_metrics_are_visible_before_their_first_sample() -> None:
    registry = CollectorRegistry()
    Counter("c_total", "a counter", ("code",), registry=registry)
    Histogram("h_seconds", "a histogram", ("model",), registry=registry)
    Gauge("g", "a gauge", ("pool",), registry=registry)
    assert exposed_families(generate_latest(registry).decode()) == {
        "c_total": {"c_total"}, "h_seconds": {"h_seconds_bucket", "h_seconds_sum", "h_seconds_count"}, "g": {"g"}}


@pytest.mark.slow
def test_dashboards_show_exactly_the_metrics_services_export(start_service, tmp_path: Path) -> None:
    """Each installed service starts as `make up` starts it; the names on its /metrics right after
    start-up are what dashboards may ask for, and each of them is on some dashboard. The router's
    page carries its workers' ``opml_inference_router_worker_*`` families too (re-exported from each
    worker's own /metrics, control/worker_metrics.py): Prometheus scrapes no worker directly."""
    fleet = tmp_path / "fleet.yaml"  # the router's smallest fleet: one CPU worker of one slot
    fleet.write_text(yaml.safe_dump({
        "pool_kinds": [{"name": "cpu", "precisions": ["fp32"], "memory_mib": 1024, "slots": 1,
                        "cost_per_hour": 0.1, "execution_provider": "CPUExecutionProvider"}],
        "pools": [{"name": "cpu", "kind": "cpu", "workers": 1}]}))
    fleet_env = {"OPML_INFERENCE_ROUTER_FLEET": str(fleet)}
    processes: dict[str, tuple[ServiceProcess, int]] = {}
    for spec in installed_services():
        process = start_service(spec, tokens=None, extra_env=fleet_env, start=False)
        processes[spec.name] = (process, int(process.env[f"{env_prefix(spec)}METRICS_PORT"]))
    with ThreadPoolExecutor(len(processes)) as pool:  # the services are stopped by start_service
        for started in [pool.submit(process.start) for process, _ in processes.values()]:
            started.result()
    exported = {name: exposed_families(scrape_router(port) if name == "inference-router" else scrape(port))
                for name, (process, port) in processes.items()}
    families = {name: series for exposed in exported.values() for name, series in exposed.items()}
    for name, exposed in exported.items():
        prefix = "opml_" + name.replace("-", "_") + "_"
        assert f"{prefix}grpc_requests_total" in exposed, f"{name} exports no RED metrics"
    if "inference-router" in exported:  # its workers' RED and serving metrics, through its own page
        router = exported["inference-router"]
        for family in ("grpc_requests_total", "batch_size", "uds_requests_total"):
            assert f"opml_inference_router_worker_{family}" in router, f"the router re-exports no worker {family}"
    queried = {(where, metric) for where, expr in _all_queries() for metric in metric_names(expr)}
    everything = set().union(*families.values()) | PROMETHEUS_SERIES
    missing = sorted(f"{where}: {metric}" for where, metric in queried if metric not in everything)
    assert not missing, "dashboards query metrics no service exports:\n" + "\n".join(missing)
    used = {metric for _where, metric in queried}
    unshown = sorted(name for name, series in families.items() if name.startswith("opml_") and not series & used)
    assert not unshown, f"metrics on no dashboard (add panels in {GRAFANA / 'dashboards'}): {unshown}"
