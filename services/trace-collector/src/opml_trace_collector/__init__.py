"""Trace collector: zero-change tracing of TensorFlow jobs (after tensorflow-tracing, OpML '19)."""
