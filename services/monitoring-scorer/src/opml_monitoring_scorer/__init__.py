"""monitoring-scorer: label-free prediction quality, drift and alerts on the live prediction stream."""
