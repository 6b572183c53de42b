"""The development stack: ``make up``/``make down`` (:mod:`.stack`), the embedded infrastructure
(:mod:`.devinfra`), the supervisor, a Prometheus for tests and dashboards, services as child processes
(:mod:`.process`) and the pytest plugin with its fixtures (:mod:`.testing`). No production image
installs it; the services' runtime is opml_common, which never imports this package.
"""
