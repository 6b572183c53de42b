"""Which spans a run reads: TFX's resolvers over span bundles.

A data span is a committed bundle tagged ``span`` (an integer) and, optionally, ``version`` (an
integer; default 0) in the ingest step's context. Of each span only its newest version counts
(then the newest commit). The ingest step's window picks the newest span (``latest``), the last N
spans (``rolling``), or every span in ``[start, end]`` (``range``), oldest to newest.
"""

from __future__ import annotations

from collections.abc import Iterable

from opml.bundles.v1 import bundles_pb2
from opml.jobs.v1 import pipelines_pb2 as pb

from opml_common.errors import FailedPrecondition

SPAN_TAG, VERSION_TAG = "span", "version"


def span_number(bundle: bundles_pb2.Bundle) -> int | None:
    """The bundle's span, or None when its ``span`` tag is missing or not an integer >= 0."""
    text = bundle.tags.get(SPAN_TAG, "")
    return int(text) if text.isdigit() else None


def _version(bundle: bundles_pb2.Bundle) -> int:
    text = bundle.tags.get(VERSION_TAG, "0")
    return int(text) if text.isdigit() else -1


def matches(bundle: bundles_pb2.Bundle, ingest: pb.IngestConfig) -> bool:
    """Whether ``bundle`` is a span of ``ingest``: its context, bundle name and tags, and a span tag."""
    return (bundle.context == ingest.context and span_number(bundle) is not None
            and (not ingest.bundle_name or bundle.bundle_name == ingest.bundle_name)
            and all(bundle.tags.get(k) == v for k, v in ingest.tags.items()))


def resolve(bundles: Iterable[bundles_pb2.Bundle], ingest: pb.IngestConfig) -> list[bundles_pb2.Bundle]:
    """The spans ``ingest`` reads among ``bundles`` (committed ones of its context), oldest first.

    Raises:
        FailedPrecondition: no span is in the window (a run has nothing to read).
    """
    newest: dict[int, bundles_pb2.Bundle] = {}
    for bundle in bundles:
        if not bundle.committed or not matches(bundle, ingest):
            continue
        span = span_number(bundle)
        assert span is not None
        kept = newest.get(span)
        if kept is None or (_version(bundle), bundle.commit_time.ToNanoseconds()) > (
                _version(kept), kept.commit_time.ToNanoseconds()):
            newest[span] = bundle
    spans = sorted(newest)
    window = ingest.WhichOneof("window")
    if window == "rolling":
        spans = spans[-ingest.rolling:]
    elif window == "range":
        spans = [s for s in spans if ingest.range.start <= s <= ingest.range.end]
    else:
        spans = spans[-1:]
    if not spans:
        where = f"context {ingest.context!r}" + (f", bundle {ingest.bundle_name!r}" if ingest.bundle_name else "")
        raise FailedPrecondition(f"no committed span bundle (tag `span`) in the window of {where}"
                                 + (f" with tags {dict(ingest.tags)}" if ingest.tags else ""))
    return [newest[s] for s in spans]
