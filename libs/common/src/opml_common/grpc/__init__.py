"""gRPC runtime of every service: server bootstrap, interceptors, and client helpers."""
