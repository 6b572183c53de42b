"""The variables that tell a trial's job where, and with what grant, it uploads its model.

The controller sets them (:mod:`.models`); the trial's SDK reads them (:func:`.sdk.save_model`). A
module of its own so that the SDK, imported by every trial, loads nothing of the controller.
"""

TARGET_VARIABLE = "AUTOML_BUNDLE_STORE_TARGET"
GRANT_VARIABLE = "AUTOML_MODEL_GRANT"
"""Secret env of a trial's job (the orchestrator shows it to no one): where the bundle-store is, and the
trial's upload grant."""
CONTEXT_VARIABLE = "AUTOML_MODEL_CONTEXT"
BUNDLE_VARIABLE = "AUTOML_MODEL_BUNDLE"
MAX_BYTES_VARIABLE = "AUTOML_MODEL_MAX_BYTES"
"""Env of a trial's job: the context and the bundle name its grant allows, and the most it may upload."""
RESERVED_PREFIX = "AUTOML_"
"""A trial template's env may set no variable starting so: the controller's to set."""
