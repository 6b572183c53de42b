"""The scorer's logic, importing no grpc: estimators, drift, data quality, windows, scores and alert rules."""
