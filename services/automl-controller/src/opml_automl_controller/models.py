"""Trials' models, uploaded by the trials themselves, and the best one committed as a servable bundle.

A trial of an experiment with ``spec.model`` (:mod:`.modelspec`) gets an upload grant of the
bundle-store (:meth:`ModelStore.grant_upload`): a token that lets it add versions of one bundle,
named as the trial's job, ``{experiment}-{uid}-t{n}`` (:func:`trial_bundle_name`),, into the experiment's context, at most
``maxBytes`` each, and nothing else. The controller hands it to the trial's job as secret env (with
the store's address), never its own token; the trial uploads its model through the bundle-store's API
(:func:`opml_automl_controller.sdk.save_model`), so trials may run on any machine: no volume is shared.
Once the trial has ended its grant is revoked (:meth:`ModelStore.revoke_upload`, :mod:`.grants`): a
finished trial's job, or whoever read its env, uploads nothing more.

When the experiment ends, :meth:`ModelStore.commit_best` re-reads the best trial's bundle from the
bundle-store (the trial's log line naming it is a hint: the store is the truth), checks it is there,
complete and within the experiment's bound (a trial's versions are uncommitted: its grant cannot commit,
so nothing serves or monitors a trial's model by itself), and commits its files with the experiment's
serving files as ``{experiment}-best``: ``rollout.yaml`` and ``monitoring.yaml`` from ``spec.model``
(over the trial's own, if it uploaded them), the ``serve``/``canary`` tags, values (the parameters,
the objective, each metric's latest), and lineage (the trial's bundle as its input, the trial's
parameters, the job that made it). The files are copied through the API (the store has no add by
reference). Idempotent: a bundle already tagged with the experiment's uid is returned, not added again
(a restart between the commit and the experiment's record).
"""

from __future__ import annotations

import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from opml.bundles.v1 import bundles_pb2

from opml_automl_controller.modelspec import ModelPolicy
from opml_automl_controller.state import ExperimentRecord, TrialRecord
from opml_automl_controller.uploadenv import (
    BUNDLE_VARIABLE,
    CONTEXT_VARIABLE,
    GRANT_VARIABLE,
    MAX_BYTES_VARIABLE,
    TARGET_VARIABLE,
)
from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.errors import FailedPrecondition, NotFound


class ModelRefused(FailedPrecondition):
    """A trial's model is not committed; the message says why (never the content of any file)."""


@dataclass(frozen=True, slots=True)
class TrialUpload:
    """What a trial's job is given to upload its model: ``env`` shown with the job, ``secret_env`` not;
    ``grant_id`` names the grant (no secret), kept on the trial to revoke it once the trial has ended."""

    env: dict[str, str]
    secret_env: dict[str, str]
    grant_id: str


def trial_bundle_name(trial: TrialRecord) -> str:
    """The one bundle a trial may upload: named as its job, ``{experiment}-{uid}-t{n}`` (a valid bundle
    name), so a re-created experiment of the same name never meets the old one's bundles."""
    return trial.job_id


class ModelStore(ABC):
    @abstractmethod
    def grant_upload(self, trial: TrialRecord, policy: ModelPolicy, ttl_s: int) -> TrialUpload:
        """An upload grant of the trial's own bundle, valid ``ttl_s`` seconds, as its job's env."""

    @abstractmethod
    def revoke_upload(self, grant_id: str) -> None:
        """Revoke the upload grant ``grant_id`` (:attr:`TrialUpload.grant_id`): refused by the store from
        now on. Idempotent.

        Raises:
            OpmlError: the store refused or did not answer (retriable: Unavailable).
        """

    @abstractmethod
    def commit_best(self, experiment: ExperimentRecord, trial: TrialRecord, policy: ModelPolicy, *, objective: str,
                    algorithm: str) -> str:
        """Commit the model ``trial`` uploaded as the experiment's best; return the bundle's name.

        Raises:
            ModelRefused: the trial uploaded no bundle, or one that is not complete (a file not stored
                here, none at all, no ``model.yaml`` for a served model) or over the bound.
        """


