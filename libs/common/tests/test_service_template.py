"""The service template: run_service's order and teardown, the role table's start-up check, errors
with field violations over a real gRPC connection, the client base, topics from the protos, the emitter.

The gRPC tests host the job-orchestrator's proto service with a servicer of the test's own (the
template knows no service), on a real server on a free port.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import click
import grpc
import pytest
from click.testing import CliRunner
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from opml.bundles.v1 import bundles_pb2
from opml.bundles.v1 import events_pb2 as bundle_events_pb2
from opml.jobs.v1 import jobs_pb2, jobs_pb2_grpc
from prometheus_client import CollectorRegistry

from opml_common.cligroup import pass_session, service_group
from opml_common.config import PlatformSettings, ServiceSettings
from opml_common.errors import InvalidArgument, NotFound, OpmlError
from opml_common.events import OutboxEmitter, RecordingEmitter, topic_of
from opml_common.grpc.client import AsyncServiceClient, ServiceClient, async_pages, pages
from opml_common.grpc.server import GrpcServer, ServiceRegistration
from opml_common.grpc.status import field_violations
from opml_common.lifecycle import Component
from opml_common.metrics import ServiceMetrics
from opml_common.outbox import Outbox
from opml_common.process import ServiceSpec
from opml_common.service import ServiceContext, serve
from opml_common.topics import Topic

JOBS = jobs_pb2.DESCRIPTOR.services_by_name["JobService"]
ROLES = {"SubmitJob": "writer", "GetJob": "reader", "ListJobs": "reader", "CancelJob": "writer",
         "PreemptJob": "admin", "ReadJobLogs": "reader", "WatchJobs": "reader"}


class Jobs(jobs_pb2_grpc.JobServiceServicer):
    """Fails the way a core does: several violations at once, a missing job, a broken stream; pages of 2."""

    def __init__(self) -> None:
        self.preempting = asyncio.Event()
        self.preempt_metadata: dict[str, str] = {}

    async def SubmitJob(self, request, context):
        raise InvalidArgument.of([("spec.name", "must not be empty"),
                                  ("spec.roles.worker.replicas", "must be >= 1, but got 0")])

    async def GetJob(self, request, context):
        raise NotFound(f"job {request.name!r} does not exist")

    async def CancelJob(self, request, context):
        raise InvalidArgument.of([(f"spec.roles.worker.env.VARIABLE_{n}", f"must be under 64 KiB, but got {'x' * 300!r}")
                                  for n in range(60)])

    async def ListJobs(self, request, context):
        start = int(request.page_token or 0)
        jobs = [jobs_pb2.Job(name=f"jobs/j{n}") for n in range(start, min(start + 2, 5))]
        return jobs_pb2.ListJobsResponse(jobs=jobs, next_page_token=str(start + 2) if start + 2 < 5 else "")

    async def WatchJobs(self, request, context):
        yield jobs_pb2.JobChange()
        raise NotFound("the watch lost its job")

    async def PreemptJob(self, request, context):
        """Keeps the call open until the client gives up, keeping first what metadata came with it."""
        self.preempt_metadata = dict(context.invocation_metadata())
        self.preempting.set()
        await asyncio.Event().wait()


class JobsClient(ServiceClient):
    stub_class = jobs_pb2_grpc.JobServiceStub


class AsyncJobsClient(AsyncServiceClient):
    stub_class = jobs_pb2_grpc.JobServiceStub


def _registration(roles: dict[str, str] = ROLES, servicer: Jobs | None = None) -> ServiceRegistration:
    return ServiceRegistration(JOBS, jobs_pb2_grpc.add_JobServiceServicer_to_server, servicer or Jobs(), roles)


@pytest.fixture
def jobs() -> Jobs:
    return Jobs()


@pytest.fixture
async def jobs_target(jobs: Jobs):
    server = GrpcServer(settings=ServiceSettings(grpc_port=0, metrics_port=0), platform=PlatformSettings(),
                        metrics=ServiceMetrics("template-test", CollectorRegistry()),
                        registrations=[_registration(servicer=jobs)])
    async with server:
        yield f"127.0.0.1:{server.port}"


# -- the role table -------------------------------------------------------------------------------

def test_an_rpc_missing_from_the_role_table_stops_the_service() -> None:
    roles = {k: v for k, v in ROLES.items() if k != "CancelJob"}
    with pytest.raises(ValueError, match="no role for CancelJob"):
        _registration(roles)


def test_a_misspelt_rpc_in_the_role_table_stops_the_service() -> None:
    roles = {**{k: v for k, v in ROLES.items() if k != "GetJob"}, "GetJobs": "reader"}
    with pytest.raises(ValueError, match=r"no role for GetJob;.*GetJobs is not an RPC of it"):
        _registration(roles)


def test_an_unknown_role_stops_the_service() -> None:
    with pytest.raises(ValueError, match="unknown roles GetJob=owner"):
        _registration({**ROLES, "GetJob": "owner"})


# -- errors on the wire ---------------------------------------------------------------------------

async def test_invalid_argument_carries_every_field_violation_as_bad_request(jobs_target: str) -> None:
    async with grpc.aio.insecure_channel(jobs_target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await jobs_pb2_grpc.JobServiceStub(channel).SubmitJob(jobs_pb2.SubmitJobRequest())
    error = caught.value
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.name: must not be empty" in error.details()
    details = dict(error.trailing_metadata())["grpc-status-details-bin"]
    status = rpc_status.status_pb2.Status.FromString(details)
    bad_request = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad_request)
    assert [(v.field, v.description) for v in bad_request.field_violations] == [
        ("spec.name", "must not be empty"), ("spec.roles.worker.replicas", "must be >= 1, but got 0")]


async def test_many_violations_or_a_long_message_stay_their_code_within_the_metadata_limit(jobs_target: str) -> None:
    """60 violations of 350 characters each (21 KiB of text), or a 40 KiB name in a NotFound, would pass
    gRPC's 16 KiB metadata limit (the client then gets RESOURCE_EXHAUSTED, naming nothing): the first
    violations are sent whole and the rest counted, the code stays."""
    async with grpc.aio.insecure_channel(jobs_target) as channel:
        stub = jobs_pb2_grpc.JobServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as invalid:
            await stub.CancelJob(jobs_pb2.CancelJobRequest(name="jobs/j"))
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.GetJob(jobs_pb2.GetJobRequest(name="jobs/" + "n" * 40_000))
    error = invalid.value
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details().startswith("spec.roles.worker.env.VARIABLE_0: must be under 64 KiB")
    violations = field_violations(error)
    assert 1 <= len(violations) < 60 and violations[0][0] == "spec.roles.worker.env.VARIABLE_0"
    assert error.details().endswith(f"; and {60 - error.details().count('VARIABLE_')} more")
    assert missing.value.code() is grpc.StatusCode.NOT_FOUND
    assert missing.value.details().startswith("job 'jobs/nnn") and missing.value.details().endswith("...")


async def test_the_client_rebuilds_domain_errors_with_their_fields(jobs_target: str) -> None:
    def use_the_blocking_client() -> None:  # off the loop that serves
        with JobsClient(jobs_target) as client:
            with pytest.raises(InvalidArgument) as invalid:
                client.stub.SubmitJob(jobs_pb2.SubmitJobRequest())
            assert invalid.value.violations == (("spec.name", "must not be empty"),
                                                ("spec.roles.worker.replicas", "must be >= 1, but got 0"))
            assert invalid.value.field == "spec.name"
            with pytest.raises(NotFound, match="does not exist"):
                client.stub.GetJob(jobs_pb2.GetJobRequest(name="jobs/x"))
            stream = client.stub.WatchJobs(jobs_pb2.WatchJobsRequest())
            assert next(stream) == jobs_pb2.JobChange()
            with pytest.raises(NotFound, match="lost its job"):
                next(stream)

    await asyncio.to_thread(use_the_blocking_client)


async def test_pages_follow_the_page_tokens_to_the_end(jobs_target: str) -> None:
    def list_all() -> list[str]:
        with JobsClient(jobs_target) as client:
            return [job.name for job in pages(
                lambda token: client.stub.ListJobs(jobs_pb2.ListJobsRequest(page_token=token)), lambda r: r.jobs)]

    assert await asyncio.to_thread(list_all) == [f"jobs/j{n}" for n in range(5)]


async def test_the_asyncio_client_rebuilds_domain_errors_and_follows_pages(jobs_target: str) -> None:
    async with AsyncJobsClient(jobs_target) as client:
        with pytest.raises(InvalidArgument) as invalid:
            await client.stub.SubmitJob(jobs_pb2.SubmitJobRequest())
        assert invalid.value.violations == (("spec.name", "must not be empty"),
                                            ("spec.roles.worker.replicas", "must be >= 1, but got 0"))
        with pytest.raises(NotFound, match="does not exist"):
            await client.stub.GetJob(jobs_pb2.GetJobRequest(name="jobs/x"))
        stream = client.stub.WatchJobs(jobs_pb2.WatchJobsRequest())
        assert await anext(stream) == jobs_pb2.JobChange()
        with pytest.raises(NotFound, match="lost its job"):
            await anext(stream)
        names = [job.name async for job in async_pages(
            lambda token: client.stub.ListJobs(jobs_pb2.ListJobsRequest(page_token=token)), lambda r: r.jobs)]
    assert names == [f"jobs/j{n}" for n in range(5)]


async def test_the_asyncio_client_sends_its_token_and_a_call_its_closing_cuts_short_fails(
        jobs: Jobs, jobs_target: str) -> None:
    """The call fails with a domain error, as a blocking client's does, not as a cancellation of the
    caller's task (which would stop the caller as if it had been cancelled)."""
    client = AsyncJobsClient(jobs_target, token="the-token")
    call = asyncio.create_task(client.stub.PreemptJob(jobs_pb2.PreemptJobRequest(name="jobs/x")))
    await jobs.preempting.wait()
    assert jobs.preempt_metadata["authorization"] == "Bearer the-token"
    await client.close()
    with pytest.raises(OpmlError, match="the client was closed during the call"):
        await call


