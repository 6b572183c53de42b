"""A model bundle on disk: ``model.yaml`` (the ModelConfig) and its ONNX file per version.

Two layouts: flat (``model.yaml`` + ``model.onnx``, one version, numbered by whoever loads it, as
a bundle from bundle-store holds it) and Triton's repository layout (``model.yaml`` +
``<version>/model.onnx``, the config's ``version_policy`` choosing which versions are served).
Every ONNX file's external data must lie in that file's folder (:mod:`.external_data`), checked
before anything loads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from opml_common.errors import InvalidArgument, NotFound
from opml_inference_router.runtime.external_data import check_external_data
from opml_inference_router_contract.model_config import ModelConfig, load_model_config, version_number

CONFIG_FILE = "model.yaml"
MODEL_FILE = "model.onnx"


@dataclass(frozen=True)
class ModelBundle:
    """A model's config and the ONNX file of each version it holds."""

    directory: Path
    config: ModelConfig
    files: dict[int, Path]

    def select(self, version: int | None = None) -> dict[int, Path]:
        """The versions to serve: ``version`` alone, else those the config's version policy picks.

        Raises:
            NotFound: ``version`` is not in the bundle, or the policy names a missing one.
        """
        if version is not None:
            if version not in self.files:
                raise NotFound(f"version {version} of model {self.config.name} is not in {self.directory} "
                               f"(it holds {sorted(self.files)})")
            return {version: self.files[version]}
        return {v: self.files[v] for v in self.config.version_policy.select(list(self.files))}


def load_bundle(directory: str | Path, *, flat_version: int = 1) -> ModelBundle:
    """Reads a bundle directory; a flat bundle's one ONNX file becomes version ``flat_version``.

    Raises:
        NotFound: the directory, its model.yaml, or any ONNX file is missing.
        InvalidArgument: model.yaml breaks a rule (field = its path in the config); an ONNX file is not
            readable, or names external data that is not a regular file in its folder (field = its path
            in the bundle, e.g. ``model.onnx``, the message naming each tensor and location).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise NotFound(f"model directory {directory} does not exist")
    config = load_model_config(directory / CONFIG_FILE)
    if (directory / MODEL_FILE).is_file():
        if flat_version < 1:
            raise InvalidArgument("version", f"must be >= 1, but got {flat_version}")
        files = {flat_version: directory / MODEL_FILE}
    else:
        files = {number: child / MODEL_FILE for child in directory.iterdir()
                 if child.is_dir() and (number := version_number(child.name)) is not None
                 and (child / MODEL_FILE).is_file()}
    if not files:
        raise NotFound(f"model directory {directory} holds neither {MODEL_FILE} nor <version>/{MODEL_FILE}")
    for file in files.values():
        check_external_data(file, name=file.relative_to(directory).as_posix())
    return ModelBundle(directory, config, files)


def write_bundle(directory: Path, *, config_json: str, files: dict[str, bytes]) -> Path:
    """Materializes a bundle sent over the wire (Triton's load ``config`` + ``file:<path>`` parameters)
    in ``directory``: the config as model.yaml (JSON is YAML), each file at its relative path.

    Raises:
        InvalidArgument: a file path that is absolute or climbs out of the bundle (field
            ``parameters[file:<path>]``), or no ONNX file among the files.
    """
    directory.mkdir(parents=True, exist_ok=True)
    for relative, content in files.items():
        target = (directory / relative).resolve()
        if Path(relative).is_absolute() or not target.is_relative_to(directory.resolve()):
            raise InvalidArgument(f"parameters[file:{relative}]", "must be a path inside the model directory, "
                                                                  "like 1/model.onnx or model.onnx")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
    if not any(Path(relative).name == MODEL_FILE for relative in files):
        raise InvalidArgument("parameters", f"the files sent hold no {MODEL_FILE} (send file:{MODEL_FILE} "
                                            f"or file:<version>/{MODEL_FILE})")
    (directory / CONFIG_FILE).write_text(config_json)
    return directory
