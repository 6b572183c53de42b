"""A model's external data is confined to the model's own folder.

An ONNX tensor may keep its bytes in another file, named by the ``location`` key of its
``external_data``. A bundle comes from a writer, so that name is not trusted: a model naming
``s3.json``, ``/etc/...`` or ``../x`` would have the worker read that file into a tensor and
serve it back (a session built from bytes resolves relative locations against the process's
working directory). :func:`check_external_data` reads the graph without its external data and
refuses every tensor whose location is absolute, leaves the model's folder, passes through a
symlink, or is not a regular file there; sessions then resolve locations against that folder
(:func:`~opml_inference_router.runtime.session.build_session`), never the working directory.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import onnx
from onnx import AttributeProto, GraphProto, ModelProto, NodeProto, SparseTensorProto, TensorProto

from opml_common.errors import InvalidArgument, brief

MAX_LISTED = 5
"""Refused tensors named in one error; the rest are counted."""
SHOWN_CHARS = 300
"""A location is shown up to this long (a path of a few folders whole; a huge one cut)."""


def check_external_data(model_file: Path, *, name: str) -> None:
    """Refuses a model any of whose tensors keeps its data outside ``model_file``'s folder.

    Args:
        model_file: the ONNX file.
        name: how errors name the file (its path in the bundle, e.g. ``model.onnx``).

    Raises:
        InvalidArgument: field ``name``, one violation per refused tensor naming the tensor and the
            location (``tensor 'W1' names external data '../x' outside the model's folder``); or
            the file is not ONNX that onnx can read.
    """
    try:
        model = onnx.load(model_file, load_external_data=False)
    except Exception as error:  # noqa: BLE001 - protobuf's DecodeError and onnx's own; the reason is what matters
        raise InvalidArgument(name, f"cannot be read as an ONNX model: {error}") from None
    folder = model_file.parent.resolve(strict=True)
    refused = [f"tensor {brief(tensor.name)} {problem}" for tensor in _tensors(model)
               if (problem := _problem(tensor, folder)) is not None]
    if refused:
        listed = refused[:MAX_LISTED]
        if len(refused) > MAX_LISTED:
            listed.append(f"and {len(refused) - MAX_LISTED} more tensors name external data outside the model's "
                          f"folder")
        raise InvalidArgument.of([(name, rule) for rule in listed])


def _problem(tensor: TensorProto, folder: Path) -> str | None:
    """Why ``tensor``'s external data is refused, or None (it has none, or it is a regular file in ``folder``)."""
    if tensor.data_location != TensorProto.EXTERNAL and not tensor.external_data:
        return None
    location = next((entry.value for entry in tensor.external_data if entry.key == "location"), "")
    shown = _shown(location)
    if not location:
        return "keeps its data externally but names no location"
    if "\0" in location:
        return f"names external data {shown}, which is not a path"
    if os.path.isabs(location):
        return f"names external data {shown} by an absolute path; it must lie inside the model's folder"
    current = folder
    for part in Path(location).parts:
        if part == "..":
            current = current.parent
            if not current.is_relative_to(folder):
                return f"names external data {shown} outside the model's folder"
            continue
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except OSError:
            return f"names external data {shown}, which is not a file in the model's folder"
        if stat.S_ISLNK(mode):
            return (f"names external data {shown} through a symlink "
                    f"({_shown(current.relative_to(folder).as_posix())}); it must be a regular file inside the "
                    f"model's folder")
    if current == folder or not stat.S_ISREG(os.lstat(current).st_mode):
        return f"names external data {shown}, which is not a file in the model's folder"
    return None


def _shown(path: str) -> str:
    """``path`` quoted, cut at :data:`SHOWN_CHARS` (``brief`` would cut a path to a few dozen)."""
    return repr(path[:SHOWN_CHARS]) + ("..." if len(path) > SHOWN_CHARS else "")


def _tensors(model: ModelProto) -> Iterator[TensorProto]:
    """Every tensor the model holds: the graphs' initializers (sparse ones too) and the tensors in
    node attributes, in subgraphs, functions and training graphs."""
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        yield from _node_tensors(function.node)
    for training in model.training_info:
        yield from _graph_tensors(training.initialization)
        yield from _graph_tensors(training.algorithm)


def _graph_tensors(graph: GraphProto) -> Iterator[TensorProto]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from _sparse(sparse)
    yield from _node_tensors(graph.node)


def _node_tensors(nodes: list[NodeProto]) -> Iterator[TensorProto]:
    for node in nodes:
        for attribute in node.attribute:
            yield from _attribute_tensors(attribute)


def _attribute_tensors(attribute: AttributeProto) -> Iterator[TensorProto]:
    if attribute.HasField("t"):
        yield attribute.t
    yield from attribute.tensors
    if attribute.HasField("sparse_tensor"):
        yield from _sparse(attribute.sparse_tensor)
    for sparse in attribute.sparse_tensors:
        yield from _sparse(sparse)
    if attribute.HasField("g"):
        yield from _graph_tensors(attribute.g)
    for graph in attribute.graphs:
        yield from _graph_tensors(graph)


def _sparse(sparse: SparseTensorProto) -> Iterator[TensorProto]:
    yield sparse.values
    yield sparse.indices
