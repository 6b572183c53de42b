"""Worker hosts: machines beside the router's that run its workers, at sites of their own.

:mod:`.agent` is the process each host runs (``opml-inference-host``); :mod:`.registry` and
:mod:`.service` are the router's side (who serves which fleet worker, liveness, measured links);
:mod:`.remote` the router's clients of a host's agent and workers; :mod:`.forwarding` carries a
host's own predictions to the router through a durable outbox.
"""