class BundleStoreModels(ModelStore):
    """``target`` for the controller's own calls (with ``token``, the writer role), ``trial_target`` the
    address trials reach the store at (the same by default)."""

    def __init__(self, target: str, *, token: str | None = None, context: str = "automl",
                 trial_target: str | None = None) -> None:
        self._client = BundleStoreClient(target, token=token)
        self._context = context
        self._trial_target = trial_target or target

    async def aclose(self) -> None:
        self._client.close()

    def _ensure_context(self) -> None:
        try:
            self._client.get_context(self._context)
        except NotFound:
            self._client.create_context(self._context)

    def grant_upload(self, trial: TrialRecord, policy: ModelPolicy, ttl_s: int) -> TrialUpload:
        self._ensure_context()
        name = trial_bundle_name(trial)
        grant = self._client.issue_upload_grant(self._context, name, ttl_s=ttl_s, max_bytes=policy.max_bytes)
        return TrialUpload(env={CONTEXT_VARIABLE: self._context, BUNDLE_VARIABLE: name,
                                MAX_BYTES_VARIABLE: str(policy.max_bytes)},
                           secret_env={TARGET_VARIABLE: self._trial_target, GRANT_VARIABLE: grant.token},
                           grant_id=grant.grant_id)

    def revoke_upload(self, grant_id: str) -> None:
        self._client.revoke_upload_grant(self._context, grant_id)

    def commit_best(self, experiment: ExperimentRecord, trial: TrialRecord, policy: ModelPolicy, *, objective: str,
                    algorithm: str) -> str:
        self._ensure_context()
        done = self._client.list_bundles(self._context, tags={"experiment-uid": experiment.uid})
        if done:
            return done[0].name
        uploaded = self._uploaded(trial, policy)
        tags = {"kind": "model", "source": "automl-controller", "experiment": experiment.name,
                "experiment-uid": experiment.uid, "trial": str(trial.number), "algorithm": algorithm,
                **policy.tags()}
        values: dict[str, float | str] = {f"param.{k}": v for k, v in trial.parameters.items()}
        values[f"objective.{objective}"] = float(trial.objective_value or 0.0)
        for metric, series in trial.observations.items():
            if series:
                values[f"metric.{metric}"] = float(series[-1])
        lineage = bundles_pb2.Lineage(input_uuids=[uploaded.uuid], parameters=trial.parameters,
                                      creator="automl-controller", code_version=f"jobs/{trial.job_id}")
        serving = {"rollout.yaml": policy.rollout_yaml, "monitoring.yaml": policy.monitoring_yaml}
        with tempfile.TemporaryDirectory(prefix="opml-automl-model-") as copies:
            files: dict[str, Path | bytes] = {}
            for entry in uploaded.files:
                if serving.get(entry.path):
                    continue  # the experiment's own serving file replaces the trial's
                copy = Path(copies) / str(len(files))
                with copy.open("wb") as sink:
                    sink.writelines(self._client.read_file(self._context, uploaded.uuid, entry.path))
                files[entry.path] = copy
            files.update({path: text.encode() for path, text in serving.items() if text})
            bundle = self._client.add(self._context, f"{experiment.name}-best", files, values=values, tags=tags,
                                      lineage=lineage, commit=True)
        return bundle.name

    def _uploaded(self, trial: TrialRecord, policy: ModelPolicy) -> bundles_pb2.Bundle:
        """The trial's bundle as the store has it: the version its log named, if the store has that one
        under the trial's name, else the trial's latest version."""
        name = trial_bundle_name(trial)
        versions = self._client.list_bundles(self._context, bundle_name=name)
        if not versions:
            raise ModelRefused(f"the trial uploaded no bundle {name!r} to context {self._context!r} "
                               f"(does it call opml_automl_controller.sdk.save_model?)")
        bundle = next((b for b in versions if b.uuid == trial.model_bundle), versions[0])
        size = sum(entry.size_bytes for entry in bundle.files)
        problems = []
        if not bundle.files:
            problems.append("it holds no file")
        if not bundle.localized:
            problems.append("its files are not all stored in the bundle-store")
        if size > policy.max_bytes:
            problems.append(f"it holds {size} bytes, more than spec.model.maxBytes ({policy.max_bytes})")
        if policy.serve and "model.yaml" not in {entry.path for entry in bundle.files}:
            problems.append("it has no model.yaml at its root, which the inference-router serves a model by")
        if problems:
            raise ModelRefused(f"the trial's bundle {name!r} ({bundle.uuid}) is not a complete model: "
                               + "; ".join(problems))
        return bundle
