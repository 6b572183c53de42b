"""The tracer's settings as a pydantic class, for the shipper, the CLI and the config doc.

Built from ``config.FIELDS``, the one definition of the ``OPML_TRACE_*`` names, defaults and rules;
the job itself reads them with ``config.read`` (standard library: pydantic costs a job ~70 ms of
CPU to import). A test checks the two agree on every field.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, create_model, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from opml_trace_collector.inject.config import FIELDS, Spec, convert


def _field(spec: Spec) -> tuple[object, object]:
    kind = spec.kind | None if spec.optional else spec.kind
    bounds = {key: value for key, value in (("min_length", spec.min_length), ("gt", spec.gt), ("ge", spec.ge))
              if value is not None}
    if spec.kind is float:
        bounds["allow_inf_nan"] = False
    return kind, Field(spec.default, description=spec.description, **bounds)


class _Base(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OPML_TRACE_", frozen=True, extra="ignore")

    @field_validator(*(name for name, spec in FIELDS.items() if spec.kind is Path), check_fields=False)
    @classmethod
    def _expand(cls, value: Path) -> Path:
        return value.expanduser()

    @field_validator(*(name for name, spec in FIELDS.items() if spec.regex), check_fields=False)
    @classmethod
    def _valid_regex(cls, value: str | None, info) -> str | None:  # noqa: ANN001 - pydantic's ValidationInfo
        return convert(info.field_name, FIELDS[info.field_name], value) if value else None

    @property
    def subject(self) -> str:
        return f"{self.job}/{self.worker}"


TracerSettings = create_model("TracerSettings", __base__=_Base, __doc__="Where a traced worker reports, how often, "
                              "and how big an on-demand capture may get.",
                              **{name: _field(spec) for name, spec in FIELDS.items()})