# -- run_service's order --------------------------------------------------------------------------

class Part(Component):
    def __init__(self, name: str, log: list[str]) -> None:
        super().__init__()
        self.name, self.log = name, log

    async def on_start(self) -> None:
        self.log.append(f"start {self.name}")

    async def on_stop(self) -> None:
        self.log.append(f"stop {self.name}")


def test_a_component_starts_and_stops_once() -> None:
    async def scenario() -> list[str]:
        log: list[str] = []
        part = Part("a", log)
        await part.stop()  # never started: nothing to stop
        async with part:
            await part.start()
            assert part.running
        await part.stop()
        return log

    assert asyncio.run(scenario()) == ["start a", "stop a"]


def _spec(tmp_path: Path) -> tuple[ServiceSpec, ServiceSettings]:
    class Settings(ServiceSettings):
        home: Path = tmp_path

    return ServiceSpec(name="template-test", module="none", settings=Settings), Settings(grpc_port=0, metrics_port=0)


async def test_parts_stop_in_reverse_after_the_server_drains(tmp_path: Path) -> None:
    spec, settings = _spec(tmp_path)
    log: list[str] = []
    stop = asyncio.Event()

    async def build(service: ServiceContext) -> list[ServiceRegistration]:
        await service.start(Part("store", log))
        await service.start(Part("core", log))
        service.on_draining(lambda: log.append("draining"))
        service.on_stop(lambda: _append(log, "server drained"))  # registered before the server: runs after it
        stop.set()  # the stop request arrives as soon as everything is up
        return [_registration()]

    await serve(spec, build, settings=settings, platform=PlatformSettings(),
                metrics=ServiceMetrics("template-test", CollectorRegistry()), until=stop.wait())
    assert log == ["start store", "start core", "draining", "server drained", "stop core", "stop store"]


