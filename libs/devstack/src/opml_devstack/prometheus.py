"""A real Prometheus server scraping the services, for `make up` and tests of dashboards' queries.

Debian's ``prometheus`` package (v2.x, on PATH; `make install` installs it) is run as a child process
with a generated config: one scrape job per key of ``targets``, static ``host:port`` targets, every
``scrape_interval_s``. Its data lives under ``workdir`` (config, tsdb, log), so runs never share state.
The HTTP API (``/api/v1/query``, ``/query_range``, ``/targets``) is read with the standard library.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Self

from opml_common.process import terminate
from opml_devstack.devinfra import free_port

_TARGET = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")
_JOB = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")


class PrometheusError(RuntimeError):
    """Prometheus refused a request (a bad query, a server error) or is not reachable."""


class PrometheusServer:
    """``prometheus`` scraping ``targets`` (job -> ``["host:port", ...]``) on 127.0.0.1:``port``.

    Side effects:
        ``start()``: writes ``prometheus.yml`` and the tsdb under ``workdir``, starts the process
        (its output in ``workdir/prometheus.log``) and returns once ``/-/ready`` answers 200.
        Idempotent. A port of 0 is picked free when the server is built.
        ``stop()``: SIGTERM, then SIGKILL after ``stop_timeout_s``. Idempotent.
    """

    def __init__(self, *, workdir: Path, port: int = 0, targets: Mapping[str, Sequence[str]],
                 scrape_interval_s: float = 1.0, startup_timeout_s: float = 30.0, stop_timeout_s: float = 10.0,
                 binary: str = "prometheus") -> None:
        """Raises: ValueError (TypeError for a string where a list belongs) naming the bad argument."""
        if not 0 <= port <= 65535:
            raise ValueError(f"`port` must be in 0..65535, but got {port}")
        if scrape_interval_s < 0.001:
            raise ValueError(f"`scrape_interval_s` must be >= 0.001, but got {scrape_interval_s}")
        for job, addresses in targets.items():
            if not _JOB.match(job):
                raise ValueError(f"`targets` job names must match {_JOB.pattern}, but got {job!r}")
            if isinstance(addresses, str):
                raise TypeError(f"`targets[{job!r}]` must be a list of host:port, but got the string {addresses!r}")
            for address in addresses:
                if not _TARGET.match(address):
                    raise ValueError(f"`targets[{job!r}]` entries must be host:port, but got {address!r}")
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self.targets = {job: list(addresses) for job, addresses in targets.items()}
        self.scrape_interval_s = scrape_interval_s
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.binary = binary
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.workdir / "prometheus.yml"

    @property
    def log_path(self) -> Path:
        return self.workdir / "prometheus.log"

    def config_text(self) -> str:
        """The scrape config: global interval (timeout no longer than it), one static job per key."""
        interval = _duration(self.scrape_interval_s)
        timeout = _duration(min(self.scrape_interval_s, 10.0))
        lines = ["global:", f"  scrape_interval: {interval}", f"  scrape_timeout: {timeout}",
                 f"  evaluation_interval: {interval}", "scrape_configs:"]
        for job, addresses in self.targets.items():
            lines += [f"  - job_name: {json.dumps(job)}", "    static_configs:",
                      f"      - targets: {json.dumps(addresses)}"]
        if not self.targets:
            lines[-1] = "scrape_configs: []"
        return "\n".join(lines) + "\n"

    def command(self) -> list[str]:
        """The argv that runs it (config file and tsdb under ``workdir``, listening on 127.0.0.1 only)."""
        return [self.binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1d",
                "--log.level=warn"]

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> str:
        """Starts Prometheus and returns its base URL once it is ready.

        Raises: FileNotFoundError (no ``prometheus`` binary), RuntimeError (it exited; with its log's
        tail), TimeoutError (not ready within ``startup_timeout_s``).
        """
        if self.process is not None and self.process.poll() is None:
            return self.url
        if shutil.which(self.binary) is None:
            raise FileNotFoundError(f"{self.binary!r} is not on PATH: `make install` installs Debian's prometheus "
                                    "package (apt-get install prometheus)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self.config_text())
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(self.command(), stdout=log_file, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.url

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            terminate(process, timeout_s=self.stop_timeout_s)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = self.process.returncode if self.process is not None else None
                raise RuntimeError(f"prometheus exited with {code} before it was ready:\n{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"prometheus at {self.url} was not ready within {self.startup_timeout_s}s:\n"
                           f"{self._log_tail()}")

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""

    # -- queries ---------------------------------------------------------------------------------

    def query(self, promql: str, *, at: float | None = None) -> list:
        """The instant query's result: a list of ``{"metric": {...}, "value": [ts, "v"]}`` (a scalar
        or string result comes as one such element with no labels).

        Raises: PrometheusError with Prometheus' errorType and message (bad PromQL, timeouts).
        """
        params = {"query": promql, **({"time": f"{at:.3f}"} if at is not None else {})}
        data = self._api("query", params, what=promql)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query_range(self, promql: str, *, start: float, end: float, step_s: float) -> list:
        """The range query's matrix, ``[{"metric": {...}, "values": [[ts, "v"], ...]}]``, as Grafana asks
        a panel's data over a time range.

        Raises: PrometheusError.
        """
        params = {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": _duration(step_s)}
        data = self._api("query_range", params, what=promql)
        return data["result"]

    def metadata(self) -> dict[str, list[dict]]:
        """Metric name -> its type/help as the targets declared it (``/api/v1/metadata``), series or not.

        Raises: PrometheusError.
        """
        return self._api("metadata", {}, what="metadata")

    def targets_status(self) -> list[dict]:
        """The active targets as ``/api/v1/targets`` reports them (job, health, lastScrape, lastError)."""
        return self._api("targets", {"state": "active"}, what="targets")["activeTargets"]

    def wait_for_targets_up(self, *, since: float | None = None, timeout_s: float = 60.0) -> list[dict]:
        """Blocks until every configured target is up and was scraped (at or after ``since``, a Unix
        time, when given; else at least once); returns the targets' status.

        A scrape that starts after ``since`` has read what the service exported at ``since``, so a test
        calls this with the time its load ended before asserting on queries.

        Raises: TimeoutError naming the targets still down or not scraped, with their last error.
        """
        expected = {(job, address) for job, addresses in self.targets.items() for address in addresses}
        deadline = time.monotonic() + timeout_s
        waiting: list[str] = []
        while True:
            targets = self.targets_status()
            done = set()
            waiting = []
            for target in targets:
                key = (target["labels"].get("job"), target["labels"].get("instance"))
                scraped = _unix_time(target.get("lastScrape", ""))
                fresh = scraped > 0 and (since is None or scraped >= since)
                if target["health"] == "up" and fresh:
                    done.add(key)
                else:
                    waiting.append(f"{key[0]}/{key[1]}: health {target['health']}, last scrape "
                                   f"{target.get('lastScrape')}, error {target.get('lastError') or '-'}")
            missing = expected - done
            if not missing:
                return targets
            waiting += [f"{job}/{address}: not an active target yet" for job, address in sorted(missing)
                        if not any((t["labels"].get("job"), t["labels"].get("instance")) == (job, address)
                                   for t in targets)]
            if time.monotonic() >= deadline:
                raise TimeoutError(f"prometheus at {self.url}: targets not up and scraped within {timeout_s}s:\n  "
                                   + "\n  ".join(waiting))
            time.sleep(min(0.2, self.scrape_interval_s / 2))

    def _api(self, endpoint: str, params: Mapping[str, str], *, what: str) -> dict:
        url = f"{self.url}/api/v1/{endpoint}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as error:  # 400/422/503 carry Prometheus' JSON error
            try:
                body = json.loads(error.read())
            except ValueError:
                raise PrometheusError(f"prometheus at {self.url}: {endpoint} of {what!r}: HTTP {error.code}") from None
        except (urllib.error.URLError, OSError) as error:
            raise PrometheusError(f"prometheus at {self.url} is not reachable ({error}); is it started?") from None
        if body.get("status") != "success":
            raise PrometheusError(f"prometheus at {self.url}: {endpoint} of {what!r} failed: "
                                  f"{body.get('errorType', 'error')}: {body.get('error', body)}")
        return body["data"]


def _duration(seconds: float) -> str:
    """Prometheus' duration syntax, to the millisecond."""
    millis = max(1, round(seconds * 1000))
    return f"{millis // 1000}s" if millis % 1000 == 0 else f"{millis}ms"


def _unix_time(rfc3339: str) -> float:
    """``2024-01-02T03:04:05.123456789Z`` (or with an offset) as a Unix time; 0 for Go's zero time."""
    found = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$", rfc3339)
    if not found:
        return 0.0
    base, fraction, zone = found.groups()
    stamp = datetime.fromisoformat(base + ("+00:00" if zone == "Z" else zone)).timestamp()
    if stamp <= 0:
        return 0.0
    return stamp + (float("0." + fraction) if fraction else 0.0)


def has_finite_value(result: list) -> bool:
    """Whether an instant or range result holds any number a panel would draw (not NaN or ±Inf)."""
    for series in result:
        points = series.get("values") or ([series["value"]] if "value" in series else [])
        if any(math.isfinite(float(value)) for _ts, value in points):
            return True
    return False
