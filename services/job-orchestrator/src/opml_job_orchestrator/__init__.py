"""Job orchestrator (after LinkedIn's TonY and Preferred Networks' TE/BE scheduling).

Built so far: the transport-free scheduler core (:mod:`opml_job_orchestrator.scheduler`), a
discrete-event simulator that drives that same core in virtual time
(:mod:`opml_job_orchestrator.simulator`), and the executors that run a job's role replicas
(:mod:`opml_job_orchestrator.executor`; the local one runs OS processes with TF_CONFIG).
"""
