"""The best trial's model, committed as a bundle with its lineage (bundle-store).

A trial says where it saved its model with :func:`opml_automl_controller.sdk.save_model` (one
marked line in its log, as the Push metrics travel), a path in its own model folder
(:mod:`.trialmodel`). When the experiment ends with a best trial that saved one, the controller
commits it as bundle ``{experiment}-best`` in the configured context: its files (copied out of the
trial's folder without following any symlink, :func:`~.trialmodel.copy_model`), values (the
parameters, the objective and every metric's latest), tags that say what it is, and lineage (the
trial's parameters, the job that made it). The folder is read from the controller's filesystem, so
this works where trials run on the controller's machine (the orchestrator's local executor); on the
Kubernetes executor a trial would push its model to a volume the controller mounts.

:class:`ModelStore` is the port; :class:`BundleStoreModels` the real one. Idempotent: a bundle
already tagged with the experiment's uid is returned, not added again (a restart between the
commit and the experiment's record).
"""

from __future__ import annotations

import tempfile
from abc import ABC, abstractmethod
from pathlib import Path

from opml.bundles.v1 import bundles_pb2

from opml_automl_controller.state import ExperimentRecord, TrialRecord
from opml_automl_controller.trialmodel import copy_model
from opml_bundle_store_contract.client import BundleStoreClient
from opml_common.errors import NotFound


class ModelStore(ABC):
    @abstractmethod
    def commit_best(self, experiment: ExperimentRecord, trial: TrialRecord, folder: Path, *, objective: str,
                    algorithm: str) -> str:
        """Commit the model at ``trial.model_dir`` in the trial's model ``folder`` as the experiment's
        best model; return the bundle's name.

        Raises:
            ModelRefused: the model is not (or no longer) regular files inside ``folder``
                (:func:`~.trialmodel.copy_model`).
        """


class BundleStoreModels(ModelStore):
    def __init__(self, target: str, *, token: str | None = None, context: str = "automl") -> None:
        self._client = BundleStoreClient(target, token=token)
        self._context = context

    async def aclose(self) -> None:
        self._client.close()

    def commit_best(self, experiment: ExperimentRecord, trial: TrialRecord, folder: Path, *, objective: str,
                    algorithm: str) -> str:
        tags = {"kind": "model", "source": "automl-controller", "experiment": experiment.name,
                "experiment-uid": experiment.uid, "trial": str(trial.number), "algorithm": algorithm}
        try:
            self._client.get_context(self._context)
        except NotFound:
            self._client.create_context(self._context)
        done = self._client.list_bundles(self._context, tags={"experiment-uid": experiment.uid})
        if done:
            return done[0].name
        values: dict[str, float | str] = {f"param.{k}": v for k, v in trial.parameters.items()}
        values[f"objective.{objective}"] = float(trial.objective_value or 0.0)
        for metric, series in trial.observations.items():
            if series:
                values[f"metric.{metric}"] = float(series[-1])
        lineage = bundles_pb2.Lineage(parameters=trial.parameters, creator="automl-controller",
                                      code_version=f"jobs/{trial.job_id}")
        with tempfile.TemporaryDirectory(prefix="opml-automl-model-") as copies:
            files = copy_model(folder, trial.model_dir or "", Path(copies))
            bundle = self._client.add(self._context, f"{experiment.name}-best", files, values=values, tags=tags,
                                      lineage=lineage, commit=True)
        return bundle.name