async def _append(log: list[str], entry: str) -> None:
    log.append(entry)


async def test_a_background_part_that_fails_ends_the_service_with_its_error(tmp_path: Path) -> None:
    spec, settings = _spec(tmp_path)
    log: list[str] = []

    async def consumer_dies() -> None:
        raise RuntimeError("the consumer lost its broker")

    async def build(service: ServiceContext) -> list[ServiceRegistration]:
        await service.start(Part("store", log))
        service.run_in_background(consumer_dies, name="consumer")
        return [_registration()]

    with pytest.raises(RuntimeError, match="lost its broker"):
        await serve(spec, build, settings=settings, platform=PlatformSettings(),
                    metrics=ServiceMetrics("template-test", CollectorRegistry()), until=asyncio.Event().wait())
    assert log == ["start store", "stop store"]


async def test_a_stop_request_ends_background_parts_through_their_stop(tmp_path: Path) -> None:
    spec, settings = _spec(tmp_path)
    stopped, started, stop = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def consume() -> None:
        started.set()
        await stopped.wait()

    async def stop_consuming() -> None:
        stopped.set()

    async def build(service: ServiceContext) -> list[ServiceRegistration]:
        service.run_in_background(consume, stop=stop_consuming, name="consumer")
        return [_registration()]

    async def request_stop() -> None:
        await started.wait()
        stop.set()

    await asyncio.gather(serve(spec, build, settings=settings, platform=PlatformSettings(),
                               metrics=ServiceMetrics("template-test", CollectorRegistry()), until=stop.wait()),
                         request_stop())
    assert stopped.is_set()


# -- topics and the emitter -----------------------------------------------------------------------

