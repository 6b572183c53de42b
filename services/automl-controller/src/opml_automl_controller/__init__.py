"""automl-controller: Katib v1beta1 Experiments on Optuna's samplers and pruners, trials as TE jobs."""
