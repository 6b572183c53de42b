"""The tracer injected into a user's TensorFlow job: no line of the job changes.

``launcher`` builds the environment (PYTHONPATH gets ``boot/``, whose ``sitecustomize`` installs
post-import hooks); ``tracer`` activates when the job imports TensorFlow and patches it
(``patches``), records cheap per-step metrics (``recorder``), sends them in batches (``sender``),
obeys the service's Redis keys (``control``) and runs on-demand op-level captures (``capture``,
``xspace``). Modules imported by ``boot/sitecustomize.py`` use only the standard library.
"""