def test_every_events_proto_declares_a_distinct_topic() -> None:
    protos = Path(__file__).resolve().parents[3] / "protos" / "opml"
    files = sorted(p for p in protos.glob("*/v1/*events.proto"))
    assert files, "no events protos found"
    import importlib

    topics = {}
    for path in files:
        module = importlib.import_module(".".join(path.relative_to(protos.parent).with_suffix("").parts) + "_pb2")
        topics[path.name + str(path.parent)] = Topic.of(module).name
    assert len(set(topics.values())) == len(topics), topics


def test_a_proto_file_without_a_topic_is_refused() -> None:
    with pytest.raises(ValueError, match="declares no topic"):
        Topic.of(bundles_pb2)


def test_the_emitter_records_events_from_any_thread_and_the_outbox_publishes_them(tmp_path: Path) -> None:
    class Broker:
        def __init__(self) -> None:
            self.got: list[tuple[str, str]] = []
            self.arrived = asyncio.Event()

        async def publish(self, topic: Topic, event) -> None:
            self.got.append((topic.name, event.subject))
            if len(self.got) == 2:
                self.arrived.set()

    async def scenario() -> list[tuple[str, str]]:
        broker = Broker()
        outbox = Outbox(tmp_path / "outbox", broker, ServiceMetrics("template-test", CollectorRegistry()))
        async with outbox_running(outbox):
            emitter = OutboxEmitter(outbox, source="opml/template-test")
            emitter.emit(bundle_events_pb2.BundleDeleted(uuid="1"), subject="from-the-loop")
            worker = threading.Thread(target=emitter.emit, args=(bundle_events_pb2.BundleDeleted(uuid="2"),),
                                      kwargs={"subject": "from-a-thread"})
            worker.start()
            worker.join()
            await broker.arrived.wait()
        return broker.got

    assert asyncio.run(scenario()) == [("opml.bundles.v1", "from-the-loop"), ("opml.bundles.v1", "from-a-thread")]


class outbox_running:  # noqa: N801 - reads as a context manager
    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox

    async def __aenter__(self) -> Outbox:
        await self.outbox.start()
        return self.outbox

    async def __aexit__(self, *exc: object) -> None:
        await self.outbox.stop()


def test_the_recording_emitter_keeps_topic_source_and_order() -> None:
    emitter = RecordingEmitter(source="opml/core-under-test")
    emitter.emit(bundle_events_pb2.BundleDeleted(uuid="a"), subject="x")
    emitter.emit(bundle_events_pb2.BundleDeleted(uuid="b"), subject="y")
    assert [(t.name, e.subject, e.source) for t, e in emitter.events] == [
        ("opml.bundles.v1", "x", "opml/core-under-test"), ("opml.bundles.v1", "y", "opml/core-under-test")]
    assert topic_of(emitter.messages[0]) == Topic.of(bundle_events_pb2)


# -- the CLI group ----------------------------------------------------------------------------------

def test_a_service_group_takes_target_and_token_from_options_or_the_environment() -> None:
    @service_group("widget", service="widget-store", client=JobsClient, default_target="127.0.0.1:1",
                   options=(click.option("--shelf", default="top"),))
    def widget() -> None:
        """Widgets."""

    @widget.command("where")
    @pass_session
    def where(session) -> None:
        click.echo(f"{session.target} {session.token} {session.options['shelf']} {session.client_class.__name__}")

    runner = CliRunner()
    assert runner.invoke(widget, ["where"], env={"OPML_TOKEN": "t0"}).output == "127.0.0.1:1 t0 top JobsClient\n"
    result = runner.invoke(widget, ["--shelf", "low", "where"], env={"OPML_WIDGET_STORE_TARGET": "h:2"})
    assert result.output == "h:2 None low JobsClient\n"
    assert "OPML_WIDGET_STORE_TARGET" in runner.invoke(widget, ["--help"]).output


async def test_every_rpc_has_its_series_at_zero_before_its_first_call() -> None:
    registry = CollectorRegistry()
    server = GrpcServer(settings=ServiceSettings(grpc_port=0, metrics_port=0), platform=PlatformSettings(),
                        metrics=ServiceMetrics("template-test", registry), registrations=[_registration()])
    labels = {"method": "CancelJob", "code": "OK"}
    assert registry.get_sample_value("opml_template_test_grpc_requests_total", labels) == 0
    assert registry.get_sample_value("opml_template_test_grpc_requests_in_flight", {"method": "CancelJob"}) == 0
    assert registry.get_sample_value("opml_template_test_grpc_request_duration_seconds_count",
                                     {"method": "CancelJob"}) == 0
    del server
