"""The tracer injected into a user's TensorFlow job: no line of the job changes.

``launcher`` builds the environment (PYTHONPATH gets ``boot/``, whose ``sitecustomize`` keeps spare
frame-stack chunks with ``spare_chunks`` and installs post-import hooks) and starts the host's shipper (``ship``) when none runs; ``tracer`` activates
when the job imports TensorFlow and patches it (``patches``), records cheap per-step metrics
(``recorder``), writes them in batches to the spool (``spool``), obeys the service's Redis keys
(``control``, ``resp``) and runs on-demand op-level captures (``capture``, ``xspace``). Inside the
job everything runs on the standard library, protobuf and psutil (``config`` reads the settings
without pydantic); ``ship`` publishes the spool to the broker from its own process.
"""
